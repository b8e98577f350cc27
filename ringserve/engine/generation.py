"""One request on the runner: its prepared form, and the :class:`Generation` that turns the tokens
sampled for it into its events.

:meth:`Generation.feed` is the per-token work of step 4 of ``engine/runner.py``'s loop: the
token is counted, detokenized (:class:`~ringserve.core.detokenizer.Detokenizer`) and run through
the request's :class:`~ringserve.core.reply.ReplyStage` (tool-call parser, stop strings, block
numbering); what comes back (:class:`Fed`) says which block events to emit, whether the
generation ended and whether its reasoning budget is spent. The runner owns the scheduler and the
engine; a generation owns its reply's state and its channel of events (:meth:`Generation.emit`,
:meth:`Generation.end`, :meth:`Generation.cancel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import assert_never

import attrs
import trio

from ringserve.core.batch import Sampled
from ringserve.core.blocks import BlockEvent
from ringserve.core.context import cleared_input_tokens
from ringserve.core.detokenizer import Detokenizer
from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    AppliedEdit,
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ContentBlock,
    Failure,
    Finish,
    GenerationEvent,
    GenerationRequest,
    StopReason,
    TokenLogprob,
    ToolChoiceMode,
    Usage,
)
from ringserve.core.reply import End, ReplyStage
from ringserve.core.sampling import ResolvedSampling
from ringserve.core.scheduler import Entry, SlotState
from ringserve.core.toolcalls import ToolCallError
from ringserve.engine.gbnf import Constraint, LazyCalls
from ringserve.formats.base import ChatFormat
from ringserve.formats.generic import GENERIC

__all__ = ["Consumer", "Fed", "Generation", "Prepared"]

Consumer = Callable[[Sequence[GenerationEvent]], None]
"""What :meth:`Generation.consume` takes: called with one step's events of a generation."""


@attrs.frozen
class Prepared:
    """A request that passed :meth:`Runner.prepare`: tokenized and within the context.

    Attributes:
        request: the request as the surface parsed it.
        prompt_tokens: the rendered, tokenized prompt.
        max_tokens: the token budget: ``request.max_tokens``, or when that is
            None or larger, what the slot's context leaves after the prompt
            (the context window less ``len(prompt_tokens)``).
        context_bound: the budget is the context's, not the caller's: using
            it up ends with :attr:`StopReason.CONTEXT_FULL` instead of
            :attr:`StopReason.MAX_TOKENS`.
        constraint: the grammar the reply is decoded under
            (:func:`~ringserve.engine.gbnf.constraint_for`), or None.
        chat_format: the model's format: the reply is read by its parser.
        reasoning_open: the prompt left the format's thinking block open (the
            reply starts inside it).
        turn_ends: texts that end the reply as its end-of-generation token does
            (:attr:`~ringserve.engine.protocol.ChatPrompt.turn_ends`).
        reasoning_budget: the most tokens the reply may sample inside its
            thinking block before the runner forces the block's closing marker
            (``request.reasoning.budget_tokens``, where the format has a
            thinking block and the reply's grammar takes its closing text:
            :meth:`Runner._reasoning_budget`); None: no budget.
        applied_edits: the request's context edits that trimmed its history
            (``core/context.py``): ``request`` is the trimmed one.
        sampling: the sampler settings it is decoded with: the request's over the defaults,
            its ``logit_bias`` by token id (:meth:`Runner._sampling_sync`).
    """

    request: GenerationRequest
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: ResolvedSampling
    context_bound: bool = False
    constraint: Constraint | LazyCalls | None = None
    chat_format: ChatFormat = GENERIC
    reasoning_open: bool = False
    reasoning_budget: int | None = None
    applied_edits: tuple[AppliedEdit, ...] = ()
    turn_ends: tuple[str, ...] = ()

    @property
    def original_input_tokens(self) -> int:
        """The prompt's tokens before the context edits."""
        return len(self.prompt_tokens) + cleared_input_tokens(self.applied_edits)



