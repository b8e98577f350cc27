"""Durable message store (SQLite, the embedded default), with retention.

Holds each message's request (unless ``[store] keep_prompts = false``),
status, final text, stop reason, usage and idempotency key. Writes happen at
creation, on status changes, every ``[stream] persist_seconds`` of a generation
and at its end — never per token. With WAL and ``synchronous=NORMAL`` each is
well under a millisecond, but one can wait: for a lock another process holds on
the file (up to :data:`BUSY_TIMEOUT_MS`, then ``database is locked``), or for
SQLite's automatic WAL checkpoint (at 1000 pages, with an fsync: 20-50 ms on a
loaded 2-core machine), which runs inside whichever write crosses it. So the
server writes through :meth:`MessageStore.off_loop`, on a Trio worker thread,
one write at a time in the order they were asked, and reads on a second
connection, which in WAL mode a writer's lock does not hold up
(https://sqlite.org/wal.html#concurrency): a call on the writing connection
from the Trio thread would wait for the worker's call to end, since SQLite
serializes the calls on one connection.

Statuses: ``queued`` → ``generating`` → ``complete`` | ``cancelled`` |
``failed``; on start-up every message still ``queued`` or ``generating`` (a
crash) becomes ``interrupted``, unless another server is using the file
(:meth:`MessageStore.claim`, by an advisory lock on ``<path>.lock``).

Retention (:meth:`MessageStore.sweep`, driven by :func:`run_retention`):
finished messages (:data:`FINAL_STATUSES`) are deleted once they are
``max_age_seconds`` old (counted from their last write, i.e. their end), and
the oldest finished ones go first while the database holds more than
``max_bytes``; ``queued``/``generating`` rows are never deleted. Deleting a
row frees its idempotency key. Deletion runs in transactions of at most
:data:`SWEEP_BATCH_ROWS` rows and :data:`SWEEP_BATCH_SECONDS` seconds, rows
picked one by one by an index, and freed pages go back to
the file system by ``PRAGMA incremental_vacuum`` in steps of
:data:`VACUUM_STEP_PAGES` pages (the file uses ``auto_vacuum=INCREMENTAL``;
an older file is converted once at open by a ``VACUUM``). No call reads more
than one row into memory.

A ``PASSIVE`` checkpoint from a worker thread on a second connection was tried
and left: under continuous writes it never lets the WAL restart (it grew to
175 MB over 600 long answers).
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TypeVar

import attrs
import platformdirs
import trio

from ringserve.config import StoreConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import BlockKind, ContentBlock, StopReason, TokenLogprob, TopLogprob, Usage
from ringserve.core.producer import Snapshot, Trace
from ringserve.core.status import FINAL_STATUSES, MessageStatus
from ringserve.core.view import MessageView

log = logging.getLogger("ringserve.store")

T = TypeVar("T")


#: ``PRAGMA user_version`` of the files this code writes (written at every open, which
#: proves the file writable).
SCHEMA_VERSION = 7  # 2: final_seq; 3: stop_reason holds StopReason values, not a surface's spelling; 4: content, cached_tokens; 5: trace, render; 6: reasoning_tokens; 7: log probabilities in content and trace (JSON only)

#: Most rows, and seconds, of one sweep transaction; the hub's writes wait at most that long
#: (``sweep_once``). Deleting a finished message with a 64 KiB answer takes about 0.2 ms (2 busy cores).
SWEEP_BATCH_ROWS = 64
SWEEP_BATCH_SECONDS = 0.002

#: Pages (4 KiB by default) handed back per ``incremental_vacuum`` call (about 0.2 ms for 32);
#: the hub's writes may go between calls.
VACUUM_STEP_PAGES = 32

#: Largest size in bytes the WAL file keeps after a checkpoint (``PRAGMA journal_size_limit``).
WAL_SIZE_LIMIT = 4 * 1024 * 1024

#: Milliseconds a statement waits for a lock another connection holds before it fails with
#: ``database is locked`` (``PRAGMA busy_timeout``).
BUSY_TIMEOUT_MS = 1000

_FINAL = ",".join(f"'{s.value}'" for s in sorted(FINAL_STATUSES))

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS messages (
    id TEXT PRIMARY KEY,
    surface TEXT NOT NULL,
    model TEXT NOT NULL,
    created INTEGER NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    text TEXT NOT NULL DEFAULT '',
    stop_reason TEXT,
    stop_sequence TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    updated REAL NOT NULL,
    final_seq INTEGER,
    content TEXT NOT NULL DEFAULT '',
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    trace TEXT NOT NULL DEFAULT '',
    render TEXT NOT NULL DEFAULT '',
    reasoning_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_updated ON messages (updated);
CREATE INDEX IF NOT EXISTS messages_unfinished ON messages (status) WHERE status IN ('queued','generating');
PRAGMA user_version = {SCHEMA_VERSION};
"""


