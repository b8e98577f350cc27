"""When buffered text becomes one stream-log entry (sans-I/O).

The producer appends at most one entry per flush window, or one per
``max_tokens`` tokens, whichever comes first (seed "Streaming LLM Responses
over SSE": flush every 20-50 ms or N tokens). The window is a throttle with a
leading edge: the very first text goes at once so TTFT is not delayed, and so
does any delta that arrives a window or more after the last release; a delta
that arrives sooner waits until one window after that release. So when decode
steps take longer than the window (a CPU box: 20-100 ms per step) every
step's text goes out as soon as the step ends, and no deadline falls inside
the next step; when they are faster (a GPU) their text is batched, one entry
per window. Times are seconds on any monotonic clock the caller supplies.

The window widens while the event loop lags (issue 42): :meth:`Coalescer.pace`
takes, once per decode step, how long the engine waited for the loop after
that step (``lag``), how long the step took, and the share of that time the
loop's thread was busy (``busy``), and keeps them as moving averages over
about one window (a stream's writes come once per window, so its lag comes
in spikes). Where the loop made the engine wait, on average, more than
:data:`LAG_SHARE` of a step (and more than :data:`LAG_FLOOR`), or was busy more than :data:`BUSY_SHARE` of the
time (where the engine's thread waits for the interpreter lock, and every
reader for the loop), the window doubles, up to ``bound`` (like vLLM's
``--stream-interval``, in seconds: fewer, larger writes per stream, so the
loop catches up), and ``max_tokens`` grows with it (a window twice as wide
holds twice the tokens, else the token count would cut it short); where both
are under half that, it halves, back down to ``window``; at most one change
per window. A loop that stays under those
shares never changes it: a reader then waits no longer than with a fixed
window.
"""

from __future__ import annotations

import math

import attrs

#: The share of a decode step the engine may wait for the event loop before the window widens.
#: Issue 42's goal is the engine's rate at 0.95 (and at 0.90 and 0.85 at 128 and 256 streams).
LAG_SHARE = 0.05

#: The lag (seconds) that never widens the window, however short the steps: the hop back from the
#: engine's thread to the loop, which fewer writes do not shorten (an estimate: about 0.1 ms on a
#: quiet machine, a few times that on a loaded one). Without it a fast engine (2 ms steps) widened
#: the window of a single stream.
LAG_FLOOR = 0.0005

#: The share of the time the event loop's thread may be busy before the window widens.
BUSY_SHARE = 0.5


@attrs.define
class Coalescer:
    """Buffers deltas and says when to release them.

    Args:
        window: seconds a delta may wait for company (0: release every delta at once).
        max_tokens: release as soon as this many tokens are buffered (times :attr:`current`
            over ``window`` while the window is widened).
        bound: the widest the window becomes while the loop lags (:meth:`pace`); at most
            ``window`` (the default): it never widens.
    """

    window: float
    max_tokens: int
    bound: float = 0.0
    _current: float = attrs.field(init=False)
    _parts: list[str] = attrs.field(factory=list, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _deadline: float = attrs.field(default=math.inf, init=False)
    _released_any: bool = attrs.field(default=False, init=False)
    _last_release: float = attrs.field(default=-math.inf, init=False)
    _changed: float = attrs.field(default=-math.inf, init=False)  # when the window last changed
    _lag: float | None = attrs.field(default=None, init=False)  # moving average of the lag (seconds)
    _step: float = attrs.field(default=0.0, init=False)  # and of the steps (seconds)
    _busy: float = attrs.field(default=0.0, init=False)  # and of the loop's busy share

    def __attrs_post_init__(self) -> None:
        self._current = self.window

    @property
    def deadline(self) -> float:
        """When the buffered text must be released (``inf`` when nothing waits)."""
        return self._deadline

    @property
    def current(self) -> float:
        """The window now (seconds): ``window``, or wider while the loop lags (:meth:`pace`)."""
        return self._current

    def pace(self, lag: float, step: float, busy: float, now: float) -> None:
        """The engine waited ``lag`` seconds for the event loop after a decode step of ``step``
        seconds, and the loop's thread was busy ``busy`` of the time (0 to 1), seen at ``now``
        (call it once per step): widen or narrow the window (module docstring). Text waiting for
        its window gets the new one's deadline (one window after the last release)."""
        if self.bound <= self.window or self.window <= 0:
            return
        current = self._current
        if self._lag is None:
            self._lag, self._step, self._busy = lag, step, busy
        else:
            weight = min(1.0, (step + lag) / current)  # a moving average over about one window
            self._lag += weight * (lag - self._lag)
            self._step += weight * (step - self._step)
            self._busy += weight * (busy - self._busy)
        if now < self._changed + current:
            return
        allowed = max(LAG_SHARE * self._step, LAG_FLOOR)
        if (self._lag > allowed or self._busy > BUSY_SHARE) and current < self.bound:
            self._changed = now
            self._resize(min(self.bound, 2 * current))
        elif self._lag < allowed / 2 and self._busy < BUSY_SHARE / 2 and current > self.window:
            self._changed = now
            self._resize(max(self.window, current / 2))

    def _resize(self, window: float) -> None:
        self._current = window
        if self._deadline != math.inf:
            self._deadline = self._last_release + window

    def add(self, text: str, tokens: int, now: float) -> str | None:
        """Buffer a delta; return the text to release now, or None to keep waiting."""
        if text:
            self._parts.append(text)
        self._tokens += tokens
        if not self._parts:
            return None
        if (not self._released_any or self._current <= 0
                or self._tokens >= self.max_tokens * (self._current / self.window)
                or now >= self._last_release + self._current):
            return self.flush(now)
        if self._deadline == math.inf:
            self._deadline = self._last_release + self._current
        return None

    def due(self, now: float, ahead: float = 0.0) -> str | None:
        """The buffered text if its deadline has passed, or passes within ``ahead`` seconds
        (the caller's next chance to ask is that far away: releasing it now is closer to the
        deadline than then), else None."""
        return self.flush(now) if now + ahead >= self._deadline else None

    def flush(self, now: float | None = None) -> str:
        """Release everything buffered ("" when empty) and reset the window.

        ``now`` (when given and there is text) is the release time the next
        window counts from; a flush at a block boundary passes none.
        """
        text = "".join(self._parts)
        self._parts.clear()
        self._tokens = 0
        self._deadline = math.inf
        if text:
            self._released_any = True
            if now is not None:
                self._last_release = now
        return text
