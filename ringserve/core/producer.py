"""The producer chain of one message, sans-I/O: the runner's events in, log entries out.

A :class:`Producer` owns everything between a generation's events and its
stream log: the safety hold-back (``core/safety.py`` :class:`HoldBack`, for
text blocks), coalescing (``core/coalesce.py``), rendering in the message's
surface (a :class:`~ringserve.core.render.Renderer`), event ids
``<message_id>:<seq>`` and SSE encoding (``core/sse.py``), the message's
status (``core/status.py``), its content blocks, and when to persist them.

It never awaits and never reads a clock: every move takes the current time
(seconds, any monotonic clock) and returns a :class:`Step` saying which SSE
entries to append, which safety check to ask, what to write to the store, and
whether the message ended. The Trio shell (``live/produce.py``) performs the
step and, for a check, hands the verdict back with :meth:`Producer.verdict`
before the next move.

Moves, in order: :meth:`start`; then any number of :meth:`event`,
:meth:`tick` (its :attr:`~Producer.deadline` passed: the coalescing window, or a silence of
``keepalive_seconds``) and :meth:`verdict` (after a step with a ``check``, before anything
else) or :meth:`check_failed`; the
message ends with a step whose ``end`` is set: a terminal event of the
runner, a refusal, a failed check, or :meth:`interrupted` (the generation was
cancelled from outside). Nothing moves after the end. Once per decode step, :meth:`pace`
says how long the engine waited for the event loop and how busy the loop was, which sizes the
coalescing window.

Safety and tool calls: hold-back applies to text blocks only; tool-call
arguments are passed on as decoded (a checker sees no JSON fragments), and a
text block's held text is checked before the block's stop.

Keepalives: when nothing was appended for ``keepalive_seconds`` (a long prefill, a queue, a
model thinking without output), :meth:`tick` appends the renderer's ``keepalive`` events
(Anthropic ``ping``, Responses ``response.in_progress`` with the response so far), numbered
like every entry and noted in the :class:`Trace`, so a resume or a rebuild replays them as they
were. They reach every reader as data events, which the agents' idle timers count (docs/agents.md).
"""

from __future__ import annotations

import math
from typing import assert_never

import attrs

from ringserve.core.coalesce import Coalescer
from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ContentBlock,
    Failure,
    Finish,
    GenerationEvent,
    StopReason,
    TokenLogprob,
    Usage,
)
from ringserve.core.render import Renderer, WireEvent, render
from ringserve.core.ringlog import LogState, format_event_id
from ringserve.core.safety import Check, HoldBack, Verdict
from ringserve.core.sse import encode_event
from ringserve.core.status import CancelReason, MessageStatus, advance


#: :attr:`Trace.ops`: a block starts (its kind, name and call id are the stored block's).
TRACE_START = 0
#: :attr:`Trace.ops`: the open block stops (a positive op is a delta of that many characters).
TRACE_STOP = -1
#: :attr:`Trace.ops`: the renderer's keepalive events (a silence).
TRACE_KEEPALIVE = -2


@attrs.frozen
class Trace:
    """How a message's renderer was driven, so that :func:`replay` renders its stream again.

    ``ops``: in order, :data:`TRACE_START`, :data:`TRACE_STOP`, :data:`TRACE_KEEPALIVE`, or a
    positive number, a delta of that many characters (``str`` length) of the open
    block's text: the boundaries the coalescer and the safety stage chose,
    which the text alone does not keep. ``failure``: the ``(kind, retryable)``
    of the message's :class:`~ringserve.core.events.Failure` (its message is the
    stored error). ``logprobs``: per delta op, in order, how many of its block's
    :attr:`~ringserve.core.events.ContentBlock.logprobs` the delta carried; ``()`` when none
    carried any. About 3 bytes of JSON per log entry.
    """

    ops: tuple[int, ...]
    failure: tuple[ErrorKind, bool] | None = None
    logprobs: tuple[int, ...] = ()


