"""When buffered text becomes one stream-log entry (sans-I/O).

The producer appends one entry per flush window or per ``max_tokens``
tokens, whichever comes first, and the very first text at once so TTFT is not
delayed (seed "Streaming LLM Responses over SSE": flush every 20-50 ms or N
tokens). Times are seconds on any monotonic clock the caller supplies.
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
        if not self._released_any or self.window <= 0 or self._tokens >= self.max_tokens:
            return self.flush()
        if self._deadline == math.inf:
            self._deadline = now + self.window
        return None

    def due(self, now: float) -> str | None:
        """The buffered text if its deadline has passed, else None."""
        return self.flush() if now >= self._deadline else None

    def flush(self) -> str:
        """Release everything buffered ("" when empty) and reset the window."""
        text = "".join(self._parts)
        self._parts.clear()
        self._tokens = 0
        self._deadline = math.inf
        if text:
            self._released_any = True
        return text