#: Schema 3: the surfaces' spellings that versions 1 and 2 stored, as StopReason values (OpenAI's
#: ``stop`` is a stop string when one is stored; its ``length`` is read as ``max_tokens``).
_STOP_REASONS_V3 = """
UPDATE messages SET stop_reason = CASE
    WHEN stop_reason = 'end_turn' THEN 'end'
    WHEN stop_reason = 'stop' AND stop_sequence IS NOT NULL THEN 'stop_sequence'
    WHEN stop_reason = 'stop' THEN 'end'
    WHEN stop_reason = 'length' THEN 'max_tokens'
    WHEN stop_reason = 'model_context_window_exceeded' THEN 'context_full'
    WHEN stop_reason = 'content_filter' THEN 'refusal'
    ELSE stop_reason END
WHERE stop_reason IS NOT NULL
"""


class StoreError(Exception):
    """The store file cannot be created, opened or written; the message is one line naming the path."""


def store_failed(exc: sqlite3.Error) -> RingserveError:
    """The error a request gets when the store fails to read or write at run time (a file damaged
    after the start, a full disk): 503 with ``Retry-After`` naming SQLite's reason, never a 500
    and never a 404 that calls a stored message unknown."""
    return RingserveError(ErrorKind.UNAVAILABLE, f"the message store failed ({exc}); the server log has the details",
                          retry_after=1, retryable=True)


@attrs.frozen
class StoredMessage:
    """One row of the store. ``stop_reason`` is surface-neutral; the surface spells it when answering.

    ``request`` is the request body as received, or ``""`` when the store was
    opened with ``keep_prompts=False`` (``request_hash`` is always kept).
    ``final_seq`` is the seq of the terminal event in the message's stream log
    (None until the log is closed), so a resume after it is answered 204 even
    once the log has expired. ``trace`` (:func:`trace_json`, each snapshot) and ``render``
    (:func:`render_json`, at insert) are what rebuilds its stream once the log is gone
    (``core/producer.py`` :func:`~ringserve.core.producer.replay`); both empty in a row
    written before schema 5.
    """

    id: str
    surface: str
    model: str
    created: int
    status: MessageStatus = attrs.field(converter=MessageStatus)
    request: str
    request_hash: str
    idempotency_key: str | None = None
    text: str = ""
    stop_reason: StopReason | None = attrs.field(default=None, converter=attrs.converters.optional(StopReason))
    stop_sequence: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    final_seq: int | None = None
    content: str = ""
    cached_tokens: int = 0
    trace: str = ""
    render: str = ""
    reasoning_tokens: int = 0

    @property
    def usage(self) -> Usage:
        """Its token counts, the prompt tokens read from the prefix cache and the output tokens of
        its reasoning included."""
        return Usage(self.input_tokens, self.output_tokens, self.cached_tokens, self.reasoning_tokens)

    @property
    def blocks(self) -> tuple[ContentBlock, ...]:
        """Its content blocks (``content``, JSON written by :func:`blocks_json`); an empty
        ``content`` is one text block, ``text`` (a message of one text block, or a row written
        before schema 4)."""
        if not self.content:
            return (ContentBlock(BlockKind.TEXT, self.text),)
        return tuple(
            ContentBlock(BlockKind(b["kind"]), b["text"], b.get("name", ""), b.get("call_id", ""),
                         tuple(_logprob(lp) for lp in b.get("logprobs", ())))
            for b in json.loads(self.content)
        )

    def view(self) -> MessageView:
        """The message as its readers see it (not live here). Its echo is the one its renderer was
        made with; a row written before schema 5 kept none, and its request body stands for it
        (``Surface.restored`` reads what it echoes from it; "" when prompts are not kept)."""
        args = stored_render(self)
        return MessageView(
            id=self.id, surface=self.surface, model=self.model, created=self.created, status=self.status,
            content=self.blocks, stop_reason=self.stop_reason, stop_sequence=self.stop_sequence, usage=self.usage,
            error=self.error, echo=self.request if args is None else args.echo, request_hash=self.request_hash,
        )


