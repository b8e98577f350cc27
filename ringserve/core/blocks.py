"""Numbering and bracketing a message's content blocks (sans-I/O).

The runner's per-token path says *what* it has (text, the start of a tool
call, a fragment of its arguments, the end of the message); a
:class:`BlockSequencer` turns that into the block events every consumer
relies on (``core/events.py``, :class:`~ringserve.core.events.BlockStart`):
blocks numbered 0, 1, ... in order, one open at a time, every block stopped
before the ``Finish``, and at least one block per finished message.
"""

from __future__ import annotations

import attrs

from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop

BlockEvent = BlockStart | BlockDelta | BlockStop


@attrs.define
class BlockSequencer:
    """The open block of one message and the index of the next one."""

    _next: int = 0
    _open: BlockKind | None = None

    @property
    def open_kind(self) -> BlockKind | None:
        """The kind of the open block, None between blocks."""
        return self._open

    @property
    def count(self) -> int:
        """Blocks started so far."""
        return self._next

    def start(self, kind: BlockKind, *, name: str = "", call_id: str = "") -> list[BlockEvent]:
        """Stop the open block (if any) and start a new one of ``kind``."""
        events = self.stop()
        self._open = kind
        events.append(BlockStart(self._next, kind, name, call_id))
        self._next += 1
        return events

    def delta(self, kind: BlockKind, text: str, tokens: int) -> list[BlockEvent]:
        """``text`` for a block of ``kind``: into the open one if it is of that kind, else into a
        new one (a ``TOOL_CALL`` fragment always needs the call's :meth:`start` first)."""
        events: list[BlockEvent] = []
        if self._open is not kind:
            assert kind is not BlockKind.TOOL_CALL, "a tool call's block is started with its name"
            events = self.start(kind)
        events.append(BlockDelta(self._next - 1, text, tokens))
        return events

    def stop(self) -> list[BlockEvent]:
        """Stop the open block; nothing when none is open."""
        if self._open is None:
            return []
        self._open = None
        return [BlockStop(self._next - 1)]

    def end(self) -> list[BlockEvent]:
        """The events before a ``Finish``: stop the open block; an empty text block when the
        message has none."""
        if self._next == 0:
            return [*self.start(BlockKind.TEXT), *self.stop()]
        return self.stop()
