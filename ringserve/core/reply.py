"""From a generation's decoded text to its content-block events (sans-I/O).

One :class:`ReplyStage` per generation sits after the detokenizer. It runs the
tool-call parser (:mod:`ringserve.core.toolcalls`) when the request's tools
may be called, the stop-string matcher (:mod:`ringserve.core.stop`) on the
text outside calls (a stop string inside a call's arguments is not a stop),
and has a :class:`~ringserve.core.blocks.BlockSequencer` number the blocks:
text opens a ``TEXT`` block, a call closes it and is a ``TOOL_CALL`` block of
its own (``BlockStart`` with the name and a fresh call
id, ``BlockDelta`` per arguments fragment, ``BlockStop`` when the call is
complete), and text after a call opens a new ``TEXT`` block. The order is the
one :class:`~ringserve.core.events.BlockStart` documents.

How a generation ends:

* a stop string in the text: ``STOP_SEQUENCE`` at once (:meth:`ReplyStage.feed`);
* the first complete call when parallel calls are off: ``TOOL_USE`` at once;
* an end-of-generation token after one or more calls: ``TOOL_USE``
  (:meth:`ReplyStage.finish` turns ``END`` into it);
* the token budget inside a call: the call's block is stopped with the
  arguments decoded so far (they do not parse) and the reason stays
  ``MAX_TOKENS`` / ``CONTEXT_FULL``, as the Anthropic API does;
* an end-of-generation token inside a call, or a call the parser cannot
  read: :class:`~ringserve.core.toolcalls.ToolCallError` (the runner fails
  the message).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import assert_never

import attrs

from ringserve.core.blocks import BlockEvent, BlockSequencer
from ringserve.core.events import BlockKind, StopReason
from ringserve.core.stop import StopMatcher
from ringserve.core.toolcalls import CallArgs, CallEnd, CallStart, Text, ToolCallError, ToolCallParser

__all__ = ["End", "ReplyStage", "new_call_id"]


def new_call_id() -> str:
    """A surface-neutral call id: 24 random hex characters."""
    return secrets.token_hex(12)


@attrs.frozen
class End:
    """The stage ended the generation: its reason and the stop string that matched (if any)."""

    reason: StopReason
    stop: str | None = None


@attrs.define(eq=False)
class ReplyStage:
    """Turns decoded text into block events (see the module docstring).

    Args:
        stops: the request's stop strings.
        tools: the names of the tools the model may call; None: the reply is
            not parsed for calls (no tools, or tool choice ``NONE``).
        parallel: more than one call may be made.
        forced: the reply is decoded under a calls grammar (a forced tool), so it
            is only calls: text held at the end as the start of a ``<tool_call>``
            marker is that marker cut by the budget, and is dropped as a cut call
            head is, never released as text.
        new_id: makes call ids (tests pass a counter).
    """

    stops: tuple[str, ...] = ()
    tools: frozenset[str] | None = None
    parallel: bool = True
    forced: bool = False
    new_id: Callable[[], str] = new_call_id
    _stopper: StopMatcher = attrs.field(init=False)
    _parser: ToolCallParser | None = attrs.field(init=False)
    _blocks: BlockSequencer = attrs.field(init=False, factory=BlockSequencer)
    _tokens: int = attrs.field(init=False, default=0)
    _calls: int = attrs.field(init=False, default=0)
    _end: End | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._stopper = StopMatcher(self.stops)
        self._parser = None if self.tools is None else ToolCallParser(self.tools)

    @property
    def calls(self) -> int:
        """Complete calls so far."""
        return self._calls

    def sampled(self) -> None:
        """Count one sampled token (it goes on the next delta's ``tokens``)."""
        self._tokens += 1

    def feed(self, text: str) -> tuple[list[BlockEvent], End | None]:
        """Add decoded text; return the events it releases and, if it ends the
        generation, how (every block is then stopped; no more feeds).

        Raises:
            ToolCallError: a call the parser cannot read.
        """
        assert self._end is None, "feed after the end"
        out: list[BlockEvent] = []
        pieces = [Text(text)] if self._parser is None else self._parser.feed(text)
        for piece in pieces:
            match piece:
                case Text():
                    self._text(out, piece.text)
                case CallStart():
                    self._release_held(out)
                    out += self._blocks.start(BlockKind.TOOL_CALL, name=piece.name, call_id=self.new_id())
                case CallArgs():
                    self._delta(out, BlockKind.TOOL_CALL, piece.text)
                case CallEnd():
                    out += self._blocks.stop()
                    self._calls += 1
                    if not self.parallel:
                        self._end = End(StopReason.TOOL_USE)
                case _:
                    assert_never(piece)
            if self._end is not None:
                out += self._blocks.stop()
                break
        return out, self._end

    def finish(self, reason: StopReason) -> tuple[list[BlockEvent], End]:
        """The generation ended for ``reason`` (``END``, ``MAX_TOKENS``...): release held
        text, stop the open block, and give the final reason (see the module docstring).

        Raises:
            ToolCallError: ``END`` inside a call.
        """
        out: list[BlockEvent] = []
        parser = self._parser
        if parser is not None:
            if parser.in_call and reason is StopReason.END:
                raise ToolCallError("the reply ended inside a tool call")
            for piece in parser.flush():
                assert isinstance(piece, Text)
                if not self.forced:
                    self._text(out, piece.text)
        if self._end is None:
            self._release_held(out)
            self._end = End(StopReason.TOOL_USE if reason is StopReason.END and self._calls else reason)
        out += self._blocks.end()
        return out, self._end

    def _text(self, out: list[BlockEvent], text: str) -> None:
        if self._end is not None:
            return
        match = self._stopper.feed(text)
        if match.text:
            self._delta(out, BlockKind.TEXT, match.text)
        if match.stop is not None:
            self._end = End(StopReason.STOP_SEQUENCE, match.stop)

    def _release_held(self, out: list[BlockEvent]) -> None:
        """Text held back as a possible stop string is text: a call (or the end) follows it."""
        held = self._stopper.flush()
        if held:
            self._delta(out, BlockKind.TEXT, held)
        self._stopper = StopMatcher(self.stops)

    def _delta(self, out: list[BlockEvent], kind: BlockKind, text: str) -> None:
        out += self._blocks.delta(kind, text, self._tokens)
        self._tokens = 0
