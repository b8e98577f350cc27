"""Generations decoupled from connections: one producer task per message, readers tail its log.

Every generation runs in the server-owned nursery, not in the request's. Its
producer passes the runner's events through the safety stage
(``live/safety.py``, when ``[safety] window_tokens`` > 0), renders them in
the message's surface format, encodes them (``core/sse.py``) with the id
``<message_id>:<seq>``, and appends them to the message's ring log,
coalesced by ``core/coalesce.py``. Every HTTP
connection, the first one included, is a reader of that log, so a dropped
client costs a replay, not the answer (seed "Streaming LLM Responses over SSE
and Surviving Disconnects").

When the last reader of a message leaves, its disconnect policy decides:
``abort`` cancels the generation after ``grace_seconds`` (the runner frees its
slot and KV cells before the next decode step); ``continue`` lets it finish.
A cancelled message is billed for the tokens really sampled.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import sqlite3
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, assert_never

import attrs
import trio

from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import Failure, Finish, StopReason, Usage
from ringserve.core.producer import Producer, Snapshot, Step, Trace, replay
from ringserve.core.ringlog import Gap, LogState, RingLog, parse_event_id
from ringserve.core.safety import Check
from ringserve.core.status import INTERRUPTED_MESSAGE, CancelReason, MessageStatus, Policy
from ringserve.core.view import MessageView
from ringserve.engine.runner import Generation, Runner
from ringserve.store.sqlite import (
    MessageStore,
    RenderArgs,
    StoredMessage,
    render_json,
    snapshot_fields,
    store_failed,
    stored_render,
    stored_trace,
)
from ringserve.metrics import GenerationStatistics, Metrics
from ringserve.logs.memory import KeyHolder, LogStore, MemoryMessageLog, MessageLog
from ringserve.logs.reader import tail
from ringserve.live.safety import SafetyStage
from ringserve.surfaces.base import ParsedRequest, Surface
from ringserve.surfaces.registry import SURFACES

log = logging.getLogger("ringserve.hub")

_NOT_YET = object()

#: Seconds a cancel sent to another replica waits for that replica to end the message.
CANCEL_WAIT_SECONDS = 10.0

#: Stored statuses that an idempotent retry generates again instead of returning.
REGENERATED_STATUSES = frozenset({MessageStatus.FAILED, MessageStatus.INTERRUPTED})

#: Seconds between looks for the message another replica's attempt claimed an ``Idempotency-Key``
#: for, until that replica's first flush (``[stream] flush_ms``) has written it to the shared store.
KEY_POLL_SECONDS = 0.05
#: Seconds after which a claimed ``Idempotency-Key`` whose message no replica has written is taken
#: over (its attempt's replica died before its first flush; an attempt that stops before its
#: message exists for any other reason lets its claim go at once: ``Hub.create``).
KEY_WAIT_SECONDS = 5.0
#: Seconds an attempt that failed to start spends at most letting its ``Idempotency-Key`` claim go
#: (``LogStore.release_key``), even when its request was cancelled.
RELEASE_SECONDS = 2.0

#: Seconds between two tries to write the final state of ended messages whose last store write
#: failed (``Hub._save_later``); no other write is tried in between.
STORE_RETRY_SECONDS = 1.0


@attrs.define(eq=False)
class LiveMessage:
    """A message whose producer is running or whose log is still held.

    Its state (status, content blocks, usage, stop reason) is its
    :class:`~ringserve.core.producer.Producer`'s, which exists once the
    generation was submitted; the status follows ``core/status.py``'s
    ``TRANSITIONS``. ``started`` is set once its log exists (or its creation
    failed, with the error in ``start_error`` when it was a
    :class:`RingserveError`); ``done`` once the terminal event is in the log,
    when the message leaves the hub and the store answers for it (unless the
    store failed to write its final state: it stays until
    ``Hub.save_unsaved`` has written it).
    ``replaces`` is the id of the ``interrupted`` or ``failed`` message whose
    ``Idempotency-Key`` this one takes over. ``unsaved``: its last store write
    failed, so the store holds an older state (``store_failed``: one did,
    which was logged). ``echo`` is what its objects echo while it is live
    (``Surface.restored``; the store may keep less: no prompt text without
    ``[store] keep_prompts``).
    """

    id: str
    surface: Surface
    model: str
    created: int
    include_usage: bool
    policy: Policy
    request_hash: str
    echo: str = ""
    idempotency_key: str | None = None
    replaces: str | None = None
    start_error: RingserveError | None = None
    log: MessageLog | None = None
    producer: Producer | None = None
    cancel_reason: CancelReason | None = None
    unsaved: bool = False
    store_failed: bool = False
    cancel_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    timer: StreamTimer = attrs.Factory(lambda: StreamTimer(trio.current_time()))
    started: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)

    @property
    def open_log(self) -> MessageLog:
        """``log``, which exists from the moment the message is registered (the producer's start)."""
        assert self.log is not None, f"message {self.id} has no log yet"
        return self.log

    def snapshot(self) -> Snapshot:
        """Its state now (status, content blocks released so far, usage, stop reason, error)."""
        assert self.producer is not None, f"message {self.id} was not submitted yet"
        return self.producer.snapshot()

    @property
    def status(self) -> MessageStatus:
        return MessageStatus.QUEUED if self.producer is None else self.producer.status

    def view(self) -> MessageView:
        """Its view now (``core/view.py``): the content released so far, live."""
        snap = None if self.producer is None else self.producer.snapshot()
        if snap is None:
            return MessageView(self.id, self.surface.name, self.model, self.created, MessageStatus.QUEUED,
                               echo=self.echo, request_hash=self.request_hash, live=True)
        return MessageView(
            id=self.id, surface=self.surface.name, model=self.model, created=self.created, status=snap.status,
            content=snap.content, stop_reason=snap.stop_reason, stop_sequence=snap.stop_sequence, usage=snap.usage,
            error=snap.error, echo=self.echo, request_hash=self.request_hash, live=True,
        )


@attrs.frozen
class Created:
    """What ``Hub.create`` gives: the message's view and, when it is live here, its handle (taken
    with the view, so that a generation that ends at once is still the request's to wait for)."""

    view: MessageView
    live: LiveMessage | None = None


@attrs.define
class StreamTimer:
    """When one generation started and released its first and latest text (seconds, the Trio clock)."""

    started: float
    first: float | None = None
    last: float | None = None

    def released(self, now: float, metrics: Metrics) -> None:
        """Text reached the log at ``now``: its TTFT the first time, else the gap since the last text."""
        if self.last is None:  # first and last are set together
            self.first = now
            metrics.first_text(now - self.started)
        else:
            metrics.text_gap(now - self.last)
        self.last = now

    def finished(self, now: float, finish: Finish, metrics: Metrics) -> None:
        """The generation finished at ``now``: TPOT = (now - first text) / (output tokens - 1).

        Cancelled generations and those with fewer than 2 tokens or no text
        are not observed (they say nothing about decode speed).
        """
        tokens = finish.usage.output_tokens
        if finish.stop_reason is not StopReason.CANCELLED and self.first is not None and tokens > 1:
            metrics.time_per_token((now - self.first) / (tokens - 1))


def request_hash(body: bytes) -> str:
    """Fingerprint of a request body, for ``Idempotency-Key`` checks."""
    return hashlib.sha256(body).hexdigest()


def _key_reused() -> RingserveError:
    return RingserveError(
        ErrorKind.UNPROCESSABLE, "Idempotency-Key was already used with a different request body", param="Idempotency-Key"
    )


def _retry_answer(existing: MessageView, body_hash: str) -> MessageView | None:
    """What an idempotent retry with ``body_hash`` returns of the message its key names: that
    message, or ``None`` when it ended ``failed``/``interrupted`` (not live here) and is generated
    again.

    Raises:
        RingserveError: ``UNPROCESSABLE``: the key was used with another body.
    """
    if existing.request_hash != body_hash:
        raise _key_reused()
    if not existing.live and existing.status in REGENERATED_STATUSES:
        return None
    return existing


def _resume_after(value: str, message_id: str) -> int:
    """The seq a ``Last-Event-ID`` names, or a 400 in the surface's shape."""
    if len(value) > 200:
        raise RingserveError(ErrorKind.INVALID_REQUEST, "Last-Event-ID is too long", param="Last-Event-ID")
    try:
        return parse_event_id(value, message_id)
    except ValueError as exc:
        raise RingserveError(ErrorKind.INVALID_REQUEST, str(exc)[:300], param="Last-Event-ID") from None


def _holds_from(log: MessageLog, after: int | None) -> bool:
    """Whether ``log`` still holds what follows ``after`` (an id never sent counts: it is the
    caller's 400)."""
    try:
        return not isinstance(log.read_from(after, limit=0), Gap)
    except ValueError:
        return True


def owner_lost_entries(stored: StoredMessage, seq: int) -> list[bytes]:
    """The end of a stream whose owning replica died, from entry ``seq`` on (``logs/redis.py``
    writes them into the stream): the retryable in-band failure the producer renders after the
    stored state (``core/producer.py`` :func:`replay` with the stored trace), so it carries the
    message's own fields (a Responses object's options, its output so far) and its seqs follow
    the log's (a Response event's ``sequence_number`` too)."""
    from ringserve.logs.redis import OWNER_LOST_MESSAGE

    failure = Failure(ErrorKind.UNAVAILABLE, OWNER_LOST_MESSAGE, stored.usage, True)
    args = stored_render(stored) or RenderArgs(include_usage=False, retry_ms=None)
    renderer = SURFACES.by_name(stored.surface).restored(args.echo).renderer(
        stored.id, stored.model, stored.created, args.include_usage)
    start = Usage(stored.input_tokens, 0)
    try:
        entries = replay(stored.id, renderer, start, stored.blocks, stored_trace(stored) or Trace(()), failure,
                         args.retry_ms, terminal_seq=seq)
    except ValueError:  # a trace that does not fit its text: the failure alone
        log.exception("the stored trace of message %s does not fit its text", stored.id)
        renderer = SURFACES.by_name(stored.surface).restored(args.echo).renderer(
            stored.id, stored.model, stored.created, args.include_usage)
        entries = replay(stored.id, renderer, start, (), Trace(()), failure, args.retry_ms, terminal_seq=seq)
    return list(entries)


class StreamEnded(Exception):
    """Nothing follows the resume point: it is the terminal event of a stream that has ended.

    Answered 204 No Content, on which a browser ``EventSource`` stops
    reconnecting (WHATWG HTML, "Server-sent events": a 204 fails the
    connection for good), where a 200 with an empty body would make it
    reconnect forever.
    """


class Hub:
    """Owns live messages, their producers and the disconnect policy.

    Args:
        config: the server config (stream and policy tables are used).
        runner: the engine's owner task.
        logs: the stream-log backend.
        store: the durable message store.
        nursery: the server-owned nursery producers run in.
        safety: the output safety stage (:meth:`SafetyStage.from_config`), None when off.
        metrics: where TTFT, gaps, TPOT and in-band errors are observed
            (default: a private :class:`Metrics` nobody scrapes).
    """

    def __init__(
        self,
        config: Config,
        runner: Runner,
        logs: LogStore,
        store: MessageStore,
        nursery: trio.Nursery,
        *,
        safety: SafetyStage | None,
        metrics: Metrics | None = None,
    ):
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.safety = safety
        self.runner = runner
        self.logs = logs
        self.store = store
        self._nursery = nursery
        self._live: dict[str, LiveMessage] = {}
        self._keys: dict[str, LiveMessage] = {}
        self._unsaved: dict[str, LiveMessage] = {}
        self._store_retry_at = -math.inf  # no write is tried before this (trio clock) after one failed
        self._store_error: sqlite3.Error | None = None  # the last failed write's
        self.draining = False

    # -- creating ------------------------------------------------------------------------

    async def create(
        self,
        surface: Surface,
        parsed: ParsedRequest,
        *,
        body_hash: str,
        request_json: str,
        policy: Policy,
        idempotency_key: str | None = None,
    ) -> Created:
        """Start a generation, or find the one an ``Idempotency-Key`` already started.

        The message is rendered by ``surface.restored(parsed.echo)`` (a surface with state of its
        own renders with the request's); the store keeps that echo (without prompt text unless
        ``[store] keep_prompts``), to rebuild the stream and answer its objects once it ended.

        A retry with the key of a message that ended ``interrupted`` (a crash
        or a drain) or ``failed`` starts a new generation under a new id, and
        the key names the new message from then on (the old one stays readable
        under its id); one that is live, ``complete`` or ``cancelled`` is
        returned as it is. Retries that arrive while the key's first attempt
        is still starting wait for it, and get its error if it failed to start.

        Returns:
            The message's view, with its handle when it is live here (an idempotent retry's
            message may be live, or only stored here or on another replica).

        Raises:
            RingserveError: ``UNPROCESSABLE`` (key reused with another body),
            ``INVALID_REQUEST`` (a prompt that does not fit the context, or a malformed
            ``Idempotency-Key``),
            ``OVERLOADED`` (queue full), ``UNAVAILABLE`` (draining, or a store
            write failed less than :data:`STORE_RETRY_SECONDS` ago); a retry
            that waited for the key's first attempt gets that attempt's error.
        """
        if idempotency_key is not None and not (0 < len(idempotency_key) <= 255 and idempotency_key.isprintable()):
            raise RingserveError(ErrorKind.INVALID_REQUEST, "Idempotency-Key must be 1-255 printable characters")
        if self.draining:
            raise RingserveError(ErrorKind.UNAVAILABLE, "server is shutting down", retry_after=1, retryable=True)
        replaces = None
        if idempotency_key is not None:
            idempotency_key = f"{surface.name}:{idempotency_key}"  # a key names a request on one surface
            existing = await self._by_key(idempotency_key)
            if existing is not None:
                if (answer := _retry_answer(existing, body_hash)) is not None:
                    return Created(answer, self.live(answer.id))
                replaces = existing.id
        if self._store_error is not None and trio.current_time() < self._store_retry_at:
            raise store_failed(self._store_error)  # a new row's write is not tried either (see _persist)
        model = self.runner.model_id
        msg = LiveMessage(
            id=f"{surface.id_prefix}{secrets.token_hex(12)}",
            surface=surface.restored(parsed.echo),
            model=model,
            created=int(time.time()),
            include_usage=parsed.include_usage,
            policy=policy,
            request_hash=body_hash,
            echo=parsed.echo,
            idempotency_key=idempotency_key,
            replaces=replaces,
        )
        claimed = None
        if idempotency_key is not None:
            self._keys[idempotency_key] = msg
        try:
            prepared = await self.runner.prepare(parsed.request)
            if idempotency_key is not None:
                claimed = KeyHolder(msg.id, body_hash)  # from the claim's round trip on: it may name msg
                elsewhere = await self._claim(idempotency_key, msg)
                if elsewhere is not None:
                    return Created(elsewhere, self.live(elsewhere.id))
            row = StoredMessage(
                id=msg.id,
                surface=surface.name,
                model=model,
                created=msg.created,
                status=MessageStatus.QUEUED,
                request=request_json,
                request_hash=body_hash,
                idempotency_key=idempotency_key,
                input_tokens=len(prepared.prompt_tokens),
                render=render_json(RenderArgs(parsed.include_usage, self.config.server.retry_ms,
                                              parsed.echo if self.config.store.keep_prompts
                                              else parsed.echo_without_prompts)),
            )
            await self._nursery.start(self._produce, msg, prepared, row)
        except BaseException as exc:
            if isinstance(exc, RingserveError):
                msg.start_error = exc  # for the retries waiting on this attempt
            if claimed is not None and idempotency_key is not None:
                # Whatever stopped the start (a refusal, a store that failed, the client gone and
                # the request cancelled, even mid-claim), the key is let go at once if it names msg
                # (compare and delete): a retry through another replica would else wait
                # KEY_WAIT_SECONDS for a message that never appears.
                with trio.move_on_after(RELEASE_SECONDS, shield=True):
                    await self.logs.release_key(idempotency_key, claimed)
            raise
        finally:
            if idempotency_key is not None and msg.log is None:
                del self._keys[idempotency_key]
            msg.started.set()
        return Created(msg.view(), msg)

    async def _claim(self, key: str, msg: LiveMessage) -> MessageView | None:
        """Make ``key`` name ``msg`` on every replica (``LogStore.claim_key``), or find what it names.

        Another replica's attempt under ``key`` is followed: to its message,
        which a retry returns (live or ended), unless it ended ``failed`` or
        ``interrupted`` (then ``msg`` takes the key over). A message the key
        names that no replica has written yet (its owner's first flush is on
        its way) is looked for every :data:`KEY_POLL_SECONDS`; one that has not
        appeared after :data:`KEY_WAIT_SECONDS` (its attempt never started) is
        taken over.

        Returns:
            ``None`` once ``key`` names ``msg``, else the message to return.

        Raises:
            RingserveError: ``UNPROCESSABLE`` (the key names a request with
            another body), ``UNAVAILABLE`` (the shared store is unreachable).
        """
        replaces = msg.replaces
        deadline = trio.current_time() + KEY_WAIT_SECONDS
        while (holder := await self.logs.claim_key(key, KeyHolder(msg.id, msg.request_hash),
                                                   replaces=replaces)) is not None:
            if holder.request_hash != msg.request_hash:
                raise _key_reused()
            try:
                existing: MessageView | None = await self.find(holder.message_id)
            except RingserveError as exc:
                if exc.kind is not ErrorKind.NOT_FOUND:
                    raise
                existing = None
            if existing is not None:
                if (answer := _retry_answer(existing, msg.request_hash)) is not None:
                    return answer
                replaces = existing.id
            elif trio.current_time() >= deadline:
                replaces = holder.message_id
            else:
                await trio.sleep(KEY_POLL_SECONDS)
        return None

    async def _by_key(self, key: str) -> MessageView | None:
        """The message ``key`` names once no attempt under it is still starting: live, stored or None.

        Raises:
            RingserveError: the error of the attempt this call waited for,
            when that attempt failed to start (the same answer for every
            concurrent retry).
        """
        while (pending := self._keys.get(key)) is not None and not pending.started.is_set():
            await pending.started.wait()
            if pending.start_error is not None:
                raise pending.start_error
            # else it started, or was cancelled before it did: look again
        if (live := self._keys.get(key)) is not None:
            return live.view()
        stored = self.store.by_idempotency_key(key)
        return None if stored is None else stored.view()

    async def _produce(self, msg: LiveMessage, prepared: Any, row: StoredMessage, *, task_status: Any) -> None:
        stream = self.config.stream
        msg.producer = producer = Producer(
            msg.id,
            msg.surface.renderer(msg.id, msg.model, msg.created, msg.include_usage),
            Usage(len(prepared.prompt_tokens), 0),
            flush_seconds=stream.flush_ms / 1000,
            flush_tokens=stream.flush_tokens,
            persist_seconds=stream.persist_seconds,
            window_tokens=0 if self.safety is None else self.safety.window_tokens,
            # The reconnection hint rides on the first event: a standalone "retry:"
            # block is dispatched as an empty event by the OpenAI SDK's decoder.
            retry_ms=self.config.server.retry_ms,
        )
        gen = None
        try:
            with msg.cancel_scope:
                async with self.runner.submit(prepared) as gen:
                    if msg.replaces is not None:
                        self.store.update(msg.replaces, idempotency_key=None)  # the key moves to this message
                    self.store.insert(row)
                    msg.log = self.logs.create(msg.id)
                    msg.log.on_idle = lambda: self._on_idle(msg)
                    self._live[msg.id] = msg
                    task_status.started()
                    self._perform(msg, producer.start())
                    await self._pump(msg, producer, gen)
        finally:
            if msg.log is not None and not msg.log.closed:
                usage = producer.usage if gen is None else gen.usage
                self._perform(msg, producer.interrupted(msg.cancel_reason, usage, trio.current_time()))

    async def _pump(self, msg: LiveMessage, producer: Producer, gen: Generation) -> None:
        """Feed the generation's events to the producer until the message ends; leaving
        returns to the runner's ``submit`` block, which cancels a generation still running."""
        events = gen.__aiter__()
        while not producer.ended:
            event: Any = _NOT_YET
            deadline = producer.deadline
            if deadline == math.inf:  # nothing waits for a flush: no cancel scope per event
                event = await anext(events, None)
            else:
                with trio.move_on_at(deadline):
                    event = await anext(events, None)
            if event is _NOT_YET:
                await self.runner.between_steps()
                step = producer.tick(trio.current_time())
            elif event is None:
                failure = Failure(ErrorKind.API_ERROR, "generation ended without a result", gen.usage, True)
                step = producer.event(failure, gen.usage, trio.current_time())
            else:
                step = producer.event(event, gen.usage, trio.current_time())
            # A safety check runs outside the flush deadline's scope, which must not cut it short.
            while step.check is not None:
                self._perform(msg, step)
                step = await self._judge(msg, producer, step.check)
            self._perform(msg, step)

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
        """Do what a producer step says: append, persist, observe, and close at the end."""
        log_ = msg.open_log
        for entry in step.entries:
            log_.append(entry)
        now = trio.current_time()
        if step.released:
            msg.timer.released(now, self.metrics)
        if step.end is not None:
            log_.close(step.end.state)
        if step.persist is not None:
            self._persist(msg, step.persist)
        if step.end is None:
            return
        match step.end.terminal:
            case Finish() as finish:
                msg.timer.finished(now, finish, self.metrics)
            case Failure() as failure:
                self.metrics.error(failure.kind, "generation")
        msg.done.set()
        if not msg.unsaved:
            self._forget(msg)
            return
        if not self._unsaved:
            self._nursery.start_soon(self._save_later)
        self._unsaved[msg.id] = msg

    def _persist(self, msg: LiveMessage, snap: Snapshot, *, probe: bool = False) -> None:
        """Write ``snap`` to the store; a write the store fails (``sqlite3.Error``: a full disk, an
        I/O error, a lock held past ``busy_timeout``) leaves the generation and its log going.

        After a failed write no other is tried for :data:`STORE_RETRY_SECONDS` (a locked store
        holds the event loop for its ``busy_timeout``, a second, at each write), except a
        ``probe`` (:meth:`save_unsaved`); a snapshot not tried leaves its message unsaved like
        one that failed. The first failed or untried write of a message is logged (once, not
        per snapshot; the store counts each failure in ``StoreStatistics.write_failures_total``).
        A later snapshot holds the whole state, so it makes up for the missed ones; a message
        that ends unsaved stays here, answered from memory by :meth:`lookup` and its
        ``Idempotency-Key``, until :meth:`save_unsaved` has written its final state.
        """
        if probe or trio.current_time() >= self._store_retry_at:
            try:
                self.store.update(msg.id, **snapshot_fields(snap))
            except sqlite3.Error as exc:
                self._store_retry_at = trio.current_time() + STORE_RETRY_SECONDS
                self._store_error = exc
            else:
                self._store_retry_at = -math.inf
                if msg.unsaved:
                    log.info("message %s is written to the message store again", msg.id)
                msg.unsaved = False
                return
        if not msg.store_failed:
            log.error("the message store failed to write message %s (%s); its stream goes on from its log,"
                      " and its state is written once the store works again", msg.id, self._store_error)
        msg.unsaved = msg.store_failed = True

    async def _save_later(self) -> None:
        """Every :data:`STORE_RETRY_SECONDS`, :meth:`save_unsaved`, until every message is written.
        Cancelled with the server, which calls :meth:`save_unsaved` once more after the drain."""
        while self._unsaved:
            await trio.sleep(STORE_RETRY_SECONDS)
            self.save_unsaved()

    def save_unsaved(self) -> int:
        """Write again the final state of each ended message whose last write failed; those written
        leave the hub. Returns how many are still unsaved (a message the server stops with is
        ``generating`` in the store, which the next start marks ``interrupted``)."""
        for msg in list(self._unsaved.values()):
            self._persist(msg, msg.snapshot(), probe=True)
            if msg.unsaved:
                break  # the store still fails: the others wait for the next round
            del self._unsaved[msg.id]
            self._forget(msg)
        return len(self._unsaved)

    def _forget(self, msg: LiveMessage) -> None:
        """An ended message leaves the hub: from now on the store answers for it."""
        del self._live[msg.id]
        if msg.idempotency_key is not None:
            del self._keys[msg.idempotency_key]

    # -- policy and cancel ---------------------------------------------------------------

    def _on_idle(self, msg: LiveMessage) -> None:
        if msg.done.is_set() or msg.policy is not Policy.ABORT:
            return
        grace = self.config.policy.grace_seconds
        if grace <= 0:
            self.cancel(msg, CancelReason.CLIENT_GONE)
        else:
            self._nursery.start_soon(self._abort_after_grace, msg, grace)

    async def _abort_after_grace(self, msg: LiveMessage, grace: float) -> None:
        await trio.sleep(grace)
        if msg.open_log.readers == 0:
            self.cancel(msg, CancelReason.CLIENT_GONE)

    def cancel(self, msg: LiveMessage, reason: CancelReason) -> None:
        """Cancel a live generation (idempotent); its readers get a terminal event."""
        if not msg.done.is_set() and msg.cancel_reason is None:
            msg.cancel_reason = reason
            msg.cancel_scope.cancel()

    def delete_when_done(self, msg: LiveMessage) -> None:
        """Delete ``msg``'s stored row once its generation has ended: now if it has, else when it
        does (a ``store: false`` response whose reader left before its end; its log stays
        for the readers that hold it, until its TTL)."""
        if msg.done.is_set():
            self.store.delete(msg.id)
            return

        async def delete_at_end() -> None:
            await msg.done.wait()
            self.store.delete(msg.id)

        self._nursery.start_soon(delete_at_end)

    def drain(self) -> None:
        """Refuse new generations from now on."""
        self.draining = True

    def cancel_all(self, reason: CancelReason) -> None:
        for msg in list(self._live.values()):
            self.cancel(msg, reason)

    async def wait_all_done(self) -> None:
        for msg in list(self._live.values()):
            await msg.done.wait()

    # -- finding and reading -------------------------------------------------------------

    def statistics(self) -> GenerationStatistics:
        """Its generations now (for ``metrics.py``): those whose terminal event is not yet in their
        log, and ended ones whose final state the store failed to write (:meth:`save_unsaved`
        retries them)."""
        active = sum(1 for msg in self._live.values() if not msg.done.is_set())
        return GenerationStatistics(active_generations=active, unsaved_messages=len(self._unsaved))

    def live(self, message_id: str) -> LiveMessage | None:
        """The message if its generation is still running, or it ended and the store failed to
        write its final state (which is then answered from memory)."""
        return self._live.get(message_id)

    def stored(self, message_id: str) -> StoredMessage:
        """The store's row of ``message_id``.

        Raises:
            RingserveError: ``NOT_FOUND`` when no such message exists, or it was deleted by the
            store's retention (``store/sqlite.py`` ``MessageStore.sweep``); ``UNAVAILABLE`` when
            the store fails to read.
        """
        try:
            stored = self.store.get(message_id)
        except sqlite3.DatabaseError as exc:
            raise store_failed(exc) from None
        if stored is None:
            raise RingserveError(
                ErrorKind.NOT_FOUND,
                f"no message {message_id[:80]!r}: the id is unknown, or the message was deleted after its"
                " retention time ([store] max_age_seconds, max_bytes)",
            )
        return stored

    def stored_request(self, message_id: str) -> tuple[MessageView, str] | None:
        """A stored message's view and its request body as received ("" when prompts are not kept),
        None when the store has no such message (``surfaces/base.py`` ``LoadStored``). It reads the
        store without Trio, so it may run on a worker thread.

        Raises:
            RingserveError: ``UNAVAILABLE`` when the store fails to read.
        """
        try:
            stored = self.store.get(message_id)
        except sqlite3.DatabaseError as exc:
            raise store_failed(exc) from None
        return None if stored is None else (stored.view(), stored.request)

    def delete(self, message_id: str) -> None:
        """Delete a message that has ended: its stored row and its log (``DELETE /v1/responses/{id}``)."""
        self.store.delete(message_id)
        self.logs.forget(message_id)

    def lookup(self, message_id: str) -> MessageView:
        """The message's view: live, else stored.

        Raises:
            RingserveError: as :meth:`stored`.
        """
        msg = self.live(message_id)
        return msg.view() if msg is not None else self.stored(message_id).view()

    async def find(self, message_id: str) -> MessageView:
        """:meth:`lookup`, else the state another replica wrote (Redis backend: ``LogStore.find_message``).

        Raises:
            RingserveError: ``NOT_FOUND`` when no replica has such a message;
            ``UNAVAILABLE`` when the shared store is unreachable.
        """
        try:
            return self.lookup(message_id)
        except RingserveError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:
                raise
            shared = await self.logs.find_message(message_id)
            if shared is None:
                raise
            return shared.view()

    async def ended(self, message: MessageView) -> MessageView:
        """``message`` once it has ended: cancelled (``REQUESTED``) if it still runs, here or on
        another replica (then the state that replica wrote once its log ended, waiting at most
        :data:`CANCEL_WAIT_SECONDS`).

        Raises:
            RingserveError: ``UNAVAILABLE``: the shared store is unreachable.
        """
        live = self.live(message.id)
        if live is not None:
            self.cancel(live, CancelReason.REQUESTED)
            await live.done.wait()
            return live.view()
        if message.status.final:
            return message
        await self.logs.request_cancel(message.id)  # another replica generates it
        return await self.settled(message, CANCEL_WAIT_SECONDS)

    async def settled(self, message: MessageView, seconds: float = math.inf) -> MessageView:
        """``message`` as it ended: at once if its status is final, else once its log (generated by
        another replica) has ended, waiting at most ``seconds`` as a reader of it (so the abort
        policy counts the wait); the state its owner then wrote (``message`` if none).

        Raises:
            RingserveError: ``UNAVAILABLE``: the shared store is unreachable.
        """
        if message.status.final:
            return message
        log = await self.logs.find(message.id)
        if log is not None:
            with log.reader(), trio.move_on_after(seconds):
                while not log.closed:
                    await log.wait_for_entries(log.next_seq - 1 if log.next_seq else None)
        shared = await self.logs.find_message(message.id)
        return message if shared is None else shared.view()

    async def open_log(self, message_id: str, last_event_id: str | None) -> tuple[MessageLog, int | None]:
        """The log to resume and the seq to resume after (None: from the start).

        A message whose log has expired, or whose ended log no longer holds the resume point
        (ring caps), is rebuilt from the store (:meth:`rebuilt`) with the seqs and bytes its log
        had, so a reader resumes after expiry and after a restart without a gap or a duplicate.

        Raises:
            StreamEnded: ``last_event_id`` is the terminal event of the
            message's stream, whether its log is still held or has expired
            (the store keeps the terminal event's seq).
            RingserveError: ``NOT_FOUND`` (unknown message), ``GONE`` (the log
            expired and the store cannot rebuild it: a row written before schema 5, or a
            message still generating on another replica; or the id is older than the ring of
            a live log holds: fetch ``GET /v1/messages/{id}``), ``INVALID_REQUEST`` (malformed
            id, or one that was never sent).
        """
        after = None if last_event_id is None else _resume_after(last_event_id, message_id)
        log = await self.logs.find(message_id, after)  # a replica's copy may first catch up to after
        if log is None or (log.closed and not _holds_from(log, after)):
            row = None if self.live(message_id) is not None else self.stored(message_id)  # NOT_FOUND: unknown
            if after is not None and row is not None and row.final_seq == after:
                raise StreamEnded(message_id)
            log = None if row is None else self.rebuilt(row)
            if log is None:
                raise RingserveError(
                    ErrorKind.GONE,
                    f"the stream log of {message_id} has expired; GET /v1/messages/{message_id} has the message",
                )
        if log.closed and after is not None and after == log.next_seq - 1:
            raise StreamEnded(message_id)
        try:
            check = log.read_from(after, limit=0)
        except ValueError:
            raise RingserveError(
                ErrorKind.INVALID_REQUEST, "Last-Event-ID names an event that was never sent", param="Last-Event-ID"
            ) from None
        if isinstance(check, Gap):
            raise RingserveError(
                ErrorKind.GONE,
                f"{'the start of the stream' if after is None else f'the events after {last_event_id}'} has left"
                f" the ring; GET /v1/messages/{message_id} has the text",
            )
        return log, after

    def rebuilt(self, msg: StoredMessage) -> MemoryMessageLog | None:
        """The ended log of a stored message, rendered again (``core/producer.py`` :func:`replay`);
        None when the row cannot rebuild it (written before schema 5, not final, or a trace
        that does not fit its text).

        It ends with the terminal event the stored status says: the log's own for a message
        that ended, and for one a crash left ``interrupted`` a retryable ``api_error`` failure
        (:data:`~ringserve.core.status.INTERRUPTED_MESSAGE`) after the text the store had; a
        reader that had read past that text then sees the rebuilt seqs, which may differ.
        The log is held by its readers only, not by the log store.
        """
        trace, args = stored_trace(msg), stored_render(msg)
        if trace is None or args is None or not msg.status.final:
            return None
        usage = msg.usage
        terminal: Finish | Failure
        match msg.status:
            case MessageStatus.COMPLETE | MessageStatus.CANCELLED:
                terminal = Finish(msg.stop_reason or StopReason.END, usage, msg.stop_sequence)
            case MessageStatus.FAILED | MessageStatus.INTERRUPTED:
                kind, retryable = trace.failure or (ErrorKind.API_ERROR, True)
                terminal = Failure(kind, msg.error or INTERRUPTED_MESSAGE, usage, retryable)
            case MessageStatus.QUEUED | MessageStatus.GENERATING:
                return None
            case _:
                assert_never(msg.status)
        surface = SURFACES.by_name(msg.surface).restored(args.echo)
        renderer = surface.renderer(msg.id, msg.model, msg.created, args.include_usage)
        try:
            entries = replay(msg.id, renderer, Usage(msg.input_tokens, 0), msg.blocks, trace, terminal, args.retry_ms)
        except ValueError:
            log.exception("the stored trace of message %s does not fit its text", msg.id)
            return None
        if msg.final_seq is not None and msg.final_seq != len(entries) - 1:
            log.error("message %s rebuilt %d entries, its log had %d", msg.id, len(entries), msg.final_seq + 1)
            return None
        rebuilt = MemoryMessageLog(msg.id, RingLog(len(entries), sum(map(len, entries))))
        for entry in entries:
            rebuilt.append(entry)
        rebuilt.close(LogState.FINISHED if isinstance(terminal, Finish) else LogState.FAILED)
        return rebuilt

    def stream(
        self, log: MessageLog, after: int | None, on_heartbeat: Callable[[], None] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The SSE bytes of ``log`` after ``after``: replay, then live, with heartbeats.

        A connection that reaches ``server.max_stream_seconds`` ends with a
        reconnect hint (``core/sse.py`` ``encode_reconnect``); the generation
        is then held for ``retry_ms + heartbeat_interval`` (:meth:`_hold`), so
        the disconnect policy does not abort it while the client reconnects.
        """
        server = self.config.server
        return tail(log, after, heartbeat_interval=server.heartbeat_interval, on_heartbeat=on_heartbeat,
                    max_seconds=server.max_stream_seconds, on_reconnect=lambda: self._hold(log))

    def _hold(self, log: MessageLog) -> None:
        """Count one more reader of ``log`` for ``retry_ms + heartbeat_interval`` seconds.

        Entered synchronously, before the reader that sent a reconnect hint
        leaves, so ``on_idle`` (the disconnect policy) does not fire in between.
        """
        if log.closed:
            return
        server = self.config.server
        hold = log.reader()
        hold.__enter__()

        async def release_later() -> None:
            try:
                await trio.sleep(server.retry_ms / 1000 + server.heartbeat_interval)
            finally:
                hold.__exit__(None, None, None)

        self._nursery.start_soon(release_later)