@attrs.frozen
class RenderArgs:
    """What a message's renderer was made with, beyond the row's id, model and created.

    Attributes:
        include_usage: the renderer's ``include_usage``.
        retry_ms: the reconnection hint its first entry carried (None: none).
        echo: the surface's own state (``Surface.restored``; "" for a stateless surface).
    """

    include_usage: bool
    retry_ms: int | None
    echo: str = ""


def render_json(args: RenderArgs) -> str:
    """The store's spelling of :class:`RenderArgs` (``StoredMessage.render``)."""
    return json.dumps([args.include_usage, args.retry_ms, args.echo], ensure_ascii=False, separators=(",", ":"))


def stored_render(msg: StoredMessage) -> RenderArgs | None:
    """A row's :class:`RenderArgs`, None for a row written before schema 5."""
    if not msg.render:
        return None
    include_usage, retry_ms, echo = json.loads(msg.render)
    return RenderArgs(include_usage, retry_ms, echo)


def trace_json(trace: Trace) -> str:
    """The store's spelling of a :class:`~ringserve.core.producer.Trace` (``StoredMessage.trace``):
    ``[ops]``, ``[ops, kind, retryable]``, or with its log probabilities' counts
    ``[ops, kind or null, retryable or null, counts]``."""
    out: list[object] = [list(trace.ops)]
    if trace.failure is not None or trace.logprobs:
        out += [trace.failure[0].name, trace.failure[1]] if trace.failure is not None else [None, None]
    if trace.logprobs:
        out.append(list(trace.logprobs))
    return json.dumps(out, separators=(",", ":"))


def stored_trace(msg: StoredMessage) -> Trace | None:
    """A row's trace, None for a row written before schema 5 (or by a version that kept none)."""
    if not msg.trace:
        return None
    ops, *rest = json.loads(msg.trace)
    failure = (ErrorKind[rest[0]], rest[1]) if rest and rest[0] is not None else None
    return Trace(tuple(ops), failure, tuple(rest[2]) if len(rest) > 2 else ())


def _logprob_json(logprob: TokenLogprob) -> list[object]:
    """A token's log probabilities as the store keeps them: ``[piece, logprob, [[piece, logprob], ...]]``,
    each piece's bytes as the Latin-1 characters of the same numbers (JSON text holds no bytes)."""
    return [logprob.piece.decode("latin-1"), logprob.logprob,
            [[top.piece.decode("latin-1"), top.logprob] for top in logprob.top]]


def _logprob(value: list[Any]) -> TokenLogprob:
    """What :func:`_logprob_json` wrote (floats read back exactly: JSON keeps their shortest repr)."""
    piece, logprob, top = value
    return TokenLogprob(piece.encode("latin-1"), logprob, tuple(TopLogprob(p.encode("latin-1"), lp) for p, lp in top))