@attrs.frozen
class Snapshot:
    """What the store should hold for the message now (``messages.MessageStore.update``).

    ``final_seq`` is set once the terminal event is in the log; ``trace`` is how its
    entries so far were rendered (:func:`replay`).
    """

    status: MessageStatus
    content: tuple[ContentBlock, ...]
    usage: Usage
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    error: str | None = None
    final_seq: int | None = None
    trace: Trace = attrs.Factory(lambda: Trace(()))


@attrs.frozen
class End:
    """The message ended: close its log in ``state``; ``terminal`` is its last event. A
    generation still running (a refusal, a failed check) is the shell's to cancel."""

    state: LogState
    terminal: Finish | Failure


@attrs.frozen
class Step:
    """What the shell does after one move, in this order.

    Attributes:
        entries: SSE blocks to append to the log, in order (ids included).
        released: text reached the log in this step (for TTFT and gap metrics).
        check: a safety check to ask; the verdict goes to :meth:`Producer.verdict`.
        persist: what to write to the store.
        end: set when the message ended (then ``persist`` is its final snapshot).
    """

    entries: tuple[bytes, ...] = ()
    released: bool = False
    check: Check | None = None
    persist: Snapshot | None = None
    end: End | None = None


@attrs.define
class _Block:
    kind: BlockKind
    name: str
    call_id: str
    parts: list[str] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)

    def whole(self) -> ContentBlock:
        text = "".join(self.parts)
        self.parts[:] = [text]  # the next snapshot joins one string and what came since
        return ContentBlock(self.kind, text, self.name, self.call_id, tuple(self.logprobs))


