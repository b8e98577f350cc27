"""Durable message store (SQLite, the embedded default).

Holds each message's request, status, final text, stop reason, usage and
idempotency key. Writes happen at creation, on status changes and at the end
of a generation — never per token — so they run on the Trio thread: with WAL
and ``synchronous=NORMAL`` each is well under a millisecond.

Statuses: ``queued`` → ``generating`` → ``complete`` | ``cancelled`` |
``failed``; on start-up every message still ``queued`` or ``generating`` (a
crash) becomes ``interrupted``.
"""

from __future__ import annotations

import sqlite3
import time

import attrs

STATUSES = ("queued", "generating", "complete", "cancelled", "failed", "interrupted")
FINAL_STATUSES = frozenset({"complete", "cancelled", "failed", "interrupted"})

_SCHEMA = """
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
    updated REAL NOT NULL
)
"""


@attrs.frozen
class StoredMessage:
    """One row of the store. ``stop_reason`` is spelled in the message's surface."""

    id: str
    surface: str
    model: str
    created: int
    status: str = attrs.field(validator=attrs.validators.in_(STATUSES))
    request: str
    request_hash: str
    idempotency_key: str | None = None
    text: str = ""
    stop_reason: str | None = None
    stop_sequence: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


_COLUMNS = [a.name for a in attrs.fields(StoredMessage)]


class MessageStore:
    """SQLite-backed message store.

    Args:
        path: database file, or ``":memory:"``.

    Raises:
        sqlite3.Error: the database cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)

    def mark_interrupted(self) -> int:
        """Turn every ``queued``/``generating`` row into ``interrupted``; return how many."""
        cur = self._db.execute(
            "UPDATE messages SET status='interrupted', updated=? WHERE status IN ('queued','generating')",
            (time.time(),),
        )
        return cur.rowcount

    def insert(self, message: StoredMessage) -> None:
        """Add a new message.

        Raises:
            sqlite3.IntegrityError: the id or idempotency key exists already.
        """
        values = attrs.astuple(message) + (time.time(),)
        marks = ",".join("?" * len(values))
        self._db.execute(f"INSERT INTO messages ({','.join(_COLUMNS)},updated) VALUES ({marks})", values)

    def update(self, message_id: str, **fields: object) -> None:
        """Change some columns of one message (names as in :class:`StoredMessage`)."""
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown column(s): {sorted(unknown)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"unknown status {fields['status']!r}")
        sets = ",".join(f"{k}=?" for k in fields)
        self._db.execute(f"UPDATE messages SET {sets},updated=? WHERE id=?", (*fields.values(), time.time(), message_id))

    def get(self, message_id: str) -> StoredMessage | None:
        return self._one("id", message_id)

    def by_idempotency_key(self, key: str) -> StoredMessage | None:
        return self._one("idempotency_key", key)

    def _one(self, column: str, value: str) -> StoredMessage | None:
        row = self._db.execute(f"SELECT {','.join(_COLUMNS)} FROM messages WHERE {column}=?", (value,)).fetchone()
        return None if row is None else StoredMessage(*row)

    def close(self) -> None:
        self._db.close()
