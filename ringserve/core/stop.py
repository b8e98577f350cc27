"""Stop-sequence matcher with hold-back (case C7).

Text is fed as it is detokenized. A stop string can arrive split across
tokens ("be" + "ta g" + "amma"), so the matcher never releases text that
could still turn out to be the start of a stop string: it holds back the
longest suffix of the unreleased text that is a proper prefix of some stop
string, and releases the rest. When a stop string completes, it releases
exactly the text before it and reports which stop matched; the stop string
and anything after it are never released.

Which match wins: the generation ends as soon as any stop string has
appeared, so the match that *ends* first in the text wins. If several end
at the same character (one is a suffix of another, as "a\\n" and "\\n"), the
one that starts earliest, i.e. the longest, wins, so the least text is
released. This depends only on the text, never on how it was split.
Choosing "the match that starts earliest" instead would mean reading past a
complete stop string to see whether a longer, earlier one also completes.

Cost per :meth:`StopMatcher.feed`: one ``str.find`` per stop string over the
held text plus the new text (the held text is shorter than the longest stop
string) and at most ``max(len(stop))`` set look-ups; the text already
released is never scanned again.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = ["StopMatch", "StopMatcher"]


@attrs.frozen
class StopMatch:
    """What one :meth:`StopMatcher.feed` gives back.

    Attributes:
        text: text that can be released now (possibly empty).
        stop: the stop string that matched, or None if none has. When set,
            ``text`` is everything up to the start of the match and the
            generation should end.
    """

    text: str
    stop: str | None = None


def _clean_stops(stops: Iterable[str]) -> tuple[str, ...]:
    if isinstance(stops, str):
        raise TypeError("stops must be a sequence of strings, not a single string")
    result = []
    for stop in stops:
        if not isinstance(stop, str):
            raise TypeError(f"stop strings must be str, got {type(stop).__name__}")
        if stop and stop not in result:
            result.append(stop)
    return tuple(result)


@attrs.define(eq=False)
class StopMatcher:
    """Finds the first stop string in streamed text without leaking any of it.

    Empty stop strings are ignored (an empty stop would match before any
    text, which no caller means), and duplicates are dropped; with no stop
    strings left every feed releases its text at once.

    Args:
        stops: the stop strings.

    Raises:
        TypeError: ``stops`` is a single str, or holds a non-str.
    """

    stops: tuple[str, ...] = attrs.field(converter=_clean_stops)
    _held: str = attrs.field(init=False, default="")
    _stop: str | None = attrs.field(init=False, default=None)
    _done: bool = attrs.field(init=False, default=False)
    _max_hold: int = attrs.field(init=False, default=0)
    _prefixes: frozenset[str] = attrs.field(init=False, factory=frozenset)
    _first_chars: frozenset[str] = attrs.field(init=False, factory=frozenset)

    def __attrs_post_init__(self) -> None:
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self.stops)

    @property
    def held(self) -> str:
        """Text fed but not yet released: a proper prefix of some stop string."""
        return self._held

    @property
    def stop(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop

    @property
    def done(self) -> bool:
        """True after a match or :meth:`flush`; further feeds raise."""
        return self._done

    def feed(self, text: str) -> StopMatch:
        """Add generated text; release what can no longer be part of a stop.

        Args:
            text: the next piece of generated text (whole characters).

        Returns:
            ``StopMatch(text, None)`` with the releasable text, or, once a stop
            string completes, ``StopMatch(text_before_match, stop)``; the text
            after the match is dropped.

        Raises:
            RuntimeError: the matcher already matched or was flushed.
        """
        if self._done:
            raise RuntimeError(
                f"StopMatcher.feed after the end (matched stop {self._stop!r})"
                if self._stop is not None
                else "StopMatcher.feed after flush()"
            )
        if not self.stops:
            return StopMatch(text)
        held = self._held
        buf = held + text
        best: str | None = None
        best_end = 0
        for stop in self.stops:
            # The held text holds no whole stop, so a match ends in the new text.
            i = buf.find(stop, max(0, len(held) - len(stop) + 1))
            if i >= 0:
                end = i + len(stop)
                if best is None or end < best_end or (end == best_end and len(stop) > len(best)):
                    best, best_end = stop, end
        if best is not None:
            self._done = True
            self._stop = best
            self._held = ""
            return StopMatch(buf[: best_end - len(best)], best)
        keep = 0
        first = self._first_chars
        prefixes = self._prefixes
        n = len(buf)
        for k in range(min(n, self._max_hold), 0, -1):
            if buf[n - k] in first and buf[n - k :] in prefixes:
                keep = k
                break
        if keep:
            self._held = buf[n - keep :]
            return StopMatch(buf[: n - keep])
        self._held = ""
        return StopMatch(buf)

    def flush(self) -> str:
        """End of generation: release the held text.

        Returns:
            The held text (no stop string completed, so it is plain output),
            or ``""`` after a match. Further feeds raise; flushing again
            returns ``""``.
        """
        self._done = True
        held, self._held = self._held, ""
        return held
