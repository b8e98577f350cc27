"""Per-message stream logs, keyed by message id: the Trio shell around ``RingLog``.

Generation is decoupled from HTTP: the producer (one generation task per
message) appends already-rendered SSE bytes to the message's log, and every
HTTP connection, the first one too, is a reader that tails it
(``logs/reader.py``). A dropped client resumes with ``Last-Event-ID``.

Two small Protocols, so another backend can replace the in-memory one without
touching readers or producers:

* :class:`MessageLog`: what a producer and a reader use.
* :class:`LogStore`: what the hub uses to create and find logs.

What replicas share beyond the logs (a message's state, cancels, idempotency
keys) is the ``logs/cluster.py`` ``Cluster``'s.

In-memory backend: :class:`MemoryLogStore` and :class:`MemoryMessageLog`.
Redis backend (``[stream] backend = "redis"``): ``logs/redis.py``,
built on these: a replica's own logs stay memory logs whose :class:`LogMirror`
copies every entry to a Redis stream, and a log another replica owns is a
memory log filled from that stream.

Ownership (STYLE: one owner per mutable thing). The producer task is the only
writer of a log (``append``/``close``). The store's dict is changed only by
synchronous methods that run on the Trio thread and never await, so no two
tasks can interleave inside one; there are no locks. Readers only read, and
park on a ``trio.Event`` that the log swaps for a fresh one on every append
and on close (a Trio ``Event`` cannot be cleared), so they never poll.

Redis Streams mapping (the backend that can follow, one stream key per message):

=============================  ===================================================
Protocol                       Redis
=============================  ===================================================
``append(data) -> seq``        ``XADD log:{id} MAXLEN ~ ring_max_entries <seq+1>-0
                               d <data>`` -- an explicit id derived from ``seq``
                               (Redis ids must be > 0-0), so Redis itself rejects
                               an out-of-order append. ``append`` stays sync: it
                               puts the entry in a per-worker buffer that a
                               flusher task pipelines every flush interval (one
                               round trip for all streams), as the design note
                               recommends.
``close(state)``               ``XADD`` a terminal marker entry (``s <state>``,
                               no ``d``), then ``EXPIRE log:{id} ttl_seconds``.
                               Key TTL is the expiry, replacing :meth:`expire`.
``wait_for_entries(after)``    ``XREAD BLOCK <ms> STREAMS log:{id} <after+1>-0``;
                               the handle keeps what it fetched in a local
                               window, so ``read_from`` can stay sync and answer
                               from it (``[]`` still means "wait").
``read_from`` ``Gap``          the first id held (``XINFO STREAM`` first-entry or
                               ``XRANGE - + COUNT 1``) is past ``after+1``.
``reader()`` / ``on_idle``     a reader on another replica is reported to the
                               owner (``XADD readers * id <id> d +1|-1``, read by
                               every pump); ``readers`` counts both.
``Cluster.find_message(id)``   ``HMGET msg:{id} <fields>``: the status the owner wrote.
``Cluster.request_cancel(id)`` ``XADD cancel * id <id>``, read by every pump.
``Cluster.delete_message(id)`` ``XADD cancel * id <id> do delete``, read by every
                               pump; then ``EXISTS msg:{id}`` until it is gone.
``Cluster.claim_key``          ``SET idem:{key} [id, hash] NX EX`` in a script that
                               also replaces the holder it is told to replace
                               (compare and set); ``release_key`` deletes it if
                               it still names the holder.
memory cap                     ``maxmemory`` with ``volatile-ttl`` eviction.
``get(id)`` / ``find(id)``     ``get`` answers from what this process holds, so
                               it stays sync; ``find`` (awaitable, used by
                               ``Resume.open_log``) also looks in Redis:
                               ``XRANGE log:{id} - +`` (bounded by MAXLEN), and
                               gives a copy behind a resume's event id a bounded
                               time to catch up (:func:`wait_until_holds`).
=============================  ===================================================
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

import attrs
import trio

from ringserve.config import StreamConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.ringlog import Entry, Gap, LogState, RingLog
from ringserve.logs import heap

__all__ = [
    "LogMirror",
    "LogStore",
    "LogStoreStatistics",
    "MemoryLogStore",
    "MemoryMessageLog",
    "MessageLog",
    "Position",
    "holds",
    "store_unavailable",
    "wait_until_holds",
]


def store_unavailable() -> RingserveError:
    """The error a request gets while the log store cannot reach what it is built on (503, ``Retry-After``)."""
    return RingserveError(ErrorKind.UNAVAILABLE, "the shared stream store (Redis) is unreachable; retry",
                          retry_after=1, retryable=True)


class Position(enum.Enum):
    """Where a resume point (the last seq a reader has; None: none) stands in a log
    (:meth:`MessageLog.position`)."""

    HELD = "held"  # every entry after it is held (or none has come yet)
    LEFT_RING = "left the ring"  # an entry after it was evicted: a Gap
    NEVER_SENT = "never sent"  # it names an entry the log never had


class MessageLog(Protocol):
    """One message's log, as its producer and its readers see it.

    Producer side: :meth:`append` and :meth:`close`. Reader side:
    :meth:`read_from`, :meth:`wait_for_entries`, :meth:`reader`, :meth:`position`.
    The semantics of ``append``/``close``/``read_from`` are ``RingLog``'s
    (``core/ringlog.py``). Its ``on_idle`` (the disconnect policy's hook) is given
    when the log is made (``LogStore.create``).
    """

    message_id: str

    @property
    def next_seq(self) -> int: ...

    @property
    def state(self) -> LogState: ...

    @property
    def closed(self) -> bool: ...

    @property
    def readers(self) -> int: ...

    def append(self, data: bytes) -> int: ...

    def close(self, state: LogState) -> None: ...

    def read_from(self, after: int | None, limit: int | None = None) -> list[Entry] | Gap: ...

    def position(self, after: int | None) -> Position: ...

    async def wait_for_entries(self, after: int | None) -> None: ...

    def reader(self) -> contextlib.AbstractContextManager[None]: ...


class LogStore(Protocol):
    """Creates and finds message logs by message id; expires finished ones.

    ``create``'s ``on_idle`` is called each time the new log's last reader leaves.
    ``available`` is False while what the store is built on cannot be reached
    (new messages get a 503 then).
    """

    def create(self, message_id: str, *, on_idle: Callable[[], None] | None = None) -> MessageLog: ...

    def get(self, message_id: str) -> MessageLog | None: ...

    async def find(self, message_id: str, after: int | None = None) -> MessageLog | None: ...

    @property
    def available(self) -> bool: ...

    def forget(self, message_id: str) -> None: ...

    def statistics(self) -> LogStoreStatistics: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


class LogMirror(Protocol):
    """Told, synchronously, of every append to and the close of a :class:`MemoryMessageLog`.

    The Redis backend's writer (``logs/redis.py``) is one: it queues
    the entry for its next pipelined flush. Neither call may block or raise.
    """

    def appended(self, log: MemoryMessageLog, seq: int, data: bytes) -> None: ...

    def closed(self, log: MemoryMessageLog) -> None: ...


@attrs.define(eq=False)
class MemoryMessageLog:
    """A :class:`RingLog` plus the Trio wake-ups and reader count around it.

    Args:
        message_id: the message this log belongs to.
        ring: the bounded storage.
        clock: seconds, for :attr:`completed_at` (``trio.current_time`` by
            default, so it must run inside Trio).

    Attributes:
        on_idle: called synchronously, with no arguments, each time the reader
            count drops to zero (the last :meth:`reader` block exits),
            whatever the log's state. The app hangs its disconnect policy here
            (abort the generation, or let it run); check :attr:`closed` if a
            finished log does not matter. An exception it raises propagates
            out of the reader's ``with`` block.
        mirror: told of every append and of the close (``None``: nobody).
        on_readers: called synchronously with ``+1``/``-1`` as each
            :meth:`reader` block enters and exits (the Redis backend tells the
            owning replica of readers elsewhere this way).
        completed_at: clock time of :meth:`close`, ``None`` while OPEN.
    """

    message_id: str
    _ring: RingLog
    _clock: Callable[[], float] = attrs.field(default=trio.current_time, kw_only=True)
    on_idle: Callable[[], None] | None = attrs.field(default=None, kw_only=True)
    mirror: LogMirror | None = attrs.field(default=None, kw_only=True)
    on_readers: Callable[[int], None] | None = attrs.field(default=None, kw_only=True)
    completed_at: float | None = attrs.field(default=None, init=False)
    _readers: int = attrs.field(default=0, init=False)
    _remote_readers: int = attrs.field(default=0, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    # Set by MemoryLogStore while the log is in it, for accounting.
    _store: MemoryLogStore | None = attrs.field(default=None, init=False, repr=False)

    # -- views --------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._ring.next_seq

    @property
    def first_seq(self) -> int:
        return self._ring.first_seq

    @property
    def entry_count(self) -> int:
        return self._ring.entry_count

    @property
    def nbytes(self) -> int:
        return self._ring.nbytes

    @property
    def state(self) -> LogState:
        return self._ring.state

    @property
    def closed(self) -> bool:
        return self._ring.closed

    @property
    def readers(self) -> int:
        """How many :meth:`reader` blocks are open now, plus the readers other replicas reported."""
        return self._readers + self._remote_readers

    def remote_readers_changed(self, delta: int) -> None:
        """Readers of this log on other replicas came (``+1``) or went (``-1``).

        They count in :attr:`readers`; when that drops to zero this way,
        :attr:`on_idle` is called as for a local reader.
        """
        self._remote_readers += delta
        if delta < 0 and self.readers == 0 and self.on_idle is not None:
            self.on_idle()

    # -- producer -----------------------------------------------------------

    def append(self, data: bytes) -> int:
        """Append one rendered SSE event and wake every parked reader.

        Returns:
            Its sequence number (see ``RingLog.append``).

        Raises:
            LogStateError: the log is closed.
        """
        started = time.perf_counter()
        before = self._ring.nbytes
        seq = self._ring.append(data)
        self._wake()
        if self.mirror is not None:
            self.mirror.appended(self, seq, data)
        if self._store is not None:
            self._store._appended(
                self, self._ring.nbytes - before, len(data), time.perf_counter() - started
            )
        return seq

    def close(self, state: LogState) -> None:
        """Finish (FINISHED) or fail (FAILED) the log and wake every reader.

        Readers still get every entry held, then end. Starts the TTL clock.

        Raises:
            LogStateError: not OPEN.
        """
        self._ring.close(state)
        self.completed_at = self._clock()
        self._wake()
        if self.mirror is not None:
            self.mirror.closed(self)
        if self._store is not None:
            self._store._closed(self)

    def skip_to(self, seq: int) -> None:
        """Drop the entries held and go on at ``seq`` (``RingLog.skip_to``), waking every reader.

        Only for a copy of a log held elsewhere (``logs/redis.py``) whose
        older entries are gone there.
        """
        self._ring.skip_to(seq)
        self._wake()

    def _wake(self) -> None:
        # A trio.Event fires once and cannot be cleared: set the current one
        # and swap in a fresh one for the next wait.
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    # -- readers ------------------------------------------------------------

    def read_from(self, after: int | None, limit: int | None = None) -> list[Entry] | Gap:
        """See ``RingLog.read_from``: entries, ``[]`` (not yet) or a ``Gap``."""
        return self._ring.read_from(after, limit)

    def position(self, after: int | None) -> Position:
        """Whether the entries after ``after`` are all held, one left the ring, or ``after`` was never sent."""
        try:
            held = self._ring.read_from(after, 0)
        except ValueError:
            return Position.NEVER_SENT
        return Position.LEFT_RING if isinstance(held, Gap) else Position.HELD

    async def wait_for_entries(self, after: int | None) -> None:
        """Park until there is an entry after ``after``, or the log is closed.

        Returns at once (after a checkpoint) if that already holds. It does
        not say which: call :meth:`read_from` next. An entry that was appended
        and evicted while parked still wakes the reader (``read_from`` then
        gives a ``Gap``).

        Args:
            after: the last sequence number delivered (``None``: none yet).

        Raises:
            ValueError: ``after >= next_seq`` (an id from the future).

        Cancellation: safe; the log is not changed by waiting.
        """
        last = -1 if after is None else after
        if last >= self._ring.next_seq:
            raise ValueError(f"sequence number {last} is from the future")
        if self._ring.closed or self._ring.next_seq > last + 1:
            await trio.lowlevel.checkpoint()
            return
        while not (self._ring.closed or self._ring.next_seq > last + 1):
            await self._changed.wait()

    @contextlib.contextmanager
    def reader(self) -> Iterator[None]:
        """Count the caller as a reader for the ``with`` block (sync enter/exit).

        When the block exits and no reader is left, :attr:`on_idle` is called.
        Exiting is synchronous, so a cancelled reader still leaves at once.
        """
        self._readers += 1
        if self.on_readers is not None:
            self.on_readers(1)
        try:
            yield
        finally:
            self._readers -= 1
            if self.on_readers is not None:
                self.on_readers(-1)
            if self.readers == 0 and self.on_idle is not None:
                self.on_idle()


def holds(log: MessageLog, after: int | None) -> bool:
    """Whether ``log`` has got as far as ``after`` (the last seq a reader saw), or never will.

    False only while ``log`` is OPEN and ``after >= next_seq``: a copy of a log
    written elsewhere may still receive that entry (its owner sent it to a
    reader before the entry reached this copy).
    """
    return after is None or log.closed or after < log.next_seq


async def wait_until_holds(log: MessageLog, after: int | None, seconds: float) -> bool:
    """Park until :func:`holds` is true of ``log`` or ``seconds`` have passed; return :func:`holds`.

    Returns at once (after a checkpoint) when it already holds. Woken by the
    log's appends and close (``wait_for_entries``), so it never polls.

    Cancellation: safe; the log is not changed by waiting.
    """
    if holds(log, after):
        await trio.lowlevel.checkpoint()
        return True
    with trio.move_on_after(seconds):
        while not holds(log, after):
            await log.wait_for_entries(log.next_seq - 1 if log.next_seq else None)
    return holds(log, after)


@attrs.frozen
class LogStoreStatistics:
    """A snapshot of the store, for ``metrics.py``.

    Attributes:
        logs: logs held (live and completed).
        live_logs: logs still OPEN.
        readers: reader blocks open, over all held logs.
        entries: entries held, over all held logs.
        bytes: entry bytes held, over all held logs.
        memory_cap_bytes: the cap (``StreamConfig.memory_cap_bytes``).
        appends_total: appends ever made to logs while in this store.
        append_bytes_total: bytes appended, ever.
        entries_evicted_total: entries that left a ring because it was full
            (a lagging reader of such a log gets a ``Gap``).
        evictions_total: completed logs dropped to get under the memory cap.
        expirations_total: completed logs dropped for age (``ttl_seconds``).
        append_seconds_total: wall seconds spent in appends (sum; with
            ``appends_total`` gives the mean append latency).
        last_append_seconds: wall seconds of the latest append.
    """

    logs: int
    live_logs: int
    readers: int
    entries: int
    bytes: int
    memory_cap_bytes: int
    appends_total: int
    append_bytes_total: int
    entries_evicted_total: int
    evictions_total: int
    expirations_total: int
    append_seconds_total: float
    last_append_seconds: float


@attrs.define(eq=False)
class MemoryLogStore:
    """In-memory :class:`LogStore`: one :class:`MemoryMessageLog` per message id.

    * Each log's ring is bounded by ``ring_max_entries``/``ring_max_bytes``.
    * A global cap, ``memory_cap_bytes``: whenever the bytes held go over it
      (checked on every append and close), completed logs are dropped, oldest
      completed first, until it is met again. Live (OPEN) logs are never
      dropped, so the total can stay over the cap while only live logs remain;
      each of those is still bounded by its own ring.
    * Completed logs expire ``ttl_seconds`` after their close: :meth:`run`
      sweeps (every ``min(ttl, 1)`` s, at least 0.1 s), and :meth:`get`
      never returns one past its TTL even between sweeps.
    * Dropping a log removes it from the store only: a reader already holding
      it reads on to the end, and the memory is freed when that reader lets
      go.
    * While no log is live, :meth:`run` gives the memory freed back to the
      system (``trim``, ``logs/heap.py``) once ``heap.TRIM_AFTER_BYTES`` of
      entries were let go of since the last time.
    * :meth:`evicted` remembers which ids the store held and let go of
      within the last ``ttl_seconds`` (at most ``remember_gone`` of them), so
      the app can tell 410 Gone from 404: ``logs/redis.py`` does not look in
      Redis for a log this replica let go of, whose Redis stream expires at
      most ``ttl_seconds`` later (its TTL started at its close). So they are
      as many as the messages of a TTL, not of the process's life.

    Args:
        config: ring bounds, memory cap and TTL.
        clock: seconds; ``trio.current_time`` by default.
        remember_gone: the most gone ids :meth:`evicted` remembers.
        trim: gives the memory freed back to the system, called on a worker thread
            (``heap.malloc_trim()``: glibc's ``malloc_trim(0)``); None: never.
    """

    config: StreamConfig
    clock: Callable[[], float] = trio.current_time
    remember_gone: int = 100_000
    trim: Callable[[], object] | None = attrs.field(factory=heap.malloc_trim, kw_only=True)
    _released_at_trim: int = attrs.field(default=0, init=False)  # entry bytes let go of, at the last trim
    _logs: dict[str, MemoryMessageLog] = attrs.field(factory=dict, init=False)
    # Completed logs in the order they completed (clock is monotonic), oldest first.
    _completed: OrderedDict[str, MemoryMessageLog] = attrs.field(factory=OrderedDict, init=False)
    _gone: OrderedDict[str, float] = attrs.field(factory=OrderedDict, init=False, repr=False)  # id -> when
    _bytes: int = attrs.field(default=0, init=False)
    _appends_total: int = attrs.field(default=0, init=False)
    _append_bytes_total: int = attrs.field(default=0, init=False)
    _entries_evicted_gone: int = attrs.field(default=0, init=False)
    _evictions_total: int = attrs.field(default=0, init=False)
    _expirations_total: int = attrs.field(default=0, init=False)
    _append_seconds_total: float = attrs.field(default=0.0, init=False)
    _last_append_seconds: float = attrs.field(default=0.0, init=False)

    # -- LogStore -----------------------------------------------------------

    def create(self, message_id: str, *, on_idle: Callable[[], None] | None = None) -> MemoryMessageLog:
        """A new, empty, OPEN log for ``message_id`` (``on_idle``: its :attr:`MemoryMessageLog.on_idle`).

        Raises:
            ValueError: the store already holds a log with that id.
        """
        if message_id in self._logs:
            raise ValueError(f"a stream log for message {message_id!r} already exists")
        ring = RingLog(self.config.ring_max_entries, self.config.ring_max_bytes)
        log = MemoryMessageLog(message_id, ring, clock=self.clock, on_idle=on_idle)
        log._store = self
        self._logs[message_id] = log
        self._gone.pop(message_id, None)
        return log

    def get(self, message_id: str) -> MemoryMessageLog | None:
        """The log for ``message_id``, or ``None`` (never held, or gone:
        see :meth:`evicted`). A completed log past its TTL is expired here."""
        log = self._logs.get(message_id)
        if log is not None and self._is_expired(log, self.clock()):
            self._drop(log)
            self._expirations_total += 1
            return None
        return log

    async def find(self, message_id: str, after: int | None = None) -> MemoryMessageLog | None:
        """:meth:`get`, after a checkpoint: this store holds only this process's logs.

        ``after`` (the seq a resume names) is not waited for: a log written
        here holds every entry ever sent of it, so one past its end was never
        sent (``read_from`` raises ``ValueError`` at once).
        """
        await trio.lowlevel.checkpoint()
        return self.get(message_id)

    @property
    def available(self) -> bool:
        """Always True: nothing outside this process is needed."""
        return True

    def forget(self, message_id: str) -> None:
        """Drop a log now, live or not (no-op if not held).

        The id then counts as gone for :meth:`evicted`. A live log's producer
        may keep appending to its handle; the store no longer accounts for it.
        """
        log = self._logs.get(message_id)
        if log is not None:
            self._drop(log)

    def evicted(self, message_id: str) -> bool:
        """Whether this store held ``message_id`` and has let it go (expired, evicted for memory,
        or forgotten) less than ``ttl_seconds`` ago: 410 Gone rather than 404."""
        gone = self._gone.get(message_id)
        return gone is not None and self.clock() - gone < self.config.ttl_seconds

    def expire(self) -> int:
        """Drop every completed log older than ``ttl_seconds``, and forget the ids gone longer ago
        than that (:meth:`evicted`).

        Returns:
            How many were dropped.
        """
        now = self.clock()
        while self._gone and now - next(iter(self._gone.values())) >= self.config.ttl_seconds:
            self._gone.popitem(last=False)
        dropped = 0
        while self._completed:
            log = next(iter(self._completed.values()))
            if not self._is_expired(log, now):
                break  # completion order: the rest are younger
            self._drop(log)
            dropped += 1
        self._expirations_total += dropped
        return dropped

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The TTL sweep loop, and the memory's return; start it in the server nursery. Never returns.

        Calls ``task_status.started()`` once running. Cancellation: safe at
        any point (each sweep is synchronous; a trim on its way ends first).
        """
        interval = min(max(self.config.ttl_seconds, 0.1), 1.0)
        task_status.started()
        while True:
            self.expire()
            await self._trim_when_idle()
            await trio.sleep(interval)

    async def _trim_when_idle(self) -> None:
        """``trim`` on a worker thread while no log is live, once ``heap.TRIM_AFTER_BYTES`` of
        entries were let go of (left a ring, expired, evicted, forgotten) since the last trim."""
        released = self._append_bytes_total - self._bytes
        live = len(self._logs) - len(self._completed)
        if self.trim is None or live or released - self._released_at_trim < heap.TRIM_AFTER_BYTES:
            return
        self._released_at_trim = released
        await trio.to_thread.run_sync(self.trim)

    def statistics(self) -> LogStoreStatistics:
        """A frozen snapshot (O(number of logs))."""
        logs = self._logs.values()
        return LogStoreStatistics(
            logs=len(self._logs),
            live_logs=len(self._logs) - len(self._completed),
            readers=sum(log.readers for log in logs),
            entries=sum(log.entry_count for log in logs),
            bytes=self._bytes,
            memory_cap_bytes=self.config.memory_cap_bytes,
            appends_total=self._appends_total,
            append_bytes_total=self._append_bytes_total,
            entries_evicted_total=self._entries_evicted_gone
            + sum(log._ring.evicted_total for log in logs),
            evictions_total=self._evictions_total,
            expirations_total=self._expirations_total,
            append_seconds_total=self._append_seconds_total,
            last_append_seconds=self._last_append_seconds,
        )

    # -- accounting (called by MemoryMessageLog) ------------------------------

    def _appended(self, log: MemoryMessageLog, delta_bytes: int, size: int, seconds: float) -> None:
        self._bytes += delta_bytes
        self._appends_total += 1
        self._append_bytes_total += size
        self._append_seconds_total += seconds
        self._last_append_seconds = seconds
        self._enforce_cap()

    def _closed(self, log: MemoryMessageLog) -> None:
        self._completed[log.message_id] = log
        self._enforce_cap()

    # -- internals ------------------------------------------------------------

    def _is_expired(self, log: MemoryMessageLog, now: float) -> bool:
        return log.completed_at is not None and now - log.completed_at >= self.config.ttl_seconds

    def _enforce_cap(self) -> None:
        while self._bytes > self.config.memory_cap_bytes and self._completed:
            self._drop(next(iter(self._completed.values())))
            self._evictions_total += 1

    def _drop(self, log: MemoryMessageLog) -> None:
        del self._logs[log.message_id]
        self._completed.pop(log.message_id, None)
        self._bytes -= log.nbytes
        self._entries_evicted_gone += log._ring.evicted_total
        log._store = None
        self._gone[log.message_id] = self.clock()
        self._gone.move_to_end(log.message_id)
        while len(self._gone) > self.remember_gone:
            self._gone.popitem(last=False)
