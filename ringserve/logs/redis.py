"""Redis Streams backend of the stream log (``[stream] backend = "redis"``): any replica resumes any stream.

One Redis stream per message, ``ringserve:log:{message_id}``; entry ``seq`` has
the explicit id ``<seq+1>-0`` (Redis ids must be > ``0-0``) and one field
``d`` (the rendered SSE bytes, exactly as appended); after the last entry the
owner adds a terminal marker with the next id and one field ``s`` (the
``LogState`` value: ``finished``/``failed``), then ``EXPIRE``\\ s the key.
The table in ``logs/memory.py`` maps the rest.

Who holds what (one replica = one ringserve process):

* **Owned logs** (this replica runs the generation): a plain
  :class:`~ringserve.logs.memory.MemoryMessageLog` in a local
  :class:`~ringserve.logs.memory.MemoryLogStore`, so the producer and the
  readers on this replica work exactly as with the memory backend (no Redis
  round trip on their path). Its :class:`_Writer` mirror queues every entry;
  a flusher task sends everything queued, for every stream, in one pipelined
  round trip (``XADD ... MAXLEN ~ ring_max_entries``, then ``EXPIRE``), at
  most once per ``flush_ms`` and never more than one round trip in flight.
* **Remote logs** (another replica owns it): :meth:`RedisLogStore.find` loads
  the whole stream (``XRANGE``; bounded by MAXLEN) into a fresh memory log,
  and while it is open one **pump** task per replica tails every such stream
  with a single ``XREAD BLOCK`` over all of them, appending what arrives, so
  any number of readers of any number of messages share one connection.
  A pump that finds entries missing (trimmed by MAXLEN before it read them)
  skips ahead (``RingLog.skip_to``): the readers behind get a ``Gap``, as
  with an evicted entry.

Connections: :data:`WRITER_CONNECTIONS` for appends and loads plus one for the
pump, whatever the number of readers or messages. A blocking ``XREAD`` is
never cancelled during normal running (a cancelled one leaves coredis's
connection busy until the block ends): the pump is woken for a new stream by
an ``XADD`` to its own wake stream, ``ringserve:wake:{replica}``, and blocks at
most :data:`PUMP_BLOCK_MS`. A read that fails (Redis gone, or stalled and
cancelled) may leave that connection busy for good, so the pump then drops its
client and retries on a fresh one, waiting :data:`RETRY_SECONDS` doubling up
to :data:`MAX_RETRY_SECONDS` between tries while Redis stays down.

Client: coredis (``pip install 'ringserve[redis]'``), which runs on Trio
through anyio; redis-py's asyncio client does not.

Message state: :class:`MirroredMessageStore` copies every write of the
owner's SQLite store to a hash ``ringserve:msg:{id}`` in the same pipeline,
which :meth:`RedisCluster.find_message` reads on any replica. An update is
written only into a hash that was written whole; one that is gone (a Redis
restart, an eviction) is written whole again from the owner's row at the next
flush (:data:`_WRITE_STATUS`), so a hash never lacks a field. Cancel:
:meth:`RedisCluster.request_cancel` adds the id to :data:`CANCEL_STREAM`,
which every replica's pump reads; the owner calls its ``on_cancel``. Delete:
:meth:`RedisCluster.delete_message` adds it there as a delete; the replica
whose store has the row calls its ``on_delete``, which deletes the row, and
the hash and the stream at its next flush.

Reader counts: each reader of a remote copy entering and leaving is queued
(``+1``/``-1``) for :data:`READERS_STREAM`, which the owner's pump adds to
the log's :attr:`~ringserve.logs.memory.MemoryMessageLog.readers`, so the
abort policy (after ``grace_seconds``) sees readers on every replica.

Owner lease: each pump renews ``ringserve:replica:{replica}`` (:data:`LEASE_MS`);
a replica tailing a stream whose owner's lease lapsed writes the surface's
retryable in-band error (its ``on_owner_lost``: ``live/resume.py``
``owner_lost_entries``) and the end into the stream, and ``interrupted`` into
the status, in one Lua script that does nothing if the stream moved on meanwhile.

Idempotency keys: :meth:`RedisCluster.claim_key` makes a key name one
message on every replica (``ringserve:idem:{key}``, set only if absent or
still naming the message being replaced), so two first attempts on two
replicas make one generation; ``Hub.create`` follows the key to the message
it names.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import secrets
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import assert_never

import anyio
import attrs
import coredis
import coredis.exceptions
import trio
from coredis.tokens import PureToken

from ringserve.config import StreamConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.ringlog import LogState, RingLog
from ringserve.core.status import OWNER_LOST_MESSAGE
from ringserve.logs.cluster import KeyHolder
from ringserve.logs.memory import (
    LogStoreStatistics,
    MemoryLogStore,
    MemoryMessageLog,
    holds,
    store_unavailable,
    wait_until_holds,
)
from ringserve.store.sqlite import MessageStore, StoredMessage

__all__ = [
    "CANCEL_STREAM",
    "CATCH_UP_SECONDS",
    "IDEMPOTENCY_PREFIX",
    "KEY_PREFIX",
    "LIVE_KEY_SECONDS",
    "MESSAGE_KEY_SECONDS",
    "MESSAGE_PREFIX",
    "PUMP_BLOCK_MS",
    "WRITER_CONNECTIONS",
    "MirroredMessageStore",
    "RedisCluster",
    "RedisLogStore",
    "stream_key",
]

log = logging.getLogger("ringserve")

#: Prefix of every message's stream key.
KEY_PREFIX = "ringserve:log:"
#: Seconds a live stream's key lives past its latest flush (each flush renews it): what an owner
#: killed mid-generation leaves behind is gone after this.
LIVE_KEY_SECONDS = 3600
#: Prefix of every message's status hash (the :class:`~ringserve.store.sqlite.StoredMessage` fields but
#: ``request``, each JSON-encoded), written by the owner at each store write.
MESSAGE_PREFIX = "ringserve:msg:"
#: Seconds a status hash lives past its latest write (SQLite on the owner keeps the row for good).
MESSAGE_KEY_SECONDS = 86400
#: The stream every replica's pump reads: cancel requests (field ``id``), acted on by the owner, and
#: delete requests (fields ``id`` and ``do``: ``delete``), acted on by the replica whose store has it.
CANCEL_STREAM = "ringserve:cancel"
#: The longest :meth:`RedisCluster.delete_message` waits for the message's replica to delete it, in
#: seconds, and how often it looks.
DELETE_WAIT_SECONDS = 10.0
DELETE_POLL_SECONDS = 0.02
#: The stream every replica's pump reads: readers of a message coming and going on a replica
#: (fields ``id`` and ``d``, ``+1``/``-1``), counted by the owner.
READERS_STREAM = "ringserve:readers"
#: The most entries kept in :data:`CANCEL_STREAM` and :data:`READERS_STREAM` (MAXLEN ~).
CANCEL_STREAM_MAXLEN = 10_000
#: Prefix of each replica's liveness key, renewed by its pump (``SET ... PX LEASE_MS``).
REPLICA_PREFIX = "ringserve:replica:"
#: Milliseconds a replica's lease lasts; its pump renews it about every second. A replica that
#: tails a stream whose owner's lease has lapsed ends the stream for everyone (see ``_take_over``).
LEASE_MS = 5000
#: Ends a stream whose owner is gone: appends the given entries (ARGV[3..]) and the terminal marker
#: at the ids after ARGV[1] (the last id the caller holds), only if that is still the stream's last
#: id (else the owner, or another replica, wrote meanwhile: nothing is done); then EXPIRE ARGV[2] and
#: the status hash KEYS[2], if it exists, gets status "interrupted" and the error ARGV[#ARGV] (JSON).
#: Returns 1 or 0.
_TAKE_OVER = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 or last[1][1] ~= ARGV[1] then return 0 end
local seq = tonumber(string.match(ARGV[1], '^(%d+)-'))
for i = 3, #ARGV - 1 do
    seq = seq + 1
    redis.call('XADD', KEYS[1], seq .. '-0', 'd', ARGV[i])
end
redis.call('XADD', KEYS[1], (seq + 1) .. '-0', 's', 'failed')
redis.call('EXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('HSET', KEYS[2], 'status', '"interrupted"', 'error', ARGV[#ARGV])
end
return 1
"""
#: Writes a status hash KEYS[1]: the field-value pairs ARGV[3..] (HSET), then EXPIRE ARGV[2]. With
#: ARGV[1] '0' (the fields an update changed) only into a hash that was written whole (it holds
#: the message's ``id``): returns 0 and writes nothing when there is none (Redis restarted, or
#: evicted it) or only a part of one (an owner of an older version wrote only what changed into
#: a hash a restart had taken), else 1.
_WRITE_STATUS = """
if ARGV[1] == '0' and redis.call('HEXISTS', KEYS[1], 'id') == 0 then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
#: Prefix of each ``Idempotency-Key``'s claim (the key as ``Hub.create`` spells it, with its surface):
#: the JSON ``[message id, request hash]`` of the message it names on every replica.
IDEMPOTENCY_PREFIX = "ringserve:idem:"
#: Claims KEYS[1] for the holder ARGV[1] for ARGV[3] seconds unless it names another holder, one
#: other than the message id ARGV[2] (the one being replaced; '' for none). Returns the holder it
#: names instead, or nil once it names ARGV[1].
_CLAIM = """
local current = redis.call('GET', KEYS[1])
if current and (ARGV[2] == '' or cjson.decode(current)[1] ~= ARGV[2]) then return current end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return false
"""
#: Deletes KEYS[1] if it still names the holder ARGV[1].
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
#: The longest one pump XREAD blocks, in milliseconds (it is woken early for a new stream).
PUMP_BLOCK_MS = 1000
#: Seconds past its expected end after which the pump gives up on a Redis call (and counts Redis
#: as down).
STALL_SECONDS = 2.0
#: The most entries the pump takes from one stream per XREAD.
PUMP_BATCH = 256
#: Connections of the writer pool (appends, loads, wake-ups); the pump has one more of its own.
WRITER_CONNECTIONS = 4
#: Seconds the flusher and the pump wait before retrying after Redis failed (the pump doubles it
#: at each failure in a row, up to :data:`MAX_RETRY_SECONDS`).
RETRY_SECONDS = 0.5
#: The longest the pump waits between two tries while Redis stays down: it is back within about
#: this much of Redis.
MAX_RETRY_SECONDS = 4.0
#: Seconds, beyond two flush intervals, that :meth:`RedisLogStore.find` waits before looking again
#: for a stream it did not find: a client may resume elsewhere before its message's first flush.
MISS_RETRY_SECONDS = 0.05
#: Seconds, beyond two flush intervals, that :meth:`RedisLogStore.find` gives a copy of another
#: replica's stream to reach the event id a resume names: the owner's flush round trip and this
#: pump's read, with room for a loaded host. Only an id that was never sent waits it all out.
CATCH_UP_SECONDS = 0.5
#: The most queued writes held while Redis is unreachable (beyond, the oldest are dropped: a
#: remote reader then sees a gap).
MAX_PENDING_OPS = 100_000

_DATA, _STATE = b"d", b"s"
# A connection that breaks mid-command surfaces as anyio's resource errors.
_REDIS_ERRORS = (coredis.exceptions.RedisError, OSError, anyio.ClosedResourceError, anyio.BrokenResourceError)


def stream_key(message_id: str) -> str:
    """The Redis key of ``message_id``'s stream."""
    return KEY_PREFIX + message_id