@attrs.define(eq=False)
class Producer:
    """The producer chain of one message (see the module doc).

    Args:
        message_id: the message's id, the prefix of its event ids.
        renderer: the message's surface renderer.
        usage: the usage before generation (the prompt's tokens).
        flush_seconds: the coalescing window (``[stream] flush_ms`` / 1000).
        flush_tokens: release at once when this many tokens are buffered.
        flush_max_seconds: the widest the window grows while the event loop lags
            (``[stream] flush_max_ms`` / 1000; :meth:`pace`); at most ``flush_seconds``: it never widens.
        persist_seconds: at most this long between two snapshots while text
            is released (``[stream] persist_seconds``; what a crash can lose).
        window_tokens: the safety hold-back in tokens (0: no safety stage).
        retry_ms: the reconnection hint carried by the first entry (None: none).
        keepalive_seconds: after this long without an entry, the renderer's keepalive events
            (``[server] heartbeat_interval``; ``inf``: none).
    """

    message_id: str
    renderer: Renderer
    usage: Usage
    flush_seconds: float
    flush_tokens: int
    persist_seconds: float
    window_tokens: int = 0
    retry_ms: int | None = None
    keepalive_seconds: float = math.inf
    flush_max_seconds: float = 0.0
    status: MessageStatus = attrs.field(init=False, default=MessageStatus.QUEUED)
    stop_reason: StopReason | None = attrs.field(init=False, default=None)
    stop_sequence: str | None = attrs.field(init=False, default=None)
    error: str | None = attrs.field(init=False, default=None)
    _seq: int = attrs.field(init=False, default=0)
    _blocks: list[_Block] = attrs.field(init=False, factory=list)
    _open: int | None = attrs.field(init=False, default=None)
    _coalescer: Coalescer = attrs.field(init=False)
    _holdback: HoldBack | None = attrs.field(init=False)
    _pending: tuple[Check, BlockDelta | BlockStop] | None = attrs.field(init=False, default=None)
    _ops: list[int] = attrs.field(init=False, factory=list)
    _counts: list[int] | None = attrs.field(init=False, default=None)  # Trace.logprobs, once a delta carries some
    # the open block's log probabilities not released yet, each with the length of the block's text that
    # holds its token's text (they go out with the text that reaches it, in _text: the coalescer and the
    # safety stage release text late, never reordered), and the characters of its deltas received and released
    _waiting: list[tuple[int, TokenLogprob]] = attrs.field(init=False, factory=list)
    _received: int = attrs.field(init=False, default=0)
    _sent: int = attrs.field(init=False, default=0)
    _failure: tuple[ErrorKind, bool] | None = attrs.field(init=False, default=None)
    _persisted_at: float = attrs.field(init=False, default=-math.inf)
    _persisted_status: MessageStatus = attrs.field(init=False, default=MessageStatus.QUEUED)
    _released: bool = attrs.field(init=False, default=False)
    _end_value: End | None = attrs.field(init=False, default=None)
    _written_at: float = attrs.field(init=False, default=math.inf)  # when the last entries were made

    def __attrs_post_init__(self) -> None:
        self._coalescer = Coalescer(window=self.flush_seconds, max_tokens=self.flush_tokens,
                                    bound=self.flush_max_seconds)
        self._holdback = HoldBack(self.window_tokens) if self.window_tokens > 0 else None

    # -- what the shell reads ------------------------------------------------------------

    @property
    def deadline(self) -> float:
        """When :meth:`tick` must be called: the coalescing window's end while text waits, else
        a keepalive's time (``inf`` when neither is due: before the start, after the end, while
        a safety check waits for its verdict, or without keepalives)."""
        if self.ended or self._pending is not None:
            return math.inf
        return min(self._coalescer.deadline, self._written_at + self.keepalive_seconds)

    @property
    def text_waits(self) -> bool:
        """Whether text waits for its coalescing window (else a tick at the :attr:`deadline` is a keepalive's)."""
        return self._coalescer.deadline != math.inf

    @property
    def ended(self) -> bool:
        return self._end_value is not None

    @property
    def end(self) -> End | None:
        """How the message ended (the ``end`` of the step that ended it); None while it runs."""
        return self._end_value

    @property
    def content(self) -> tuple[ContentBlock, ...]:
        """The content blocks released to readers so far."""
        return tuple(b.whole() for b in self._blocks)

    @property
    def last_seq(self) -> int:
        """The seq of the last entry produced (-1 before :meth:`start`)."""
        return self._seq - 1

    def continue_at(self, seq: int) -> None:
        """Number the next entries from ``seq``: the log they go to holds entries this producer did
        not make (:func:`replay` of a message whose owner died after its last snapshot)."""
        self._seq = seq

    def snapshot(self) -> Snapshot:
        """The message's state as the store should hold it now."""
        return Snapshot(self.status, self.content, self.usage, self.stop_reason, self.stop_sequence, self.error,
                        self.last_seq if self.ended else None,
                        Trace(tuple(self._ops), self._failure, tuple(self._counts or ())))

    # -- moves ---------------------------------------------------------------------------

    def start(self, now: float) -> Step:
        """The message's first entries (``message_start`` or the surface's equivalent)."""
        self._written_at = now
        return Step(entries=self._encode(self.renderer.start(self.usage)))

    def event(self, event: GenerationEvent, usage: Usage, now: float) -> Step:
        """One event of the runner; ``usage`` is the generation's live usage."""
        self._require_move("event")
        self.usage = usage
        match event:
            case BlockStart():
                return self._step(self._block_start(event), now)
            case BlockDelta():
                self._received += len(event.text)  # the open block's, for its log probabilities (_text)
                if event.logprobs:
                    self._waiting += [(self._received, logprob) for logprob in event.logprobs]
                if self._held(event.index):
                    assert self._holdback is not None
                    check = self._holdback.push(event.text, event.tokens)
                    if check is not None:
                        self._pending = (check, event)
                        return Step(check=check)
                    return self._step(self._delta(BlockDelta(event.index, "", event.tokens), now), now)
                return self._step(self._delta(event, now), now)
            case BlockStop():
                if self._held(event.index):
                    assert self._holdback is not None
                    check = self._holdback.flush()
                    if check is not None:
                        self._pending = (check, event)
                        return Step(check=check)
                return self._step(self._block_stop(event), now)
            case Finish():
                return self._finish(event, now)
            case Failure():
                return self._fail(event, now)
            case _:
                assert_never(event)

    def verdict(self, verdict: Verdict, now: float) -> Step:
        """The checker's answer to the last step's ``check``."""
        assert self._pending is not None and self._holdback is not None, "no check awaits a verdict"
        check, waiting = self._pending
        self._pending = None
        released = self._holdback.resolve(check, verdict)
        if not verdict.allowed:
            return self._finish(Finish(StopReason.REFUSAL, self.usage), now)
        match waiting:
            case BlockDelta():
                return self._step(self._delta(BlockDelta(waiting.index, released, waiting.tokens), now), now)
            case BlockStop():
                wire = self._text(self._coalescer.add(released, 0, now))
                return self._step([*wire, *self._block_stop(waiting)], now)
            case _:
                assert_never(waiting)

    def check_failed(self, reason: str, now: float) -> Step:
        """The checker raised (``reason`` names the exception): a retryable in-band error;
        no unchecked text is sent."""
        assert self._pending is not None, "no check awaits a verdict"
        self._pending = None
        message = f"the safety check failed ({reason}); no unchecked text was sent"
        return self._fail(Failure(ErrorKind.API_ERROR, message, self.usage, retryable=True), now)

    def pace(self, lag: float, step: float, busy: float, now: float) -> None:
        """Once per decode step: the engine waited ``lag`` seconds for the event loop after a step
        of ``step`` seconds, and the loop was busy ``busy`` of the time (0 to 1). The coalescing
        window widens while the loop lags and narrows once it keeps up (``core/coalesce.py``,
        :meth:`Coalescer.pace`); the :attr:`deadline` may move."""
        self._coalescer.pace(lag, step, busy, now)

    def tick(self, now: float, ahead: float = 0.0) -> Step:
        """The :attr:`deadline` may have passed (or passes within ``ahead`` seconds, before the
        shell's next tick): release the text that waited its window, or, when nothing was
        appended for ``keepalive_seconds``, the keepalive events."""
        if self.ended or self._pending is not None:
            return Step()
        wire = self._text(self._coalescer.due(now, ahead))
        if not wire and now >= self._written_at + self.keepalive_seconds:
            return self.keepalive(now)
        return self._step(wire, now)

    def keepalive(self, now: float) -> Step:
        """The renderer's keepalive events now (:meth:`tick` calls it after a silence)."""
        self._require_move("keepalive")
        wire = self.renderer.keepalive()
        if wire:
            self._ops.append(TRACE_KEEPALIVE)
        self._written_at = now  # a renderer with none waits another interval
        return self._step(wire, now)

    def interrupted(self, reason: CancelReason | None, usage: Usage, now: float) -> Step:
        """The generation was cancelled from outside (``reason``), or ended without a terminal
        event (None): a drain fails it ``interrupted`` and retryable; a cancel finishes it
        ``cancelled``; anything else is a retryable ``api_error``. Held text is dropped (it
        was never checked)."""
        self.usage = usage
        self._pending = None
        if reason is CancelReason.DRAIN:
            failure = Failure(ErrorKind.UNAVAILABLE, "the server is shutting down; retry the request", usage, True)
            return self._fail(failure, now, status=MessageStatus.INTERRUPTED)
        if reason is not None:
            return self._finish(Finish(StopReason.CANCELLED, usage), now)
        return self._fail(Failure(ErrorKind.API_ERROR, "generation stopped unexpectedly", usage, True), now)

    # -- the chain -----------------------------------------------------------------------

    def _held(self, index: int) -> bool:
        """Whether block ``index``'s deltas pass the hold-back (text blocks, with a safety stage)."""
        return self._holdback is not None and self._blocks[index].kind is BlockKind.TEXT

    def _block_start(self, start: BlockStart) -> list[WireEvent]:
        wire = self._text(self._coalescer.flush())
        assert start.index == len(self._blocks) and self._open is None, f"block {start.index} out of order"
        self._blocks.append(_Block(start.kind, start.name, start.call_id))
        self._open = start.index
        self._received = self._sent = 0
        self._waiting.clear()  # a block's log probabilities whose text was never released
        self._generating()
        return [*wire, *self._render(start)]

    def _delta(self, delta: BlockDelta, now: float) -> list[WireEvent]:
        assert delta.index == self._open, f"a delta of block {delta.index}, but block {self._open} is open"
        self._generating()
        return self._text(self._coalescer.add(delta.text, delta.tokens, now))

    def _block_stop(self, stop: BlockStop) -> list[WireEvent]:
        assert stop.index == self._open, f"block {stop.index} stops, but block {self._open} is open"
        wire = self._text(self._coalescer.flush())
        self._open = None
        return [*wire, *self._render(stop)]

    def _text(self, text: str | None) -> list[WireEvent]:
        """Text out of the coalescer into the open block, with the log probabilities whose
        tokens' text it completes, and its wire events."""
        if not text:
            return []
        assert self._open is not None
        block = self._blocks[self._open]
        block.parts.append(text)
        self._released = True
        self._sent += len(text)
        logprobs: tuple[TokenLogprob, ...] = ()
        if self._waiting:
            n = next((i for i, (end, _) in enumerate(self._waiting) if end > self._sent), len(self._waiting))
            logprobs = tuple(logprob for _, logprob in self._waiting[:n])
            del self._waiting[:n]
            block.logprobs += logprobs
        return self._render(BlockDelta(self._open, text, 0, logprobs))

    def _generating(self) -> None:
        if self.status is MessageStatus.QUEUED:
            self.status = advance(self.status, MessageStatus.GENERATING)

    def _close_blocks(self) -> list[WireEvent]:
        """Before a Finish: release the coalescer's text and stop the open block; an empty text
        block when the message has none (the order ``core/events.py`` guarantees; the runner's
        own Finish comes with its blocks closed, a cancel or a refusal may not)."""
        wire = self._text(self._coalescer.flush())
        if self._open is not None:
            wire += self._render(BlockStop(self._open))
            self._open = None
        if not self._blocks:
            self._blocks.append(_Block(BlockKind.TEXT, "", ""))
            wire += self._render(BlockStart(0, BlockKind.TEXT))
            wire += self._render(BlockStop(0))
        return wire

    def _finish(self, finish: Finish, now: float) -> Step:
        self._require_move("finish")
        wire = self._close_blocks()
        self.usage = finish.usage
        self.stop_reason = finish.stop_reason
        self.stop_sequence = finish.stop_sequence
        cancelled = finish.stop_reason is StopReason.CANCELLED
        self.status = advance(self.status, MessageStatus.CANCELLED if cancelled else MessageStatus.COMPLETE)
        wire += self._render(finish)
        return self._end(wire, End(LogState.FINISHED, finish), now)

    def _fail(
        self, failure: Failure, now: float, *, status: MessageStatus = MessageStatus.FAILED
    ) -> Step:
        self._require_move("fail")
        wire = self._text(self._coalescer.flush())
        self.usage = failure.usage
        self.status = advance(self.status, status)
        self.error = failure.message
        wire += self._render(failure)
        return self._end(wire, End(LogState.FAILED, failure), now)

    def _end(self, wire: list[WireEvent], end: End, now: float) -> Step:
        step = self._step(wire, now)
        self._end_value = end
        return attrs.evolve(step, persist=self.snapshot(), end=end)

    # -- helpers -------------------------------------------------------------------------

    def _step(self, wire: list[WireEvent], now: float) -> Step:
        """Encode ``wire``; a snapshot when the status changed, or when text was released and
        ``persist_seconds`` have passed since the last snapshot."""
        released, self._released = self._released, False
        if wire:
            self._written_at = now
        persist = None
        if self.status is not self._persisted_status or (released and now - self._persisted_at >= self.persist_seconds):
            self._persisted_status = self.status
            if released:
                self._persisted_at = now
            persist = self.snapshot()
        return Step(entries=self._encode(wire), released=released, persist=persist)

    def _encode(self, wire: list[WireEvent]) -> tuple[bytes, ...]:
        out = []
        for ev in wire:
            retry, self.retry_ms = self.retry_ms, None  # the reconnection hint rides on the first entry
            event_id = format_event_id(self.message_id, self._seq)
            out.append(encode_event(ev.text(self._seq), event=ev.event, id=event_id, retry=retry))
            self._seq += 1
        return tuple(out)

    def _render(self, event: GenerationEvent) -> list[WireEvent]:
        """``event``'s wire events, noted in the trace (:class:`Trace`)."""
        match event:
            case BlockStart():
                self._ops.append(TRACE_START)
            case BlockDelta():
                self._ops.append(len(event.text))
                if self._counts is not None:
                    self._counts.append(len(event.logprobs))
                elif event.logprobs:  # the first delta that carries some
                    self._counts = [0] * sum(op > 0 for op in self._ops[:-1]) + [len(event.logprobs)]
            case BlockStop():
                self._ops.append(TRACE_STOP)
            case Failure():
                self._failure = (event.kind, event.retryable)
            case Finish():
                pass
            case _:
                assert_never(event)
        return render(self.renderer, event)

    def _require_move(self, move: str) -> None:
        if self.ended:
            raise RuntimeError(f"Producer.{move} after the message ended")
        if self._pending is not None:
            raise RuntimeError(f"Producer.{move}: a safety check awaits its verdict")