@attrs.frozen
class Count:
    """A request's prompt, counted (:meth:`Runner.count <ringserve.engine.runner.Runner.count>`).

    Attributes:
        input_tokens: the prompt's tokens, as the generation's ``usage.input_tokens``.
        original_input_tokens: before the context edits (Anthropic's ``context_management``
            answer counts both).
    """

    input_tokens: int
    original_input_tokens: int


@attrs.frozen
class Fed:
    """What one sampled token gave a generation (:meth:`Generation.feed`).

    Attributes:
        events: the block events to emit, in order.
        end: its terminal event, to emit after them, where the token ended it: a
            :class:`Finish`, or a :class:`Failure` for a tool call the reply stage could not read.
        close_reasoning: its reasoning budget is spent: its next samples are to be the format's
            closing marker (the runner forces them).
    """

    events: tuple[BlockEvent, ...] = ()
    end: Finish | Failure | None = None
    close_reasoning: bool = False


@attrs.define(eq=False)
class Generation:
    """One submitted request: an async iterator of its events.

    Yields block events in the order :class:`BlockStart` documents, then
    exactly one :class:`Finish` or :class:`Failure`, then stops. Only the runner produces events; iterating
    never drives generation, and a slow consumer never slows it (events wait
    in the generation's buffer).

    Attributes:
        prepared: what was submitted.
        tokens_after_cancel: tokens decoded for it after it was cancelled.
    """

    prepared: Prepared
    _entry: Entry
    _send: trio.MemorySendChannel[GenerationEvent]
    _receive: trio.MemoryReceiveChannel[GenerationEvent]
    _detokenizer: Detokenizer = attrs.field(factory=Detokenizer)
    _stage: ReplyStage = attrs.field(default=None)
    _reasoning_budget: int | None = None  # the prepared one until its closing marker is forced
    _outcome: Finish | Failure | None = None
    _cancel_time: float | None = None
    _consumer: Consumer | None = None
    _batch: list[GenerationEvent] = attrs.field(factory=list)  # the consumer's events since the last delivery
    _text_ends: bool = False  # its text may end it (stop strings, tool calls): see text_decides
    _logprobs: list[TokenLogprob] = attrs.field(factory=list)  # of tokens no text delta carried yet
    _open_kind: BlockKind | None = None  # the open block's kind, where logprobs are asked
    tokens_after_cancel: int = 0

    def __attrs_post_init__(self) -> None:
        request = self.prepared.request
        choice = request.tool_choice
        parsed = bool(request.tools) and choice.mode is not ToolChoiceMode.NONE
        self._text_ends = bool(request.stop) or bool(self.prepared.turn_ends) or parsed
        if self._stage is None:
            prepared = self.prepared
            self._stage = ReplyStage(
                request.stop,
                turn_ends=prepared.turn_ends,
                parser=prepared.chat_format.parser(request.tools if parsed else None, reasoning_open=prepared.reasoning_open),
                parallel=choice.parallel and choice.mode is not ToolChoiceMode.NAMED,
                forced=parsed and choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED),
            )
        self._reasoning_budget = self.prepared.reasoning_budget

    @property
    def id(self) -> int:
        """The runner's ticket number for this request (increasing)."""
        return self._entry.id

    @property
    def text_decides(self) -> bool:
        """Whether a sampled token's text can change what the next step feeds it: a stop string
        or a tool call can end it, a reasoning budget force its next tokens. Otherwise only an
        end-of-generation token and the token budget end it, which the sample says by itself."""
        return self._text_ends or self._reasoning_budget is not None

    @property
    def entry(self) -> Entry:
        """The request as the runner's scheduler sees it."""
        return self._entry

    @property
    def usage(self) -> Usage:
        """Live token counts: prompt tokens, tokens sampled so far (EOG counted),
        prompt tokens reused from the prefix cache (0 until admitted), and the
        sampled tokens of the thinking block.

        Valid at any time, including after a cancel (it then stays as it was).
        """
        entry = self._entry
        return Usage(len(self.prepared.prompt_tokens), entry.generated, entry.cached, self._stage.reasoning_tokens)

    @property
    def state(self) -> SlotState:
        """Where the request is in the slot lifecycle."""
        return self._entry.state

    @property
    def slot(self) -> int | None:
        """The slot it holds or held; None while queued."""
        return self._entry.slot

    @property
    def cancelled(self) -> bool:
        """Whether its consumer left before the terminal event was produced."""
        return self._cancel_time is not None

    @property
    def cancel_time(self) -> float | None:
        """When its consumer left (the Trio clock), if it did before the terminal event."""
        return self._cancel_time

    @property
    def outcome(self) -> Finish | Failure | None:
        """The terminal event once produced (whether or not it was read yet)."""
        return self._outcome

    @property
    def consumed(self) -> bool:
        """Whether a consumer takes its events (:meth:`consume`) instead of an iteration."""
        return self._consumer is not None

    # -- the runner's side ---------------------------------------------------

    def feed(self, sampled: Sampled) -> Fed:
        """One token sampled for it (counted by the scheduler already): count it in the reply
        stage, detokenize it and run its text through the stage; end the generation at
        end-of-generation or when its budget (``max_tokens``, or the context's) is used up.

        Held text (a possible stop string or ``<tool_call>`` prefix) is released at the end;
        the bytes of an incomplete UTF-8 character are dropped then (the usage still counts
        their tokens). The stage may turn ``END`` into ``TOOL_USE``, or fail the message (an
        end inside a tool call). A call the stage cannot read fails it (``API_ERROR``, not
        retryable: the arguments already streamed cannot be taken back).

        With the token's log probabilities (a request that asks: :attr:`Sampled.logprob`) the
        events go through :meth:`_carry`.
        """
        self._stage.sampled()
        if sampled.eog:
            return self._carried(self._finish(StopReason.END), None)
        if sampled.logprob is not None:
            self._logprobs.append(sampled.logprob)
        text = self._detokenizer.feed(sampled.piece)
        if text:
            fed = self._staged(lambda: self._stage.feed(text))
            if fed.end is not None:
                return self._carried(fed, sampled.logprob)
            events = fed.events
        else:
            events = ()
        if self._entry.budget_left <= 0:
            ended = self._finish(StopReason.CONTEXT_FULL if self.prepared.context_bound else StopReason.MAX_TOKENS)
            return self._carried(Fed(events + ended.events, ended.end), sampled.logprob)
        return self._carried(Fed(events, close_reasoning=self.reasoning_spent()), sampled.logprob)

    def _carried(self, fed: Fed, current: TokenLogprob | None) -> Fed:
        """``fed`` with the log probabilities of the tokens on the text deltas (:meth:`_carry`)."""
        if self.prepared.request.logprobs is None or not fed.events:
            return fed
        return attrs.evolve(fed, events=self._carry(fed.events, current))

    def _carry(self, events: tuple[BlockEvent, ...], current: TokenLogprob | None) -> tuple[BlockEvent, ...]:
        """Which tokens' log probabilities each text delta carries: those of the tokens sampled
        since the last text delta, the ``current`` one (just fed) included, unless their text
        went to a reasoning or tool-call block (its deltas and its stop drop them: the thinking,
        a call's arguments and the markers around them; the ``current`` token's stays for a
        text delta it also gives). What a delta holds back (a possible stop string, a cut
        character) goes with the delta that releases it; the tokens of text never released (a
        stop string, a cut character at the end) with none.
        """
        out: list[BlockEvent] = []
        dropped = False
        for event in events:
            match event:
                case BlockStart():
                    self._open_kind = event.kind
                case BlockDelta() if self._open_kind is BlockKind.TEXT:
                    if event.text and self._logprobs:
                        event = attrs.evolve(event, logprobs=tuple(self._logprobs))
                        self._logprobs.clear()
                        dropped = False
                case BlockDelta() | BlockStop():
                    if isinstance(event, BlockDelta) or self._open_kind is not BlockKind.TEXT:
                        self._logprobs[:] = [current] if current is not None and current in self._logprobs else []
                        dropped = True
            out.append(event)
        if dropped:
            self._logprobs.clear()
        return tuple(out)

    def reasoning_spent(self) -> bool:
        """Whether the reply has now sampled its reasoning budget inside the thinking block
        (and no character is cut in two): then its next samples are to be the format's closing
        marker, once (True is returned once), and the model answers. The forced tokens are
        decoded as sampled ones (their text goes through the reply stage, a grammar accepts
        them), as llama.cpp's reasoning budget forces its end tags
        (``common/reasoning-budget.cpp``)."""
        stage = self._stage
        budget = self._reasoning_budget
        if budget is None or not stage.in_reasoning or stage.reasoning_tokens < budget:
            return False
        if self._detokenizer.pending_bytes:
            return False
        self._reasoning_budget = None
        return True

    def _finish(self, reason: StopReason) -> Fed:
        """End normally: flush held text and stop the open block (see :meth:`feed`)."""
        # A character whose last bytes were never sampled is dropped, not sent as U+FFFD.
        self._detokenizer.flush()
        return self._staged(lambda: self._stage.finish(reason))

    def _staged(self, step: Callable[[], tuple[list[BlockEvent], End | None]]) -> Fed:
        """One reply-stage step: its events, and its end (``Finish``) if it has one."""
        try:
            events, end = step()
        except ToolCallError as exc:
            message = f"the model wrote a malformed tool call: {exc}"
            return Fed(end=Failure(ErrorKind.API_ERROR, message, self.usage, retryable=False))
        return Fed(tuple(events), None if end is None else Finish(end.reason, self.usage, end.stop))

    def emit(self, event: GenerationEvent) -> None:
        """Queue an event for the consumer (none once it left): for its next delivery
        (:meth:`deliver`) where it has a consumer, else in the channel."""
        if self.cancelled:
            return
        if self._consumer is not None:
            self._batch.append(event)
            return
        try:
            self._send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer is gone; the cancel path frees the slot
        except trio.WouldBlock:  # pragma: no cover - the buffer is sized to never fill
            raise RuntimeError("generation event buffer full") from None

    def end(self, event: Finish | Failure) -> None:
        """Emit the terminal event and close the channel."""
        self._outcome = event
        try:
            self.emit(event)
        finally:
            self._send.close()

    def deliver(self) -> None:
        """Hand the consumer the events emitted since the last delivery (maybe none)."""
        batch, self._batch = self._batch, []
        if self._consumer is not None and not self.cancelled:
            self._consumer(batch)

    def cancel(self, now: float) -> None:
        """Its consumer left at ``now`` (the Trio clock): no more events."""
        self._cancel_time = now
        self._send.close()

    def close(self) -> None:
        """The consumer's side is done with the events (the ``submit`` block was left); the
        consumer is let go of (it may hold this generation: a cycle the refcount would not free)."""
        self._receive.close()
        self._consumer = None

    # -- the consumer's side -------------------------------------------------

    def consume(self, consumer: Consumer) -> None:
        """Have the runner call ``consumer`` with the events instead of queueing them for
        iteration (do not iterate then): once per decode step that sampled for this
        generation, with that step's events (maybe none, so that the consumer sees time
        pass), in the runner's one pass over the step's generations, right after the next
        step was handed to the engine (while it decodes, when the runner overlaps steps);
        the terminal event included, and at once for events outside a step (a failure of
        the loop). Never after the consumer's ``submit`` block was left. ``consumer`` runs
        on the runner's task and must not raise or await. The events queued before this call
        (its caller awaited something after ``submit``: ``live/produce.py`` writes the
        message's row) are handed to it at once, here.
        """
        self._consumer = consumer
        queued = []
        while True:
            try:
                queued.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if queued:
            consumer(queued)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenerationEvent:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def collect(self) -> tuple[tuple[ContentBlock, ...], Finish | Failure]:
        """Read every remaining event; return the content blocks and the terminal event."""
        blocks: list[ContentBlock] = []
        parts: list[list[str]] = []
        terminal: Finish | Failure | None = None
        async for event in self:
            match event:
                case BlockStart():
                    blocks.append(ContentBlock(event.kind, "", event.name, event.call_id))
                    parts.append([])
                case BlockDelta():
                    parts[event.index].append(event.text)
                case BlockStop():
                    pass
                case Finish() | Failure():
                    terminal = event
                case _:
                    assert_never(event)
        assert terminal is not None, "a generation always ends with Finish or Failure"
        return tuple(attrs.evolve(b, text="".join(p)) for b, p in zip(blocks, parts, strict=True)), terminal