def _entry_id(seq: int) -> str:
    return f"{seq + 1}-0"


def _entry_seq(identifier: bytes | str) -> int:
    text = identifier.decode() if isinstance(identifier, bytes) else identifier
    return int(text.split("-", 1)[0]) - 1


@attrs.frozen
class _Append:
    key: str
    seq: int
    data: bytes


@attrs.frozen
class _Close:
    key: str
    seq: int  # the marker's: the log's next_seq at close
    state: LogState


@attrs.frozen
class _Readers:
    message_id: str
    delta: int


@attrs.frozen
class _Status:
    key: str
    fields: dict[str, str]  # StoredMessage field -> JSON
    # None: ``fields`` are all the hash holds (an insert), written whatever the key holds. Else
    # they are the fields an update changed, written only into a hash that exists, and ``whole``
    # gives all of them (the owner's row now; None once the row is gone) when it does not.
    whole: Callable[[], dict[str, str] | None] | None = None


@attrs.frozen
class _Delete:
    message_id: str


#: What the flusher sends: an entry, a log's end, a reader count, a status write, a deletion.
_Op = _Append | _Close | _Readers | _Status | _Delete


def _encoded(fields: dict[str, object]) -> dict[str, str]:
    return {name: json.dumps(value) for name, value in fields.items()}