def blocks_json(blocks: tuple[ContentBlock, ...]) -> str:
    """The store's spelling of content blocks (``StoredMessage.content``): a JSON list of
    ``{"kind", "text"[, "name", "call_id"][, "logprobs"]}``, read back by :attr:`StoredMessage.blocks`."""
    out = []
    for b in blocks:
        item: dict[str, object] = {"kind": b.kind.value, "text": b.text}
        if b.name or b.call_id:
            item |= {"name": b.name, "call_id": b.call_id}
        if b.logprobs:
            item["logprobs"] = [_logprob_json(lp) for lp in b.logprobs]
        out.append(item)
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def snapshot_fields(snap: Snapshot) -> dict[str, object]:
    """The columns of a producer's snapshot (``core/producer.py``), for :meth:`MessageStore.update`."""
    only_text = len(snap.content) == 1 and snap.content[0].kind is BlockKind.TEXT and not snap.content[0].logprobs
    fields: dict[str, object] = {
        "status": snap.status,
        "text": "".join(b.text for b in snap.content if b.kind is BlockKind.TEXT),
        # one text block (without log probabilities) is its text (what StoredMessage.blocks reads back): the
        # answer is not stored twice
        "content": "" if only_text else blocks_json(snap.content),
        "stop_reason": snap.stop_reason,
        "stop_sequence": snap.stop_sequence,
        "input_tokens": snap.usage.input_tokens,
        "output_tokens": snap.usage.output_tokens,
        "cached_tokens": snap.usage.cached_tokens,
        "reasoning_tokens": snap.usage.reasoning_tokens,
        "error": snap.error,
        "trace": trace_json(snap.trace),
    }
    if snap.final_seq is not None:
        fields["final_seq"] = snap.final_seq
    return fields


_COLUMNS = [a.name for a in attrs.fields(StoredMessage)]


@attrs.frozen
class StoreStatistics:
    """A snapshot of the store's size (bytes of the database, WAL excluded) and of its sweeps.

    ``longest_step_seconds``: the longest single :meth:`MessageStore.sweep` or
    :meth:`MessageStore.reclaim` call so far, i.e. the longest the hub's writes
    waited for retention at once. ``write_failures_total``: writes (insert,
    update, delete, sweep, reclaim) that raised a ``sqlite3.Error`` (a full
    disk, an I/O error, a lock held past ``busy_timeout``). While the file
    cannot be read, the sizes are the ones last read.
    """

    used_bytes: int
    free_bytes: int
    swept_total: int
    longest_step_seconds: float
    write_failures_total: int = 0


def default_store_path() -> Path:
    """``messages.sqlite3`` in the per-user data directory (platformdirs: ``$XDG_DATA_HOME/ringserve``,
    else ``~/.local/share/ringserve`` on Linux)."""
    return platformdirs.user_data_path("ringserve") / "messages.sqlite3"