def replay(
    message_id: str,
    renderer: Renderer,
    usage: Usage,
    blocks: tuple[ContentBlock, ...],
    trace: Trace,
    terminal: Finish | Failure | None,
    retry_ms: int | None,
    *,
    terminal_seq: int | None = None,
) -> tuple[bytes, ...]:
    """A message's log entries rendered again from its stored state: the same seqs and bytes as
    the producer that made the ``trace`` appended, when ``renderer``, ``usage`` (before
    generation), ``retry_ms`` and ``blocks`` (the text the trace cut) are that producer's.

    A producer with no coalescing window and no safety stage is driven with the trace's
    events, one delta per op and the keepalives where they were, then ``terminal`` (None: the
    entries so far, no end).

    With ``terminal_seq``, only ``terminal``'s entries are returned, numbered from
    ``terminal_seq``: the end of a log that holds more than the trace (its producer died after
    its last snapshot; ``live/resume.py`` ``owner_lost_entries``). They render what the trace
    holds (the response object of a Responses failure: the stored output).

    Raises:
        ValueError: the trace does not fit ``blocks`` (a block or text it does not have).
    """
    producer = Producer(message_id, renderer, usage, flush_seconds=0.0, flush_tokens=1,
                        persist_seconds=math.inf, retry_ms=retry_ms)
    entries = list(producer.start(0.0).entries)
    index, offset, taken = -1, 0, 0
    counts = iter(trace.logprobs)
    for op in trace.ops:
        event: GenerationEvent
        if op == TRACE_KEEPALIVE:
            entries += producer.keepalive(0.0).entries
            continue
        if op == TRACE_START:
            index, offset, taken = index + 1, 0, 0
            if index >= len(blocks):
                raise ValueError(f"the trace starts block {index}, but the message has {len(blocks)}")
            block = blocks[index]
            event = BlockStart(index, block.kind, block.name, block.call_id)
        elif op == TRACE_STOP:
            event = BlockStop(index)
        else:
            text = blocks[index].text[offset:offset + op] if index >= 0 else ""
            if len(text) != op:
                raise ValueError(f"the trace cuts {op} characters past the text of block {index}")
            n = next(counts, 0)
            logprobs = blocks[index].logprobs[taken:taken + n]
            if len(logprobs) != n:
                raise ValueError(f"the trace takes {n} log probabilities past those of block {index}")
            event, offset, taken = BlockDelta(index, text, 1, logprobs), offset + op, taken + n
        entries += producer.event(event, usage, 0.0).entries
    if terminal_seq is not None:
        producer.continue_at(terminal_seq)
        entries = []
    if terminal is not None:
        entries += producer.event(terminal, terminal.usage, 0.0).entries
    return tuple(entries)
