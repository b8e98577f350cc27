"""Writing the live messages' states to the store off the event loop, and going on when a write fails.

Every write runs on a Trio worker thread (``MessageStore.off_loop``): a write that waits (for a
lock another process holds on the file, up to ``store/sqlite.py`` ``BUSY_TIMEOUT_MS``, or for a
WAL checkpoint) holds up no stream and no request. A generation's snapshots are queued, the
newest of each message replacing an older one not yet written, and written in rounds, one round
at a time, each one transaction (``MessageStore.update_all``: 0.43 ms for 64 messages where 64
commits took 1.04 ms, on the shared 2-core machine; with Redis, one trip to the event loop). A
message's end waits for the round of its final snapshot (``live/produce.py`` closes its log
then), so a message whose log has ended is in the store in its final state, or unsaved.

A write the store fails (``sqlite3.Error``: a full disk, an I/O error, a lock
held past ``busy_timeout``) leaves the generation and its log going: its message
is marked ``unsaved`` and, once it ended, kept in memory (answered from there)
until its final state is written; the writes are tried again every
:data:`STORE_RETRY_SECONDS`.
"""

from __future__ import annotations

import functools
import logging
import math
import sqlite3
from collections.abc import Callable

import attrs
import trio

from ringserve.core.producer import Snapshot
from ringserve.live.message import LiveMessage
from ringserve.store.sqlite import MessageStore, StoredMessage, snapshot_fields, store_failed

log = logging.getLogger("ringserve.hub")

#: Seconds after a failed write during which no other write is tried (then the writes queued
#: meanwhile are tried again, and so on until they are written).
STORE_RETRY_SECONDS = 1.0