class MessageStore:
    """SQLite-backed message store.

    A file that does not exist is created with mode 0600 (SQLite gives its
    ``-wal`` and ``-shm`` files the same mode); its directory must exist.

    Its methods are synchronous. Writes (insert, update, delete, sweep,
    reclaim) go through one connection, reads (get, by idempotency key,
    :meth:`statistics`) through another (one and the same for ``":memory:"``,
    which no other process can lock); the server runs its writes through
    :meth:`off_loop` (see the module doc).

    Args:
        path: database file, or ``":memory:"``.
        keep_prompts: store request bodies; when false the ``request`` column
            is always empty and only its SHA-256 (``request_hash``) is kept.
        clock: seconds since the epoch (``time.time``); stamps ``updated``,
            from which retention ages are counted.

    Raises:
        StoreError: the file cannot be created, is not a database, is damaged
            (``PRAGMA quick_check`` at open), or cannot be written.
    """

    def __init__(self, path: str, *, keep_prompts: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.keep_prompts = keep_prompts
        self.clock = clock
        self._swept = 0
        self._longest_step = 0.0
        self._write_failures = 0
        self._sizes = (0, 0)
        self._writes = trio.CapacityLimiter(1)
        self._lock: int | None = None  # the descriptor of <path>.lock once claimed
        try:
            if path != ":memory:" and not os.path.exists(path):
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._reads = self._db
            try:
                self._setup()
                if path != ":memory:":
                    self._reads = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
                    self._reads.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            except BaseException:
                self._db.close()
                raise
        except (OSError, sqlite3.Error) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StoreError(f"cannot use the message store {path}: {reason}") from None

    @classmethod
    def from_config(cls, config: StoreConfig, *, clock: Callable[[], float] = time.time) -> Self:
        """Open ``config.path``, or :func:`default_store_path` (its directory made 0700) when empty.

        Raises:
            StoreError: as the constructor.
        """
        path = config.path
        if not path:
            default = default_store_path()
            try:
                default.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot use the message store {default}: {exc.strerror or exc}") from None
            path = str(default)
        return cls(path, keep_prompts=config.keep_prompts, clock=clock)

    def _setup(self) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        # A damaged file must stop the start, not answer every request with an error later.
        # quick_check reads every page (O(size): 0.2 s for 200 MB here) but skips the index-content
        # cross-check of integrity_check (0.34 s); https://sqlite.org/pragma.html#pragma_quick_check
        problem = db.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            raise sqlite3.DatabaseError(f"the file is damaged (PRAGMA quick_check: {' '.join(problem.split())})")
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
            # The mode of a file with tables changes only by a VACUUM (https://sqlite.org/pragma.html#pragma_auto_vacuum).
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            if db.execute("SELECT 1 FROM sqlite_schema LIMIT 1").fetchone() is not None:
                log.info("converting the message store %s to incremental vacuum (a one-time VACUUM)", self.path)
                db.execute("VACUUM")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
        if columns and "final_seq" not in columns:  # a file of schema version 1
            db.execute("ALTER TABLE messages ADD COLUMN final_seq INTEGER")
        if columns and self._pragma("user_version") < 3:
            db.execute(_STOP_REASONS_V3)
        if columns and "content" not in columns:  # schema 3 or older: text only (read as one text block)
            db.execute("ALTER TABLE messages ADD COLUMN content TEXT NOT NULL DEFAULT ''")
        if columns and "cached_tokens" not in columns:
            db.execute("ALTER TABLE messages ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0")
        if columns and "trace" not in columns:  # schema 4 or older: no stream to rebuild (410 once the log is gone)
            db.execute("ALTER TABLE messages ADD COLUMN trace TEXT NOT NULL DEFAULT ''")
            db.execute("ALTER TABLE messages ADD COLUMN render TEXT NOT NULL DEFAULT ''")
        if columns and "reasoning_tokens" not in columns:  # schema 5 or older: read as none
            db.execute("ALTER TABLE messages ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0")
        db.executescript(_SCHEMA)

    def claim(self) -> int | None:
        """Claim the store for a server process: mark the messages a previous run left ``queued`` or
        ``generating`` as ``interrupted`` (:meth:`mark_interrupted`) unless another live server uses
        the same file, and hold the claim until :meth:`close` (or the process's end).

        The claim is an advisory lock (``flock(2)``) on the file ``<path>.lock`` beside the store
        (created 0600): taken exclusive without waiting, the sweep runs under it and it is then
        downgraded to shared; when another server holds it, this one waits for a shared lock
        (another server's sweep, at most) and skips the sweep, since that server's unfinished
        messages are its own live ones. ``":memory:"`` is never shared: it is always swept.

        Returns:
            How many messages were marked; None when another server uses the store (none marked).

        Raises:
            StoreError: the lock file cannot be created or locked (one line naming it).
        """
        if self.path != ":memory:":
            lock_path = f"{self.path}.lock"
            try:
                self._lock = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fcntl.flock(self._lock, fcntl.LOCK_SH)
                    return None
            except OSError as exc:
                raise StoreError(f"cannot lock the message store {lock_path}: {exc.strerror or exc}") from None
        try:
            return self.mark_interrupted()
        finally:
            if self._lock is not None:
                fcntl.flock(self._lock, fcntl.LOCK_SH)

    def mark_interrupted(self) -> int:
        """Turn every ``queued``/``generating`` row into ``interrupted``; return how many.

        Reads only those rows (a partial index), whatever the store's size.
        """
        with self._writing():
            cur = self._db.execute(
                "UPDATE messages SET status=?, updated=? WHERE status IN ('queued','generating')",
                (MessageStatus.INTERRUPTED.value, self.clock()),
            )
        return cur.rowcount

    def insert(self, message: StoredMessage) -> None:
        """Add a new message (its ``request`` left out unless ``keep_prompts``).

        Raises:
            sqlite3.IntegrityError: the id or idempotency key exists already.
        """
        if not self.keep_prompts:
            message = attrs.evolve(message, request="")
        values = attrs.astuple(message) + (self.clock(),)
        marks = ",".join("?" * len(values))
        with self._writing():
            self._db.execute(f"INSERT INTO messages ({','.join(_COLUMNS)},updated) VALUES ({marks})", values)

    def update(self, message_id: str, **fields: object) -> None:
        """Change some columns of one message (names as in :class:`StoredMessage`)."""
        with self._writing():
            self._update(message_id, fields)

    def update_all(self, updates: Sequence[tuple[str, Mapping[str, object]]]) -> None:
        """:meth:`update` each ``(message_id, fields)`` of ``updates``, in one transaction (one commit
        for a persist round of many messages: all are written, or none)."""
        with self._writing(), self._transaction():
            for message_id, fields in updates:
                self._update(message_id, fields)

    def _update(self, message_id: str, fields: Mapping[str, object]) -> None:
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown column(s): {sorted(unknown)}")
        if "status" in fields and fields["status"] not in tuple(MessageStatus):
            raise ValueError(f"unknown status {fields['status']!r}")
        if "request" in fields and not self.keep_prompts:
            fields = {**fields, "request": ""}
        sets = ",".join(f"{k}=?" for k in fields)
        self._db.execute(f"UPDATE messages SET {sets},updated=? WHERE id=?", (*fields.values(), self.clock(), message_id))

    def delete(self, message_id: str) -> bool:
        """Delete one message, whatever its status (``DELETE /v1/responses/{id}``); whether it existed."""
        with self._writing():
            return self._db.execute("DELETE FROM messages WHERE id=?", (message_id,)).rowcount > 0

    def get(self, message_id: str) -> StoredMessage | None:
        return self._one("id", message_id)

    def by_idempotency_key(self, key: str) -> StoredMessage | None:
        return self._one("idempotency_key", key)

    def _one(self, column: str, value: str) -> StoredMessage | None:
        row = self._reads.execute(f"SELECT {','.join(_COLUMNS)} FROM messages WHERE {column}=?", (value,)).fetchone()
        return None if row is None else StoredMessage(*row)

    # -- retention -------------------------------------------------------------------------

    def _pragma(self, name: str, db: sqlite3.Connection | None = None) -> int:
        return (db or self._db).execute(f"PRAGMA {name}").fetchone()[0]

    def used_bytes(self) -> int:
        """Bytes of the database in use (pages not on the free list; the WAL not counted)."""
        return (self._pragma("page_count") - self._pragma("freelist_count")) * self._pragma("page_size")

    def sweep(
        self,
        now: float,
        *,
        max_age: float,
        max_bytes: int,
        limit: int = SWEEP_BATCH_ROWS,
        budget: float = SWEEP_BATCH_SECONDS,
    ) -> int:
        """Delete finished messages in one transaction, one row at a time; return how many.

        A row is due when it was last written before ``now - max_age``
        (seconds; 0: no age limit), else, while :meth:`used_bytes` is over
        ``max_bytes`` (0: no limit), the oldest finished one, so the database
        ends just under the limit. Stops when nothing is due, after ``limit``
        rows, or once ``budget`` seconds have passed (at least one row is
        deleted when one is due, however large). ``queued`` and ``generating``
        rows are never deleted. Freed pages stay in the file until
        :meth:`reclaim`. Every row is found by the ``updated`` index.
        """
        finished = f"SELECT rowid FROM messages WHERE status IN ({_FINAL}) {{}} ORDER BY updated LIMIT 1"
        expired, oldest = finished.format("AND updated < ?"), finished.format("")
        start = time.perf_counter()
        deleted = 0
        with self._writing(), self._timed(), self._transaction():
            while deleted < limit and (deleted == 0 or time.perf_counter() - start < budget):
                if not (
                    (max_age > 0 and self._delete(expired, (now - max_age,)))
                    or (0 < max_bytes < self.used_bytes() and self._delete(oldest, ()))
                ):
                    break
                deleted += 1
        self._swept += deleted
        return deleted

    def _delete(self, pick: str, params: tuple) -> int:
        return self._db.execute(f"DELETE FROM messages WHERE rowid IN ({pick})", params).rowcount

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Count a write that raises (:attr:`StoreStatistics.write_failures_total`); a broken
        constraint (``IntegrityError``) is the caller's, not the file's, and is not counted."""
        try:
            yield
        except sqlite3.Error as exc:
            if not isinstance(exc, sqlite3.IntegrityError):
                self._write_failures += 1
            raise

    @contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._longest_step = max(self._longest_step, time.perf_counter() - start)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def reclaim(self, max_pages: int = VACUUM_STEP_PAGES) -> int:
        """Give up to ``max_pages`` free pages back to the file system; return how many were free before.

        (In WAL mode the main file shrinks at the next checkpoint.)
        """
        free = self._pragma("freelist_count")
        if free:
            with self._writing(), self._timed():
                # One execute() step frees one page; executescript() runs the pragma to its end.
                self._db.executescript(f"PRAGMA incremental_vacuum({min(free, max_pages)});")
        return free

    def statistics(self) -> StoreStatistics:
        """A :class:`StoreStatistics` snapshot; never raises (a scrape must show a failing store)."""
        try:
            page = self._pragma("page_size", self._reads)
            free = self._pragma("freelist_count", self._reads)
            self._sizes = ((self._pragma("page_count", self._reads) - free) * page, free * page)
        except sqlite3.Error:
            pass  # the file cannot be read now: the sizes last read
        return StoreStatistics(
            used_bytes=self._sizes[0],
            free_bytes=self._sizes[1],
            swept_total=self._swept,
            longest_step_seconds=self._longest_step,
            write_failures_total=self._write_failures,
        )

    async def off_loop(self, call: Callable[[], T]) -> T:
        """``call()`` (calls of this store's methods that write) on a Trio worker thread, after every
        call passed here before it has returned: the event loop goes on while a write waits for a
        lock (up to :data:`BUSY_TIMEOUT_MS`) or a WAL checkpoint.

        Cancellation waits for ``call`` to return (a write is never left half done), then
        raises ``trio.Cancelled``.

        Raises:
            What ``call`` raises (``sqlite3.Error``).
        """
        return await trio.to_thread.run_sync(call, limiter=self._writes)

    def close(self) -> None:
        """Close the connections and give up the claim (:meth:`claim`), if taken."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if self._reads is not self._db:
            self._reads.close()
        self._db.close()


async def sweep_once(store: MessageStore, config: StoreConfig) -> int:
    """Delete every message due under ``config``'s retention, batch by batch, then reclaim the space.

    Each batch and each vacuum step runs on a worker thread (:meth:`MessageStore.off_loop`), so
    the hub's writes wait at most one batch. Returns how many messages were deleted.
    """
    total = 0
    sweep = functools.partial(store.sweep, max_age=config.max_age_seconds, max_bytes=config.max_bytes)
    while deleted := await store.off_loop(lambda: sweep(store.clock())):
        total += deleted
    while await store.off_loop(store.reclaim) > VACUUM_STEP_PAGES:
        pass
    return total


async def run_retention(
    store: MessageStore, config: StoreConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run :func:`sweep_once` now and every ``config.sweep_interval_seconds`` until cancelled.

    A sweep the store fails (``sqlite3.Error``: a full disk, an I/O error, a lock) is logged
    once when the failures start and once when a sweep succeeds again, and tried again at
    the next interval; it never ends the server.
    """
    task_status.started()
    failing = False
    while True:
        try:
            deleted = await sweep_once(store, config)
        except sqlite3.Error as exc:
            if not failing:
                log.error("the message store's retention sweep failed (%s); it is tried again every %gs",
                          exc, config.sweep_interval_seconds)
            failing = True
        else:
            if failing:
                log.info("the message store's retention sweep works again")
            failing = False
            if deleted:
                log.info("deleted %d finished message(s) past the store's retention", deleted)
        await trio.sleep(config.sweep_interval_seconds)
