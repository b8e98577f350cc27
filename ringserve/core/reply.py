"""From a generation's decoded text to its content-block events (sans-I/O).

One :class:`ReplyStage` per generation sits after the detokenizer. It runs the
model format's output parser (:class:`~ringserve.core.toolcalls.OutputParser`,
one per reply: ``ringserve/formats``), the stop-string matcher
(:mod:`ringserve.core.stop`) on the text (a stop string inside a call's
arguments or the reasoning is not a stop), and has a
:class:`~ringserve.core.blocks.BlockSequencer` number the blocks: reasoning is
a ``REASONING`` block, text a ``TEXT`` block, a call a ``TOOL_CALL`` block of its
own (``BlockStart`` with the name and a fresh call id, ``BlockDelta`` per
arguments fragment, ``BlockStop`` when the call is complete), and what follows
a block of another kind opens a new one. The order is the one
:class:`~ringserve.core.events.BlockStart` documents.

How a generation ends:

* a stop string in the text: ``STOP_SEQUENCE`` at once (:meth:`ReplyStage.feed`);
* a turn-end text of the prompt's format (``turn_ends``) in the text: ``END`` at once, as its
  end-of-generation token would (``TOOL_USE`` after calls);
* the first complete call when parallel calls are off: ``TOOL_USE`` at once;
* an end-of-generation token after one or more calls: ``TOOL_USE``
  (:meth:`ReplyStage.finish` turns ``END`` into it);
* the token budget inside a call: the call's block is stopped with the
  arguments decoded so far (they do not parse) and the reason stays
  ``MAX_TOKENS`` / ``CONTEXT_FULL``, as the Anthropic API does; inside the
  reasoning, the reasoning block is stopped with what was decoded;
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
from ringserve.core.toolcalls import (
    CallArgs,
    CallEnd,
    CallStart,
    OutputParser,
    Piece,
    PlainText,
    Reasoning,
    Text,
    ToolCallError,
)

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
        parser: the reply's output parser (the model format's, for the request's tools:
            none, or tool choice ``NONE``, parses no calls); the default reads the reply as
            plain text.
        parallel: more than one call may be made.
        forced: the reply is decoded under a calls grammar (a forced tool), so it is only
            calls (after the thinking block): text held at the end as the start of a call's
            marker is that marker cut by the budget, and is dropped as a cut call head is,
            never released as text.
        turn_ends: texts that end the reply as the model's end-of-generation token does
            (``END``, not a stop string: the prompt's format ends a turn with text the
            vocabulary has no token for); a request's stop string that is one too stays a stop.
        new_id: makes call ids (tests pass a counter).

    Attributes:
        reasoning_tokens: the sampled tokens counted inside the thinking block.
    """

    stops: tuple[str, ...] = ()
    parser: OutputParser = attrs.Factory(PlainText)
    parallel: bool = True
    forced: bool = False
    turn_ends: tuple[str, ...] = ()
    new_id: Callable[[], str] = new_call_id
    reasoning_tokens: int = attrs.field(init=False, default=0)
    _stopper: StopMatcher = attrs.field(init=False)
    _blocks: BlockSequencer = attrs.field(init=False, factory=BlockSequencer)
    _tokens: int = attrs.field(init=False, default=0)
    _calls: int = attrs.field(init=False, default=0)
    _end: End | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._stopper = StopMatcher(self.stops + self.turn_ends)

    @property
    def calls(self) -> int:
        """Complete calls so far."""
        return self._calls

    @property
    def in_reasoning(self) -> bool:
        """The reply is inside its thinking block."""
        return self.parser.in_reasoning

    def sampled(self) -> None:
        """Count one sampled token (it goes on the next delta's ``tokens``; and on
        :attr:`reasoning_tokens` when it was sampled inside the thinking block, before its
        text is fed)."""
        self._tokens += 1
        if self.parser.in_reasoning:
            self.reasoning_tokens += 1

    def feed(self, text: str) -> tuple[list[BlockEvent], End | None]:
        """Add decoded text; return the events it releases and, if it ends the
        generation, how (every block is then stopped; no more feeds).

        Raises:
            ToolCallError: a call the parser cannot read.
        """
        assert self._end is None, "feed after the end"
        out: list[BlockEvent] = []
        self._pieces(out, self.parser.feed(text))
        return out, self._end

    def finish(self, reason: StopReason) -> tuple[list[BlockEvent], End]:
        """The generation ended for ``reason`` (``END``, ``MAX_TOKENS``...): release held
        text, stop the open block, and give the final reason (see the module docstring).

        Raises:
            ToolCallError: ``END`` inside a call, or held text that breaks the syntax.
        """
        out: list[BlockEvent] = []
        if self._end is None:
            pieces = self.parser.flush()
            if self.parser.in_call and reason is StopReason.END:
                raise ToolCallError("the reply ended inside a tool call")
            if self.forced:
                pieces = [p for p in pieces if not isinstance(p, Text)]
            self._pieces(out, pieces)
        if self._end is None:
            self._release_held(out)
            self._end = End(StopReason.TOOL_USE if reason is StopReason.END and self._calls else reason)
        out += self._blocks.end()
        return out, self._end

    def _pieces(self, out: list[BlockEvent], pieces: list[Piece]) -> None:
        for piece in pieces:
            match piece:
                case Text():
                    self._text(out, piece.text)
                case Reasoning():
                    if self._blocks.open_kind is not BlockKind.REASONING:
                        self._release_held(out)
                    self._delta(out, BlockKind.REASONING, piece.text)
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
                return

    def _text(self, out: list[BlockEvent], text: str) -> None:
        if self._end is not None:
            return
        match = self._stopper.feed(text)
        if match.text:
            self._delta(out, BlockKind.TEXT, match.text)
        if match.stop is not None and match.stop not in self.stops:  # a turn end: as the end token
            self._end = End(StopReason.TOOL_USE if self._calls else StopReason.END)
        elif match.stop is not None:
            self._end = End(StopReason.STOP_SEQUENCE, match.stop)

    def _release_held(self, out: list[BlockEvent]) -> None:
        """Text held back as a possible stop string is text: another block (or the end) follows it."""
        held = self._stopper.flush()
        if held:
            self._delta(out, BlockKind.TEXT, held)
        self._stopper = StopMatcher(self.stops + self.turn_ends)

    def _delta(self, out: list[BlockEvent], kind: BlockKind, text: str) -> None:
        out += self._blocks.delta(kind, text, self._tokens)
        self._tokens = 0