@attrs.define
class _PumpCursors:
    """Where the pump is in the streams every replica reads (entry ids), kept across its clients."""

    cancel: str
    readers: str
    wake: str = "0-0"
    read: bool = False  # an XREAD succeeded on the current client


@attrs.define(eq=False)
class _Writer:
    """The owned logs' :class:`~ringserve.logs.memory.LogMirror`: queues each append and close."""

    pending: list[_Op] = attrs.Factory(list)
    wanted: trio.Event = attrs.Factory(trio.Event)

    def appended(self, log_: MemoryMessageLog, seq: int, data: bytes) -> None:
        self._queue(_Append(stream_key(log_.message_id), seq, data))

    def closed(self, log_: MemoryMessageLog) -> None:
        self._queue(_Close(stream_key(log_.message_id), log_.next_seq, log_.state))

    def status(self, message_id: str, fields: dict[str, object],
               whole: Callable[[], dict[str, object] | None] | None = None) -> None:
        """Write ``fields`` to the message's status hash: all of them (``whole`` None), or the ones
        an update changed, into a hash written whole; a hash that is gone (Redis restarted, or
        evicted it), or was only partly written, is written whole again from ``whole()``, so it
        never lacks a field for long."""

        def whole_encoded() -> dict[str, str] | None:
            assert whole is not None
            got = whole()
            return None if got is None else _encoded(got)

        self._queue(_Status(MESSAGE_PREFIX + message_id, _encoded(fields), None if whole is None else whole_encoded))

    def deleted(self, message_id: str) -> None:
        """Delete the message's status hash and stream (after every write queued before)."""
        self._queue(_Delete(message_id))

    def readers(self, message_id: str, delta: int) -> None:
        self._queue(_Readers(message_id, delta))

    def _queue(self, op: _Op) -> None:
        self.pending.append(op)
        self.wanted.set()

    def again_first(self, ops: list[_Op]) -> None:
        """Send ``ops`` before everything queued (at the next flush)."""
        self.pending[:0] = ops
        self.wanted.set()

    def take(self) -> list[_Op]:
        ops, self.pending = self.pending, []
        self.wanted = trio.Event()
        return ops


@contextlib.contextmanager
def _unavailable_if_down() -> Iterator[None]:
    """A Redis failure on a request's path becomes a retryable 503 in the surface's shape."""
    try:
        yield
    except _REDIS_ERRORS as exc:
        log.warning("redis: %r", exc)
        raise store_unavailable() from None


#: The fields of :class:`~ringserve.store.sqlite.StoredMessage`, which a status hash holds (``request``
#: only for a surface whose messages a later request continues), and those it cannot be without.
_STATE_FIELDS = tuple(field.name for field in attrs.fields(StoredMessage))
_REQUIRED_FIELDS = frozenset(field.name for field in attrs.fields(StoredMessage) if field.default is attrs.NOTHING)


def _holder_json(holder: KeyHolder) -> str:
    return json.dumps([holder.message_id, holder.request_hash])


def _deliver(log_: MemoryMessageLog, identifier: bytes, fields: dict[bytes, bytes]) -> None:
    """Apply one stream entry to a remote log's copy (sync)."""
    seq = _entry_seq(identifier)
    if seq < log_.next_seq or log_.closed:
        return  # already held (a load and the pump may overlap)
    if seq > log_.next_seq:
        log_.skip_to(seq)  # trimmed before we read it: readers behind get a Gap
    if _STATE in fields:
        log_.close(LogState(fields[_STATE].decode()))
    else:
        log_.append(fields[_DATA])