@attrs.define(eq=False)
class Persister:
    """The store writes of the live messages, on a worker thread, with a back-off after a failure.

    Args:
        store: the durable message store.
        nursery: where the task that writes the queued snapshots runs (while some are queued).
        written: called with an ended message once its final state is in the store (it leaves
            the hub then).
    """

    store: MessageStore
    nursery: trio.Nursery
    written: Callable[[LiveMessage], None]
    _retry_at: float = attrs.field(default=-math.inf, init=False)  # no write is tried before (trio clock)
    _error: sqlite3.Error | None = attrs.field(default=None, init=False)  # the last failed write's
    # the newest snapshot of each message not yet written, and those of the round on its way, by message id
    _queued: dict[str, tuple[LiveMessage, Snapshot]] = attrs.field(factory=dict, init=False)
    _writing: dict[str, tuple[LiveMessage, Snapshot]] = attrs.field(factory=dict, init=False)
    _round_ended: trio.Event = attrs.field(factory=trio.Event, init=False)
    _task_runs: bool = attrs.field(default=False, init=False)
    _unsaved: dict[str, LiveMessage] = attrs.field(factory=dict, init=False)  # ended, final state not written

    @property
    def unsaved(self) -> int:
        """Ended messages whose final state the store failed to write (tried again every
        :data:`STORE_RETRY_SECONDS`)."""
        return len(self._unsaved)

    def check_new(self) -> None:
        """Refuse a new message while the store's writes are not tried (a new row's write is not
        tried either: see :meth:`write`).

        Raises:
            RingserveError: ``UNAVAILABLE``: a write failed less than :data:`STORE_RETRY_SECONDS` ago.
        """
        if self._error is not None and trio.current_time() < self._retry_at:
            raise store_failed(self._error)

    async def insert(self, row: StoredMessage, *, replaces: str | None = None) -> None:
        """Write a new message's row, the ``Idempotency-Key`` it takes over from the message
        ``replaces`` moved to it first. It is not tried when a write failed meanwhile, while the
        store's earlier writes ran (:meth:`check_new`: a burst of new messages during a lock waits
        for one ``busy_timeout``, not one each). A failure other than a broken constraint is a
        failed write like a snapshot's: :meth:`check_new` refuses new messages until the retry
        is due.

        Raises:
            RingserveError: ``UNAVAILABLE``: as :meth:`check_new`.
            sqlite3.Error: the store failed (``IntegrityError``: the id or key exists already).
        """

        def insert() -> None:
            trio.from_thread.run_sync(self.check_new)
            if replaces is not None:
                self.store.update(replaces, idempotency_key=None)
            self.store.insert(row)

        try:
            await self.store.off_loop(insert)
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as exc:
            self._failed(exc)
            raise

    def write(self, msg: LiveMessage, snap: Snapshot) -> None:
        """Queue ``snap`` for the store (it replaces a snapshot of ``msg`` queued before and not
        yet written): a task writes it soon.

        After a failed write no other is tried for :data:`STORE_RETRY_SECONDS`; a snapshot
        queued meanwhile leaves its message unsaved like one that failed. The first failed or
        untried write of a message is logged (once, not per snapshot; the store counts each
        failure in ``StoreStatistics.write_failures_total``). A later snapshot holds the whole
        state, so it makes up for the missed ones.
        """
        self._queued[msg.id] = (msg, snap)
        if trio.current_time() < self._retry_at:
            self._missed(msg)
        self._write_soon()

    async def saved(self, msg: LiveMessage) -> None:
        """Return once the snapshots of ``msg`` queued so far are in the store, or it is unsaved (a
        write failed, or is not tried before the retry is due). Cancellation is delayed while a
        round this call started runs (at most about ``BUSY_TIMEOUT_MS``)."""
        while not msg.unsaved and (msg.id in self._queued or msg.id in self._writing):
            await self._next_round()

    def ended(self, msg: LiveMessage) -> None:
        """``msg`` ended, after :meth:`saved`: it is ``written`` now, or once a retry has written
        its final state."""
        if msg.unsaved:
            self._unsaved[msg.id] = msg
        else:
            self.written(msg)

    async def save_unsaved(self) -> int:
        """Write what is queued now, even if the retry is not due (the drain; a round on its way is
        waited for first). Returns how many ended messages are still unsaved (a message the server
        stops with is ``generating`` in the store, which the next start marks ``interrupted``)."""
        while self._writing:
            await self._round_ended.wait()
        if self._queued:
            await self._write_round()
        return len(self._unsaved)

    def _write_soon(self) -> None:
        """Have the task that writes the queued snapshots run (:meth:`_write_queued`)."""
        if not self._task_runs:
            self._task_runs = True
            self.nursery.start_soon(self._write_queued)

    async def _write_queued(self) -> None:
        """Write the queued snapshots, round after round, each failed one again once the retry
        is due, until none is queued."""
        try:
            while self._queued:
                await trio.sleep_until(self._retry_at)
                await self._next_round()
        finally:
            self._task_runs = False

    async def _next_round(self) -> None:
        """Wait for the end of the round on its way, or write one."""
        if self._writing:
            await self._round_ended.wait()
        else:
            await self._write_round()

    async def _write_round(self) -> None:
        """Write every queued snapshot (on a worker thread, after the store's writes asked before)."""
        self._writing, self._queued = self._queued, {}
        try:
            await self.store.off_loop(functools.partial(self._write_all, list(self._writing.values())))
        except sqlite3.Error as exc:
            self._failed(exc)
            for message_id, (msg, snap) in self._writing.items():
                self._queued.setdefault(message_id, (msg, snap))  # tried again unless a newer one is queued
                self._missed(msg)
            self._write_soon()  # (a round another task ran may have seen the queue empty)
        else:
            self._retry_at = -math.inf
            for message_id, (msg, _) in self._writing.items():
                if message_id in self._queued:
                    continue  # a newer snapshot waits for the next round
                if msg.unsaved:
                    log.info("message %s is written to the message store again", msg.id)
                    msg.unsaved = False
                if self._unsaved.pop(message_id, None) is not None:
                    self.written(msg)
        finally:
            self._writing = {}
            self._round_ended.set()
            self._round_ended = trio.Event()

    def _write_all(self, snapshots: list[tuple[LiveMessage, Snapshot]]) -> None:
        """(On the worker thread.)"""
        self.store.update_all([(msg.id, snapshot_fields(snap)) for msg, snap in snapshots])

    def _failed(self, exc: sqlite3.Error) -> None:
        self._retry_at = trio.current_time() + STORE_RETRY_SECONDS
        self._error = exc

    def _missed(self, msg: LiveMessage) -> None:
        """A write of ``msg`` failed or was not tried: it is unsaved (logged the first time)."""
        if not msg.store_failed:
            log.error("the message store failed to write message %s (%s); its stream goes on from its log,"
                      " and its state is written once the store works again", msg.id, self._error)
        msg.unsaved = msg.store_failed = True
