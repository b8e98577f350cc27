"""Writing the live messages' states to the store, and going on when a write fails.

A write the store fails (``sqlite3.Error``: a full disk, an I/O error, a lock
held past ``busy_timeout``) leaves the generation and its log going: its message
is marked ``unsaved`` and, once it ended, kept in memory (answered from there)
until :meth:`Persister.save_unsaved` has written its final state.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Callable

import attrs
import trio

from ringserve.core.producer import Snapshot
from ringserve.live.message import LiveMessage
from ringserve.store.sqlite import MessageStore, snapshot_fields, store_failed

log = logging.getLogger("ringserve.hub")

#: Seconds between two tries to write the final state of ended messages whose last store write
#: failed (``Persister.save_unsaved``); no other write is tried in between.
STORE_RETRY_SECONDS = 1.0


@attrs.define(eq=False)
class Persister:
    """The store writes of the live messages, with a back-off after a failure.

    Args:
        store: the durable message store.
        nursery: where the retries of unsaved messages run.
        written: called with an ended message once its final state is in the store (it leaves
            the hub then).
    """

    store: MessageStore
    nursery: trio.Nursery
    written: Callable[[LiveMessage], None]
    _retry_at: float = attrs.field(default=-math.inf, init=False)  # no write is tried before (trio clock)
    _error: sqlite3.Error | None = attrs.field(default=None, init=False)  # the last failed write's
    _unsaved: dict[str, LiveMessage] = attrs.field(factory=dict, init=False)

    @property
    def unsaved(self) -> int:
        """Ended messages whose final state the store failed to write (:meth:`save_unsaved` retries)."""
        return len(self._unsaved)

    def check_new(self) -> None:
        """Refuse a new message while the store's writes are not tried (a new row's write is not
        tried either: see :meth:`write`).

        Raises:
            RingserveError: ``UNAVAILABLE``: a write failed less than :data:`STORE_RETRY_SECONDS` ago.
        """
        if self._error is not None and trio.current_time() < self._retry_at:
            raise store_failed(self._error)

    def write(self, msg: LiveMessage, snap: Snapshot, *, probe: bool = False) -> None:
        """Write ``snap`` to the store.

        After a failed write no other is tried for :data:`STORE_RETRY_SECONDS` (a locked store
        holds the event loop for its ``busy_timeout``, a second, at each write), except a
        ``probe`` (:meth:`save_unsaved`); a snapshot not tried leaves its message unsaved like
        one that failed. The first failed or untried write of a message is logged (once, not
        per snapshot; the store counts each failure in ``StoreStatistics.write_failures_total``).
        A later snapshot holds the whole state, so it makes up for the missed ones.
        """
        if probe or trio.current_time() >= self._retry_at:
            try:
                self.store.update(msg.id, **snapshot_fields(snap))
            except sqlite3.Error as exc:
                self._retry_at = trio.current_time() + STORE_RETRY_SECONDS
                self._error = exc
            else:
                self._retry_at = -math.inf
                if msg.unsaved:
                    log.info("message %s is written to the message store again", msg.id)
                msg.unsaved = False
                return
        if not msg.store_failed:
            log.error("the message store failed to write message %s (%s); its stream goes on from its log,"
                      " and its state is written once the store works again", msg.id, self._error)
        msg.unsaved = msg.store_failed = True

    def ended(self, msg: LiveMessage) -> None:
        """``msg`` ended: it is ``written`` now, or once :meth:`save_unsaved` has written it."""
        if not msg.unsaved:
            self.written(msg)
            return
        if not self._unsaved:
            self.nursery.start_soon(self._save_later)
        self._unsaved[msg.id] = msg

    async def _save_later(self) -> None:
        """Every :data:`STORE_RETRY_SECONDS`, :meth:`save_unsaved`, until every message is written.
        Cancelled with the server, which calls :meth:`save_unsaved` once more after the drain."""
        while self._unsaved:
            await trio.sleep(STORE_RETRY_SECONDS)
            self.save_unsaved()

    def save_unsaved(self) -> int:
        """Write again the final state of each ended message whose last write failed; those written
        are ``written``. Returns how many are still unsaved (a message the server stops with is
        ``generating`` in the store, which the next start marks ``interrupted``)."""
        for msg in list(self._unsaved.values()):
            self.write(msg, msg.snapshot(), probe=True)
            if msg.unsaved:
                break  # the store still fails: the others wait for the next round
            del self._unsaved[msg.id]
            self.written(msg)
        return len(self._unsaved)
