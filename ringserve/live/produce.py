"""The Trio shell around ``core/producer.py``: one producer task per message.

Every generation runs in the server-owned nursery, not in the request's. Its
producer passes the runner's events through the safety stage
(``live/safety.py``, when ``[safety] window_tokens`` > 0), renders them in the
message's surface format, encodes them (``core/sse.py``) with the id
``<message_id>:<seq>``, and appends them to the message's ring log, coalesced
by ``core/coalesce.py``. :class:`Production` only performs what the producer's
steps say (append, close, persist through ``live/persist.py``, observe).

The producer is fed in the runner's pass over each decode step
(:meth:`Generation.consume <ringserve.engine.generation.Generation.consume>`): its
events, then a tick, with no task switch per token; first it tells the producer how long the
engine waited for the event loop after that step and how busy the loop was (``Runner.loop_lag``,
``Runner.loop_busy``), which widen the coalescing window while the loop lags
(``core/coalesce.py``). Text that waits for its
coalescing window goes at a step's end: the first one after its deadline when
that is at most half a window late (``slack``; with steps shorter than that, the
window gathers as many tokens as it would with a timer), else the last one
before it (expecting the next pass one decode step later, as long as the last
one took). The message's task wakes only for what needs awaiting: a safety check
(events wait meanwhile, in order), the end, or its timer, half a window past the
producer's deadline for text (at the deadline for a keepalive, which must not
come late) and moved by every pass, which fires only when the next step came
later than expected (a long decode, a keepalive).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import trio

from ringserve.config import Config
from ringserve.core.errors import RingserveError
from ringserve.core.events import Failure, Finish, GenerationEvent, Usage
from ringserve.core.producer import Producer, Step
from ringserve.core.safety import Check
from ringserve.core.view import MessageView
from ringserve.engine.runner import Generation, Prepared, Runner
from ringserve.live.message import LiveMessage
from ringserve.live.models import Lease
from ringserve.live.persist import Persister
from ringserve.live.safety import SafetyStage
from ringserve.logs.memory import LogStore
from ringserve.metrics import Metrics
from ringserve.store.sqlite import StoredMessage

log = logging.getLogger("ringserve.hub")


@attrs.define(eq=False)
class _Feed:
    """A producer's consumer of its generation's events (the runner calls it, see the module doc).

    ``slack``: how late (seconds) a deadline may be served by the next pass (half the flush
    window). ``pending``: events that wait while the task resolves a safety check; ``check``: the step
    whose check the task must ask; ``failed``: what a move raised, for the task to raise;
    ``attention``: set when the task has something to do; ``timer``: the task's fallback
    timer while it waits.
    """

    production: Production
    runner: Runner
    msg: LiveMessage
    producer: Producer
    gen: Generation
    slack: float
    pending: deque[GenerationEvent] = attrs.Factory(deque)
    check: Step | None = None
    failed: BaseException | None = None
    attention: trio.Event = attrs.Factory(trio.Event)
    timer: trio.CancelScope | None = None

    def __call__(self, events: Sequence[GenerationEvent]) -> None:
        if self.producer.ended or self.failed is not None:
            return
        if self.check is not None or self.pending:
            self.pending.extend(events)
            return
        try:
            now = trio.current_time()
            runner = self.runner
            self.producer.pace(runner.loop_lag, runner.last_step_seconds, runner.loop_busy, now)
            for i, event in enumerate(events):
                step = self.producer.event(event, self.gen.usage, now)
                self.production._perform(self.msg, step)
                if step.check is not None:
                    self.check = step
                    self.pending.extend(events[i + 1:])
                    self.attention.set()
                    return
            # release now what the next pass (a decode step later) would serve over slack late
            ahead = max(0.0, runner.last_step_seconds - self.slack)
            if self.producer.deadline <= now + ahead:
                self.production._perform(self.msg, self.producer.tick(now, ahead))
        except Exception as exc:
            self.failed = exc
        if self.producer.ended or self.failed is not None:
            self.attention.set()
        elif self.timer is not None and self.timer.deadline != self.fallback:
            self.timer.deadline = self.fallback  # (re-registers the timer: only on a change)

    @property
    def fallback(self) -> float:
        """When the task ticks the producer itself: ``slack`` past its deadline for text
        waiting for its window, at the deadline for a keepalive."""
        producer = self.producer
        return producer.deadline + self.slack if producer.text_waits else producer.deadline


@attrs.frozen
class Production:
    """What a producer task needs of the server, and the task itself (:meth:`run`).

    Args:
        config: the server config (``[stream]``, ``[server] retry_ms``).
        logs: the stream-log backend.
        persister: the store writes (the new row, the key a retry takes over, the snapshots) and
            what follows a message's end.
        metrics: TTFT, gaps, TPOT and in-band errors.
        safety: the output safety stage (None: off).
        registered: called with the message's id and the message once its log exists and its
            generation runs (the hub registers it as live).
        on_idle: called with the message each time its log's last reader leaves (the hub's
            disconnect policy).
    """

    config: Config
    logs: LogStore
    persister: Persister
    metrics: Metrics
    safety: SafetyStage | None
    registered: Callable[[str, LiveMessage], None]
    on_idle: Callable[[LiveMessage], None]

    def producer(self, msg: LiveMessage, prepared: Prepared) -> Producer:
        stream = self.config.stream
        return Producer(
            msg.id,
            msg.surface.renderer(msg.id, msg.model, msg.created, msg.include_usage),
            Usage(len(prepared.prompt_tokens), 0),
            flush_seconds=stream.flush_ms / 1000,
            flush_tokens=stream.flush_tokens,
            flush_max_seconds=stream.flush_max_ms / 1000,
            persist_seconds=stream.persist_seconds,
            window_tokens=0 if self.safety is None else self.safety.window_tokens,
            # The reconnection hint rides on the first event: a standalone "retry:"
            # block is dispatched as an empty event by the OpenAI SDK's decoder.
            retry_ms=self.config.server.retry_ms,
            keepalive_seconds=self.config.server.heartbeat_interval,
        )

    async def run(self, msg: LiveMessage, prepared: Prepared, row: StoredMessage, lease: Lease, *,
                  task_status: trio.TaskStatus[MessageView] = trio.TASK_STATUS_IGNORED) -> None:
        """Generate ``msg`` to its end on ``lease``'s model: its row and its log first
        (``task_status.started()`` then, with its view as it starts: the runner may have made some
        of its events meanwhile), then every event of the generation through its producer; its log
        is closed once the store has its final state (``Persister.saved``). Cancelled by
        ``msg.cancel_scope``: the producer's ``interrupted`` end. The lease is released at the end,
        whatever it is.

        With the model loaded, the request is enqueued first, so a full queue is the client's
        error before its stream (``OVERLOADED``). With the model still loading, the stream starts,
        its keepalives go on while it loads (:meth:`_loaded`), and then the request is enqueued; a
        load that fails, or a full queue then, ends the stream with the error in-band.
        """
        msg.producer = producer = self.producer(msg, prepared)
        gen = None
        try:
            with msg.cancel_scope:
                async with contextlib.AsyncExitStack() as stack:
                    runner = lease.model.runner
                    if runner is not None:
                        gen = await stack.enter_async_context(runner.submit(prepared))
                        msg.waiting = functools.partial(runner.waiting, gen)
                    else:
                        msg.waiting = lease.model.waiting
                    # The key moves to this message. No checkpoint follows the write until
                    # started(): a request cancelled meanwhile leaves no row without its message.
                    await self.persister.insert(row, replaces=msg.replaces)
                    msg.log = self.logs.create(msg.id, on_idle=self._idle_hook(msg))
                    self.registered(msg.id, msg)
                    task_status.started(msg.view())
                    self._perform(msg, producer.start(trio.current_time()))
                    if gen is None:
                        try:
                            runner = await self._loaded(msg, producer, lease)
                            gen = await stack.enter_async_context(runner.submit(prepared))
                            msg.waiting = functools.partial(runner.waiting, gen)
                        except RingserveError as exc:
                            failure = Failure(exc.kind, exc.message, producer.usage, exc.retryable)
                            self._perform(msg, producer.event(failure, producer.usage, trio.current_time()))
                            return
                    assert runner is not None
                    await self._pump(msg, producer, gen, runner)
        finally:
            lease.release()
            if msg.log is not None:
                if not producer.ended:
                    usage = producer.usage if gen is None else gen.usage
                    self._perform(msg, producer.interrupted(msg.cancel_reason, usage, trio.current_time()))
                with trio.CancelScope(shield=True):  # a drain or the server's end: the final state still goes
                    await self._close(msg, producer)

    def _idle_hook(self, msg: LiveMessage) -> Callable[[], None]:
        """The log's ``on_idle``: :attr:`on_idle` with the message while anything else holds it (the
        hub while it runs, a request, ``live/idempotency.py``'s session turns). Held weakly, so
        that an ended message (its text, its renderer) does not live as long as its log does
        (``[stream] ttl_seconds``), beside it and uncounted by ``[stream] memory_cap_bytes``."""
        ref = weakref.ref(msg)

        def idle() -> None:
            if (held := ref()) is not None:
                self.on_idle(held)

        return idle

    async def _close(self, msg: LiveMessage, producer: Producer) -> None:
        """Close the ended message's log once the store has its final state (or it is unsaved)."""
        await self.persister.saved(msg)
        assert producer.end is not None
        msg.open_log.close(producer.end.state)
        msg.done.set()
        self.persister.ended(msg)

    async def _loaded(self, msg: LiveMessage, producer: Producer, lease: Lease) -> Runner:
        """The runner of ``lease``'s model once it is loaded; the stream's keepalives go on meanwhile.

        Raises:
            RingserveError: the model's load failed.
        """
        while True:
            with trio.move_on_at(producer.deadline):
                return await lease.runner()
            self._perform(msg, producer.tick(trio.current_time()))

    async def _pump(self, msg: LiveMessage, producer: Producer, gen: Generation, runner: Runner) -> None:
        """Have the runner feed the generation's events to the producer (:class:`_Feed`) and do
        what needs awaiting until the message ends; leaving returns to the runner's ``submit``
        block, which cancels a generation still running."""
        feed = _Feed(self, runner, msg, producer, gen, self.config.stream.flush_ms / 2000)
        gen.consume(feed)
        while not producer.ended:
            with trio.CancelScope(deadline=feed.fallback) as feed.timer:
                await feed.attention.wait()
            feed.timer = None
            feed.attention = trio.Event()
            if feed.failed is not None:
                raise feed.failed
            if feed.check is not None:
                await self._resolve(feed)
            elif producer.deadline <= trio.current_time():  # no step came to tick it
                if producer.text_waits:  # a keepalive is too small to wait for the decode step
                    await runner.between_steps()
                self._perform(msg, producer.tick(trio.current_time()))

    async def _resolve(self, feed: _Feed) -> None:
        """Ask the safety check of ``feed.check``, then feed the events that waited for its verdict
        (asking the checks they bring)."""
        msg, producer = feed.msg, feed.producer
        while feed.check is not None:
            assert feed.check.check is not None
            step = await self._judge(msg, producer, feed.check.check)
            self._perform(msg, step)
            feed.check = step if step.check is not None else None
            while feed.check is None and feed.pending and not producer.ended:
                step = producer.event(feed.pending.popleft(), feed.gen.usage, trio.current_time())
                self._perform(msg, step)
                if step.check is not None:
                    feed.check = step
        feed.pending.clear()

    async def _judge(self, msg: LiveMessage, producer: Producer, check: Check) -> Step:
        assert self.safety is not None
        try:
            verdict = await self.safety.judge(check)
        except Exception as exc:
            log.exception("the safety check of message %s failed", msg.id)
            return producer.check_failed(type(exc).__name__, trio.current_time())
        if not verdict.allowed:
            log.info("safety stage refused message %s: %s", msg.id, verdict.reason)
        return producer.verdict(verdict, trio.current_time())

    def _perform(self, msg: LiveMessage, step: Step) -> None:
        """Do what a producer step says: append, persist, observe (the message's task closes its
        log after the end: :meth:`_close`)."""
        log_ = msg.open_log
        for entry in step.entries:
            log_.append(entry)
        now = trio.current_time()
        if step.released:
            msg.timer.released(now, self.metrics)
        if step.persist is not None:
            self.persister.write(msg, step.persist)
        if step.end is None:
            return
        match step.end.terminal:
            case Finish() as finish:
                msg.timer.finished(now, finish, self.metrics)
            case Failure() as failure:
                self.metrics.error(failure.kind, "generation")
