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
"""

from __future__ import annotations

import math

import attrs


@attrs.define
class Coalescer:
    """Buffers deltas and says when to release them.

    Args:
        window: seconds a delta may wait for company (0: release every delta at once).
        max_tokens: release as soon as this many tokens are buffered.
    """

    window: float
    max_tokens: int
    _parts: list[str] = attrs.field(factory=list, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _deadline: float = attrs.field(default=math.inf, init=False)
    _released_any: bool = attrs.field(default=False, init=False)
    _last_release: float = attrs.field(default=-math.inf, init=False)

    @property
    def deadline(self) -> float:
        """When the buffered text must be released (``inf`` when nothing waits)."""
        return self._deadline

    def add(self, text: str, tokens: int, now: float) -> str | None:
        """Buffer a delta; return the text to release now, or None to keep waiting."""
        if text:
            self._parts.append(text)
        self._tokens += tokens
        if not self._parts:
            return None
        if (not self._released_any or self.window <= 0 or self._tokens >= self.max_tokens
                or now >= self._last_release + self.window):
            return self.flush(now)
        if self._deadline == math.inf:
            self._deadline = self._last_release + self.window
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
