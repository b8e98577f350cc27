"""A message being generated on this replica: its identity and the Trio handles around it."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from ringserve.core.errors import RingserveError
from ringserve.core.events import Finish, StopReason
from ringserve.core.producer import Producer, Snapshot
from ringserve.core.status import CancelReason, MessageStatus, Policy
from ringserve.core.view import MessageView, Waiting
from ringserve.logs.memory import MessageLog
from ringserve.metrics import Metrics
from ringserve.surfaces.base import Surface


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


@attrs.define(eq=False)
class LiveMessage:
    """A message whose producer is running or whose log is still held.

    Its state (status, content blocks, usage, stop reason) is its
    :class:`~ringserve.core.producer.Producer`'s, which exists once the
    generation was submitted; the status follows ``core/status.py``'s
    ``TRANSITIONS``. ``started`` is set once its log exists (or its creation
    failed, with the error in ``start_error`` when it was a
    :class:`RingserveError`); ``done`` once its log is closed, after its terminal
    event and once the store has its final state, when the message leaves the
    hub and the store answers for it (unless the store failed to write that
    state: it stays until a retry of ``live/persist.py`` has written it).
    ``replaces`` is the id of the ``interrupted`` or ``failed`` message whose
    ``Idempotency-Key`` this one takes over; ``session_key`` its implicit key (a request of a
    client session: ``live/idempotency.py`` ``SessionTurns``). ``unsaved``: its last store write
    failed, so the store holds an older state (``store_failed``: one did,
    which was logged). ``echo`` is what its objects echo while it is live
    (``Surface.restored``; the store may keep less: no prompt text without
    ``[store] keep_prompts``). ``waiting``, set by its producer's task (``live/produce.py``),
    says what it waits for while it is queued: its model's load, then its runner's queue.
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
    session_key: str | None = None
    replaces: str | None = None
    start_error: RingserveError | None = None
    log: MessageLog | None = None
    producer: Producer | None = None
    cancel_reason: CancelReason | None = None
    unsaved: bool = False
    store_failed: bool = False
    cancel_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    waiting: Callable[[], Waiting] | None = None
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
        status = MessageStatus.QUEUED if snap is None else snap.status
        waiting = self.waiting() if status is MessageStatus.QUEUED and self.waiting is not None else None
        if snap is None:
            return MessageView(self.id, self.surface.name, self.model, self.created, status,
                               echo=self.echo, request_hash=self.request_hash, live=True, waiting=waiting)
        return MessageView(
            id=self.id, surface=self.surface.name, model=self.model, created=self.created, status=status,
            content=snap.content, stop_reason=snap.stop_reason, stop_sequence=snap.stop_sequence, usage=snap.usage,
            error=snap.error, echo=self.echo, request_hash=self.request_hash, live=True, waiting=waiting,
        )

    def cancel(self, reason: CancelReason) -> None:
        """Cancel its generation (idempotent; nothing once it ended); its readers get a terminal event."""
        if not self.done.is_set() and self.cancel_reason is None:
            self.cancel_reason = reason
            self.cancel_scope.cancel()


@attrs.frozen
class Created:
    """What ``Hub.create`` gives: the message's view and, when it is live here, its handle (taken
    with the view, so that a generation that ends at once is still the request's to wait for)."""

    view: MessageView
    live: LiveMessage | None = None