@attrs.define(eq=False)
class RedisLogStore:
    """A :class:`~ringserve.logs.memory.LogStore` whose logs are Redis streams too (see the module docstring).

    Args:
        config: ring bounds, memory cap, TTL and flush interval (``flush_ms``).
        url: the Redis server (``StreamConfig.redis_url_from``).
        on_cancel: called with a message id when any replica asks for the cancel of a message
            this one owns (the hub cancels it).
        on_delete: called with a message id when any replica asks for its deletion (the hub
            deletes it if its store has it).
        on_owner_lost: renders the in-band error that ends a stream whose owner died: called
            with the message's shared state and the seq of the first entry to write; returns
            those entries' SSE bytes (``live/resume.py`` ``owner_lost_entries``).
        clock: seconds; ``trio.current_time`` by default.
        replica: this replica's name in Redis (random).

    :meth:`run` must be running (it holds the connections) before any other
    awaitable method is called.
    """

    config: StreamConfig
    url: str
    on_cancel: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)
    on_delete: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)
    on_owner_lost: Callable[[StoredMessage, int], list[bytes]] | None = attrs.field(default=None, kw_only=True)
    clock: Callable[[], float] = attrs.field(default=trio.current_time, kw_only=True)
    replica: str = attrs.field(factory=lambda: secrets.token_hex(8), kw_only=True)
    local: MemoryLogStore = attrs.field(init=False)
    _writer: _Writer = attrs.field(factory=_Writer, init=False)
    _remote: dict[str, MemoryMessageLog] = attrs.field(factory=dict, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _down_since: float | None = attrs.field(default=None, init=False)
    _pump_blocked: bool = attrs.field(default=False, init=False)
    _client: coredis.Redis[bytes] = attrs.field(init=False)
    round_trips_total: int = attrs.field(default=0, init=False)
    _owners: dict[str, str] = attrs.field(factory=dict, init=False)  # remote copy -> its owner replica
    _waiting: dict[str, int] = attrs.field(factory=dict, init=False)  # remote copy -> finds waiting on it

    def __attrs_post_init__(self) -> None:
        self.local = MemoryLogStore(self.config, self.clock)
        self._client = coredis.Redis.from_url(self.url, max_connections=WRITER_CONNECTIONS)

    @property
    def _wake_key(self) -> str:
        return f"ringserve:wake:{self.replica}"

    @property
    def client(self) -> coredis.Redis[bytes]:
        """The writer pool's client (:class:`RedisCluster` sends on it too)."""
        return self._client

    # -- LogStore -----------------------------------------------------------

    def create(self, message_id: str, *, on_idle: Callable[[], None] | None = None) -> MemoryMessageLog:
        """A new OPEN log owned by this replica; its entries go to Redis at the next flush.

        Raises:
            ValueError: this replica already holds a log with that id.
        """
        log_ = self.local.create(message_id, on_idle=on_idle)
        log_.mirror = self._writer
        return log_

    def get(self, message_id: str) -> MemoryMessageLog | None:
        """The log if this replica holds it (owned, or tailed for a reader here); no round trip."""
        return self.local.get(message_id) or self._remote.get(message_id)

    async def find(self, message_id: str, after: int | None = None) -> MemoryMessageLog | None:
        """The log, from this replica or from Redis (one ``XRANGE``); ``None`` if neither has it.

        A miss is looked up once more after two flush intervals and
        :data:`MISS_RETRY_SECONDS` (so an unknown id costs that much more).

        A remote log that is still open is tailed by the pump from then on,
        as long as it has readers on this replica.

        Args:
            message_id: the message.
            after: the seq a resume names (``None``: from the start). The owner
                sends an entry to its own readers before its flush brings it
                here, so a client that moved may name one this replica's copy
                has not got yet: an open copy that does not hold ``after`` is
                given two flush intervals and :data:`CATCH_UP_SECONDS` to get
                it (``logs.wait_until_holds``), and is returned whether it did
                or not (an id still past its end was never sent: the caller's
                400). The copy is kept from :meth:`_prune` while it waits, and
                nothing is awaited between the wait and the return, so the
                caller's reader enters before the pump looks again.

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable.
        """
        held = self.get(message_id)
        if held is None and not self.local.evicted(message_id):
            held = await self._copy(message_id)
        if held is not None and self._remote.get(message_id) is held and not holds(held, after):
            self._waiting[message_id] = self._waiting.get(message_id, 0) + 1
            try:
                await wait_until_holds(held, after, 2 * self._flush_interval + CATCH_UP_SECONDS)
            finally:
                self._waiting[message_id] -= 1
                if not self._waiting[message_id]:
                    del self._waiting[message_id]
            if not self.available:  # the copy was ended by the outage, not by its owner
                raise store_unavailable()
        return held

    async def _copy(self, message_id: str) -> MemoryMessageLog | None:
        """A copy of the stream in Redis (tailed by the pump while open), or ``None`` if there is none.

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable.
        """
        with _unavailable_if_down():
            entries, owner = await self._load(message_id)
            if not entries:  # maybe just created elsewhere, its first flush not yet in Redis
                await trio.sleep(2 * self._flush_interval + MISS_RETRY_SECONDS)
                entries, owner = await self._load(message_id)
        held = self.get(message_id)  # a concurrent find may have loaded it meanwhile
        if held is not None or not entries:
            return held
        ring = RingLog(self.config.ring_max_entries, self.config.ring_max_bytes)
        ring.skip_to(_entry_seq(entries[0].identifier))
        copy = MemoryMessageLog(message_id, ring, clock=self.clock,
                                on_readers=lambda delta: self._writer.readers(message_id, delta))
        for entry in entries:
            _deliver(copy, entry.identifier, dict(entry.field_values))
        if not copy.closed:
            if owner is not None:
                self._owners[message_id] = json.loads(owner)
            self._remote[message_id] = copy
            if self._pump_blocked:  # else its next XREAD has the new stream already
                assert self._nursery is not None, "remote copies are made only while run() runs"
                self._nursery.start_soon(self._wake_pump)  # not awaited: the caller enters its reader first
        return copy

    async def _load(self, message_id: str) -> tuple[tuple, bytes | None]:
        """The stream's entries and its owner (JSON), in one round trip."""
        async with self._client.pipeline(transaction=False) as pipe:
            entries = pipe.xrange(stream_key(message_id), "-", "+")
            owner = pipe.hget(MESSAGE_PREFIX + message_id, "owner")
        return await entries, await owner

    async def message_state(self, message_id: str, *, request: bool = False) -> StoredMessage | None:
        """The status its owner last wrote to Redis, or ``None``: there is none, or one that lacks
        a field a message cannot be without (only an owner of an older version leaves one so; the
        owner writes it whole again at its next write, ``_Writer.status``).

        Args:
            message_id: the message.
            request: read its request body too (the hash holds it for the surfaces whose messages
                a later request continues: ``MirroredMessageStore``); else ``request`` is empty.

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable.
        """
        names = [name for name in _STATE_FIELDS if request or name != "request"]
        with _unavailable_if_down():
            values = await self._client.hmget(MESSAGE_PREFIX + message_id, names)
        found = {name: json.loads(value) for name, value in zip(names, values, strict=True) if value is not None}
        if not _REQUIRED_FIELDS <= {*found, "request"}:
            return None
        return StoredMessage(**{"request": "", **found})

    def forget(self, message_id: str) -> None:
        """Drop a log from this replica now (its Redis key expires by itself)."""
        self.local.forget(message_id)
        self._remote.pop(message_id, None)

    def evicted(self, message_id: str) -> bool:
        """Whether this replica held ``message_id`` and let it go (410 Gone rather than 404)."""
        return self.local.evicted(message_id)

    @property
    def available(self) -> bool:
        """False from a failed Redis round trip (flush or pump) until the next one that succeeds.

        The pump makes one at least every :data:`PUMP_BLOCK_MS`, so this follows
        Redis within about a second either way.
        """
        return self._down_since is None

    def _went_down(self, what: str, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = self.clock()
            log.warning("redis: %s failed, the Redis log backend is unavailable: %r", what, exc)
            # Remote copies cannot go on: end them (no terminal event, so their clients resume,
            # and get 503 until Redis is back).
            for copy in self._remote.values():
                copy.close(LogState.FAILED)
            self._remote.clear()

    def _came_up(self) -> None:
        if self._down_since is not None:
            log.info("redis: reachable again after %.1f s", self.clock() - self._down_since)
            self._down_since = None

    def statistics(self) -> LogStoreStatistics:
        """The owned logs' snapshot (remote copies are not counted)."""
        return self.local.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the connections; run the TTL sweep, the flusher and the pump. Never returns.

        On cancellation the flusher sends what is still queued (shielded, at
        most one second), so the terminal events of a drain reach Redis.

        Raises:
            coredis.exceptions.RedisError, OSError: Redis is unreachable at start.
        """
        async with self._client:
            await self._client.delete([self._wake_key])
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.local.run)
                nursery.start_soon(self._flush_loop)
                nursery.start_soon(self._pump_loop)
                task_status.started()

    # -- writing ------------------------------------------------------------

    @property
    def _flush_interval(self) -> float:
        return max(self.config.flush_ms, 1.0) / 1000

    async def _flush_loop(self) -> None:
        interval = self._flush_interval
        last = -math.inf
        try:
            while True:
                await self._writer.wanted.wait()
                await trio.sleep_until(last + interval)  # at most one round trip per flush interval
                last = trio.current_time()
                ops = self._writer.take()
                try:
                    await self._send(ops)
                except _REDIS_ERRORS as exc:
                    self._went_down("a flush", exc)
                    pending = self._writer.pending
                    pending[:0] = ops  # explicit ids make a resend harmless
                    if len(pending) > MAX_PENDING_OPS:
                        log.warning("redis: dropping %d queued writes", len(pending) - MAX_PENDING_OPS)
                        del pending[: len(pending) - MAX_PENDING_OPS]
                    self._writer.wanted.set()
                    await trio.sleep(RETRY_SECONDS)
                else:
                    self._came_up()
        finally:
            ops = self._writer.take()
            if ops:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0), contextlib.suppress(*_REDIS_ERRORS):
                    await self._send(ops)

    async def _send(self, ops: list[_Op]) -> None:
        """One pipelined round trip: the status writes, every queued XADD in order, the EXPIREs,
        then the deletions. A status update that found its hash gone is queued again whole, first
        (``_Writer.status``)."""
        ttl = max(1, math.ceil(self.config.ttl_seconds))  # EXPIRE 0 would delete before a remote reader saw the end
        expiries: dict[str, int] = {}
        # Statuses first: a reader that sees a log's terminal marker then reads the final status.
        # Deletions last: nothing queued before one brings its keys back.
        statuses = [op for op in ops if isinstance(op, _Status)]
        deleted = [op.message_id for op in ops if isinstance(op, _Delete)]
        rest = [op for op in ops if not isinstance(op, _Status | _Delete)]
        written = []
        async with self._client.pipeline(transaction=False, raise_on_error=False) as pipe:
            for status in statuses:
                flat = [item for pair in status.fields.items() for item in pair]
                written.append(pipe.eval(_WRITE_STATUS, keys=[status.key],
                                         args=["1" if status.whole is None else "0", MESSAGE_KEY_SECONDS, *flat]))
            for op in rest:
                match op:
                    case _Append(key=key, seq=seq, data=data):
                        pipe.xadd(key, {_DATA: data}, identifier=_entry_id(seq), trim_strategy=PureToken.MAXLEN,
                                  threshold=self.config.ring_max_entries, trim_operator=PureToken.APPROXIMATELY)
                        expiries.setdefault(key, LIVE_KEY_SECONDS)
                    case _Close(key=key, seq=seq, state=state):
                        pipe.xadd(key, {_STATE: state.value}, identifier=_entry_id(seq))
                        expiries[key] = ttl
                    case _Readers(message_id=message_id, delta=delta):
                        pipe.xadd(READERS_STREAM, {b"id": message_id.encode(), b"d": str(delta).encode()},
                                  trim_strategy=PureToken.MAXLEN, threshold=CANCEL_STREAM_MAXLEN,
                                  trim_operator=PureToken.APPROXIMATELY)
                    case _:
                        assert_never(op)
            for key, seconds in expiries.items():
                pipe.expire(key, seconds)
            for message_id in deleted:
                pipe.delete([MESSAGE_PREFIX + message_id, stream_key(message_id)])
        self.round_trips_total += 1
        again: list[_Op] = []
        for status, result in zip(statuses, written, strict=True):
            with contextlib.suppress(coredis.exceptions.ResponseError):  # dropped, as a failed XADD is
                if not await result and status.whole is not None and (fields := status.whole()) is not None:
                    again.append(_Status(status.key, fields))
        if again:
            self._writer.again_first(again)

    # -- tailing ------------------------------------------------------------

    async def _wake_pump(self) -> None:
        with contextlib.suppress(*_REDIS_ERRORS):  # unwoken, the pump still comes round within PUMP_BLOCK_MS
            await self._client.xadd(self._wake_key, {b"w": b"1"}, trim_strategy=PureToken.MAXLEN, threshold=1)

    async def _last_id(self, key: str) -> str:
        last = await self._client.xrevrange(key, "+", "-", count=1)
        return last[0].identifier.decode() if last else "0-0"  # type: ignore[union-attr]  # coredis stubs: bytes

    def _prune(self) -> None:
        """Stop tailing ended copies and copies nobody here reads.

        A fresh copy's first reader enters synchronously after :meth:`find`
        returns (nothing awaits in between), before the pump runs again; a
        copy that a :meth:`find` is waiting on to catch up is kept.
        """
        for message_id, copy in list(self._remote.items()):
            if copy.closed or (copy.readers == 0 and message_id not in self._waiting):
                del self._remote[message_id]
                self._owners.pop(message_id, None)

    async def _lease(self) -> None:
        """Renew this replica's lease; end the tailed streams whose owner's lease has lapsed."""
        owners = {self._owners[mid] for mid in self._remote if mid in self._owners}
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.set(REPLICA_PREFIX + self.replica, b"1", px=LEASE_MS)
            alive = {owner: pipe.exists([REPLICA_PREFIX + owner]) for owner in owners}
        dead = {owner for owner, exists in alive.items() if not await exists}
        for message_id, copy in list(self._remote.items()):
            if self._owners.get(message_id) in dead:
                await self._take_over(message_id, copy)

    async def _take_over(self, message_id: str, copy: MemoryMessageLog) -> None:
        """The owner is gone: write the in-band error and the end into its stream (once, atomically)."""
        stored = await self.message_state(message_id)
        if stored is None or self.on_owner_lost is None or copy.next_seq == 0:
            return
        log.warning("redis: the replica generating %s is gone; ending its stream", message_id)
        entries = self.on_owner_lost(stored, copy.next_seq)
        ttl = max(1, math.ceil(self.config.ttl_seconds))
        error = json.dumps(OWNER_LOST_MESSAGE)
        await self._client.eval(_TAKE_OVER, keys=[stream_key(message_id), MESSAGE_PREFIX + message_id],
                                args=[f"{copy.next_seq}-0", ttl, *entries, error])

    async def _pump_loop(self) -> None:
        """Run :meth:`_pump` on a client of its own; after each failure, a fresh client, with backoff."""
        # Requests and reader counts from before this replica started are about others' messages.
        cursors = _PumpCursors(cancel=await self._last_id(CANCEL_STREAM), readers=await self._last_id(READERS_STREAM))
        delay = RETRY_SECONDS
        while True:
            cursors.read = False
            async with coredis.Redis.from_url(self.url, max_connections=1) as client:  # connects at its first read
                try:
                    await self._pump(client, cursors)
                except (*_REDIS_ERRORS, trio.TooSlowError) as exc:  # caught here: the client's exit would group it
                    self._pump_blocked = False
                    self._went_down("the pump's read", exc)
            delay = RETRY_SECONDS if cursors.read else min(2 * delay, MAX_RETRY_SECONDS)
            await trio.sleep(delay)

    async def _pump(self, client: coredis.Redis[bytes], cursors: _PumpCursors) -> None:
        """Renew the lease and tail every stream read here, until a Redis call fails (raised).

        Raises:
            coredis.exceptions.RedisError, OSError, anyio resource errors, trio.TooSlowError: the
            read failed or stalled; ``client``'s connection may be unusable from then on.
        """
        lease_at = -math.inf
        while True:
            self._prune()
            if trio.current_time() >= lease_at:
                lease_at = trio.current_time() + LEASE_MS / 3000 / 2
                try:
                    with trio.fail_after(STALL_SECONDS):
                        await self._lease()
                except (*_REDIS_ERRORS, trio.TooSlowError) as exc:
                    self._went_down("the lease", exc)
            streams = {stream_key(mid): f"{copy.next_seq}-0" for mid, copy in self._remote.items()}
            streams[self._wake_key] = cursors.wake
            streams[CANCEL_STREAM] = cursors.cancel
            streams[READERS_STREAM] = cursors.readers
            self._pump_blocked = True
            # A connection whose peer vanished may never answer: past the block time and
            # STALL_SECONDS more, the read counts as failed.
            with trio.fail_after(PUMP_BLOCK_MS / 1000 + STALL_SECONDS):
                got = await client.xread(streams, count=PUMP_BATCH, block=PUMP_BLOCK_MS)
            self._pump_blocked = False
            cursors.read = True
            self._came_up()
            # coredis types ids and fields as str | bytes whatever the client; ours (no
            # decode_responses) gets bytes: the ignores below are for that gap in its stubs.
            for key, entries in (got or {}).items():
                name = key.decode()
                if name == self._wake_key:
                    cursors.wake = entries[-1].identifier.decode()  # type: ignore[union-attr]
                    continue
                if name == READERS_STREAM:
                    cursors.readers = entries[-1].identifier.decode()  # type: ignore[union-attr]
                    for entry in entries:
                        owned = self.local.get(entry.field_values[b"id"].decode())  # type: ignore[union-attr]
                        if owned is not None:
                            owned.remote_readers_changed(int(entry.field_values[b"d"]))
                    continue
                if name == CANCEL_STREAM:
                    cursors.cancel = entries[-1].identifier.decode()  # type: ignore[union-attr]
                    for entry in entries:
                        message_id = entry.field_values[b"id"].decode()  # type: ignore[union-attr]
                        if entry.field_values.get(b"do") == b"delete":
                            if self.on_delete is not None:
                                self.on_delete(message_id)
                        elif self.on_cancel is not None and self.local.get(message_id) is not None:
                            self.on_cancel(message_id)
                    continue
                copy = self._remote.get(name.removeprefix(KEY_PREFIX))
                if copy is None:
                    continue
                for entry in entries:
                    _deliver(copy, entry.identifier, dict(entry.field_values))  # type: ignore[arg-type]


@attrs.frozen
class RedisCluster:
    """The :class:`~ringserve.logs.cluster.Cluster` of replicas that share a Redis (see the module
    docstring), over the connections of their :class:`RedisLogStore`.

    Args:
        logs: this replica's Redis log store (its :meth:`RedisLogStore.run` holds the connections).
    """

    logs: RedisLogStore

    async def find_message(self, message_id: str, *, request: bool = False) -> StoredMessage | None:
        """The status its owner last wrote to Redis (``RedisLogStore.message_state``)."""
        return await self.logs.message_state(message_id, request=request)

    async def request_cancel(self, message_id: str) -> None:
        """Ask the replica that owns ``message_id`` to cancel it (an entry in :data:`CANCEL_STREAM`).

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable.
        """
        with _unavailable_if_down():
            await self.logs.client.xadd(CANCEL_STREAM, {b"id": message_id.encode()}, trim_strategy=PureToken.MAXLEN,
                                        threshold=CANCEL_STREAM_MAXLEN, trim_operator=PureToken.APPROXIMATELY)

    async def delete_message(self, message_id: str, *, here: bool) -> None:
        """Wait until ``message_id``'s status hash is gone (looking every :data:`DELETE_POLL_SECONDS`),
        having asked the replica that holds it to delete it unless this one did (``here``: then
        its flusher deletes the hash and the stream, ``MirroredMessageStore.delete``). The ask is an
        entry ``id``, ``do=delete`` in :data:`CANCEL_STREAM`: every replica whose store has the row
        deletes it, and its hash and stream with it (``RedisLogStore``'s ``on_delete``).

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable, or the
            hash is still there after :data:`DELETE_WAIT_SECONDS` (the replica that holds the
            message is stopped or cut off): the message was not deleted.
        """
        key = MESSAGE_PREFIX + message_id
        with _unavailable_if_down():
            if not here:
                await self.logs.client.xadd(CANCEL_STREAM, {b"id": message_id.encode(), b"do": b"delete"},
                                            trim_strategy=PureToken.MAXLEN, threshold=CANCEL_STREAM_MAXLEN,
                                            trim_operator=PureToken.APPROXIMATELY)
            with trio.move_on_after(DELETE_WAIT_SECONDS):
                while await self.logs.client.exists([key]):
                    await trio.sleep(DELETE_POLL_SECONDS)
                return
        raise RingserveError(
            ErrorKind.UNAVAILABLE,
            f"{message_id[:80]} was not deleted: the replica that generated it did not delete it within"
            f" {DELETE_WAIT_SECONDS:g} s (it may be stopped); retry",
            retryable=True,
        )

    async def claim_key(self, key: str, holder: KeyHolder, *, replaces: str | None = None) -> KeyHolder | None:
        """Make ``key`` name ``holder`` on every replica unless it names another message (one script).

        Args:
            key: the ``Idempotency-Key`` (with its surface).
            holder: this replica's new message.
            replaces: the id of the message the key names now that ``holder``
                takes it over (one that ended ``failed``/``interrupted``, or whose
                attempt never started): replaced only if the key still names it.

        Returns:
            ``None`` once ``key`` names ``holder`` (for :data:`MESSAGE_KEY_SECONDS`,
            as long as the status hashes live), else the holder it names.

        Raises:
            RingserveError: ``UNAVAILABLE`` (503 with ``Retry-After``): Redis is unreachable.
        """
        with _unavailable_if_down():
            current = await self.logs.client.eval(_CLAIM, keys=[IDEMPOTENCY_PREFIX + key],
                                                  args=[_holder_json(holder), replaces or "", MESSAGE_KEY_SECONDS])
        return None if current is None else KeyHolder(*json.loads(current))  # type: ignore[arg-type]  # bytes

    async def release_key(self, key: str, holder: KeyHolder) -> None:
        """Let ``key`` go if it still names ``holder`` (its attempt failed to start).

        Never raises: a claim left behind (Redis unreachable) is taken over by the
        next attempt once its message has not appeared for ``idempotency.KEY_WAIT_SECONDS``.
        """
        with contextlib.suppress(*_REDIS_ERRORS):
            await self.logs.client.eval(_RELEASE, keys=[IDEMPOTENCY_PREFIX + key], args=[_holder_json(holder)])

class MirroredMessageStore(MessageStore):
    """The SQLite :class:`~ringserve.store.sqlite.MessageStore`, whose every write also goes to Redis.

    Build it as a :class:`MessageStore` (``from_config``), then :meth:`mirror_to`
    the Redis log store. Each :meth:`insert` and :meth:`update` then queues an
    ``HSET`` of the fields written (with ``owner``, this replica) on that
    store's next pipelined flush, so that :meth:`RedisCluster.find_message`
    on any replica reads the status, the text so far and the usage (as fresh
    as ``[stream] persist_seconds``). An update whose hash is gone (Redis
    restarted, or evicted it) writes the row whole again instead. The request
    body is written only for the surfaces named in ``shared_requests`` (those
    whose messages a later request continues: the other replicas read the
    conversation from it). :meth:`delete` deletes the hash and the stream too.
    A write run on a worker thread (``MessageStore.off_loop``) queues its Redis write on the
    Trio thread, before the worker goes on.
    """

    _logs: RedisLogStore | None = None
    _shared_requests: frozenset[str] = frozenset()

    def mirror_to(self, logs: RedisLogStore, shared_requests: frozenset[str] = frozenset()) -> MirroredMessageStore:
        """Send every later write to ``logs``'s flusher too, with the request bodies of the messages
        of the surfaces named in ``shared_requests``; returns ``self``."""
        self._logs = logs
        self._shared_requests = shared_requests
        return self

    @property
    def _writer(self) -> _Writer:
        assert self._logs is not None, "mirror_to() was not called"
        return self._logs._writer

    def _shared(self, message: StoredMessage) -> dict[str, object]:
        """What the other replicas read of ``message``: all its fields (the request only if shared),
        and its owner."""
        assert self._logs is not None, "mirror_to() was not called"
        shared = {"request": message.request} if message.surface in self._shared_requests else {}
        return {**attrs.asdict(message, filter=lambda field, _value: field.name != "request"), **shared,
                "owner": self._logs.replica}

    def _whole(self, message_id: str) -> dict[str, object] | None:
        """The row as the other replicas read it, as this store has it now; None once deleted, or
        when the store fails to read (logged: the hash is written whole at a later update)."""
        try:
            row = self.get(message_id)
        except sqlite3.Error as exc:
            log.warning("redis: the status of %s is not in Redis, and the store failed to read it: %r", message_id, exc)
            return None
        return None if row is None else self._shared(row)

    def insert(self, message: StoredMessage) -> None:
        super().insert(message)
        _on_trio_thread(lambda: self._writer.status(message.id, self._shared(message)))

    def update(self, message_id: str, **fields: object) -> None:
        """Write ``fields`` to SQLite and to Redis; the other replicas read them even when the SQLite
        write fails (the hub writes the state again once it works)."""
        try:
            super().update(message_id, **fields)
        finally:
            _on_trio_thread(lambda: self._writer.status(message_id, fields, whole=lambda: self._whole(message_id)))

    def update_all(self, updates: Sequence[tuple[str, Mapping[str, object]]]) -> None:
        """As :meth:`update`, in one transaction and one trip to the Trio thread for the Redis writes."""
        try:
            super().update_all(updates)
        finally:
            def queue() -> None:
                for message_id, fields in updates:
                    self._writer.status(message_id, dict(fields), whole=functools.partial(self._whole, message_id))

            _on_trio_thread(queue)

    def delete(self, message_id: str) -> bool:
        """Delete the row; if there was one, its status hash and its stream too (at the next flush)."""
        existed = super().delete(message_id)
        if existed:
            _on_trio_thread(lambda: self._writer.deleted(message_id))
        return existed


def _on_trio_thread(call: Callable[[], None]) -> None:
    """``call()`` now on the Trio thread; from a Trio worker thread, on the Trio thread, waiting for it."""
    if trio.lowlevel.in_trio_run():
        call()
    else:
        trio.from_thread.run_sync(call)
