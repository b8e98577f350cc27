"""store/sqlite.py: retention (age, size, batches), space reclaimed, owner-only files, no full-table reads."""

from __future__ import annotations

import os
import sqlite3
import stat

import attrs
import pytest

from ringserve.config import StoreConfig
from ringserve.core.errors import ErrorKind
from ringserve.core.events import BlockKind, ContentBlock, StopReason, TokenLogprob, TopLogprob, Usage
from ringserve.core.producer import Snapshot, Trace
from ringserve.core.status import MessageStatus
from ringserve.store.sqlite import (
    SWEEP_BATCH_ROWS,
    MessageStore,
    StoredMessage,
    StoreError,
    default_store_path,
    snapshot_fields,
    stored_trace,
    trace_json,
)


class Clock:
    """A settable clock (seconds since the epoch) for the store's ``updated`` stamps."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def row(i: int, status: str = "complete", text: str = "", key: str | None = None, request: str = "{}") -> StoredMessage:
    return StoredMessage(id=f"msg_{i}", surface="anthropic", model="fake", created=0, status=status,
                         request=request, request_hash="h", idempotency_key=key, text=text)


def ids(store: MessageStore, n: int) -> set[int]:
    return {i for i in range(n) if store.get(f"msg_{i}") is not None}


def test_finished_messages_go_after_max_age_generating_never(tmp_path):
    clock = Clock()
    store = MessageStore(str(tmp_path / "s.sqlite3"), clock=clock)
    for i, status in enumerate(["complete", "cancelled", "failed", "interrupted", "queued", "generating"]):
        store.insert(row(i, status, key=f"k{i}"))
    clock.now += 50
    store.insert(row(6, key="k6"))  # finished later: younger than max_age at the sweep below
    clock.now += 60
    assert store.sweep(clock(), max_age=100, max_bytes=0) == 4
    assert ids(store, 7) == {4, 5, 6}
    # the deleted messages' idempotency keys are free again; the others are not
    assert store.by_idempotency_key("k0") is None and store.by_idempotency_key("k6") is not None
    store.insert(row(10, key="k0"))
    # however old they get, queued and generating rows stay
    clock.now += 10_000
    assert store.sweep(clock(), max_age=100, max_bytes=0) == 2  # msg_6 and msg_10
    assert ids(store, 11) == {4, 5}
    # max_age 0: no age limit
    store.update("msg_5", status="complete")
    clock.now += 10_000
    assert store.sweep(clock(), max_age=0, max_bytes=0) == 0


def test_age_is_counted_from_the_end_not_the_creation(tmp_path):
    clock = Clock()
    store = MessageStore(":memory:", clock=clock)
    store.insert(row(0, "generating"))
    clock.now += 1000
    store.update("msg_0", status="complete")  # a long generation ends
    clock.now += 50
    assert store.sweep(clock(), max_age=100, max_bytes=0) == 0
    clock.now += 51
    assert store.sweep(clock(), max_age=100, max_bytes=0) == 1


def test_a_sweep_deletes_one_bounded_batch(tmp_path):
    clock = Clock()
    store = MessageStore(":memory:", clock=clock)
    for i in range(SWEEP_BATCH_ROWS * 2 + 3):
        store.insert(row(i))
    clock.now += 10
    counts = [store.sweep(clock(), max_age=1, max_bytes=0, budget=60) for _ in range(4)]
    assert counts == [SWEEP_BATCH_ROWS, SWEEP_BATCH_ROWS, 3, 0]
    assert store.statistics().swept_total == 2 * SWEEP_BATCH_ROWS + 3
    # out of time: one row per call still, so a sweep always gets on
    store.insert(row(1000))
    store.insert(row(1001))
    clock.now += 10
    assert store.sweep(clock(), max_age=1, max_bytes=0, budget=0) == 1


def test_over_max_bytes_the_oldest_finished_go_first(tmp_path):
    clock = Clock()
    store = MessageStore(str(tmp_path / "s.sqlite3"), clock=clock)
    store.insert(row(0, "generating", text="g" * 200_000))  # the oldest, but generating
    for i in range(1, 21):
        clock.now += 1
        store.insert(row(i, text=str(i) * 50_000))
    limit = 400_000
    assert store.used_bytes() > 1_000_000
    while store.sweep(clock(), max_age=0, max_bytes=limit):
        pass
    kept = ids(store, 21)
    assert 0 in kept  # never a generating row
    finished = sorted(kept - {0})
    assert finished == list(range(finished[0], 21))  # the newest ones are kept
    # the sweep stops as soon as the database fits: one more row would not have fitted
    assert store.used_bytes() <= limit < store.used_bytes() + 2 * 100_000 * 1.1
    assert len(finished) >= 1


def test_reclaim_gives_the_space_back_to_the_file(tmp_path):
    path = tmp_path / "s.sqlite3"
    clock = Clock()
    store = MessageStore(str(path), clock=clock)
    for i in range(40):
        store.insert(row(i, text="x" * 100_000))
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    full = path.stat().st_size
    assert full > 4_000_000
    clock.now += 10
    while store.sweep(clock(), max_age=1, max_bytes=0):
        pass
    assert store.statistics().free_bytes > 3_500_000
    while store.reclaim(64) > 64:
        pass
    assert store.statistics().free_bytes == 0
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.stat().st_size < 100_000


def test_an_older_file_is_converted_to_incremental_vacuum(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path, isolation_level=None)  # what an earlier ringserve left: auto_vacuum NONE
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE messages (id TEXT PRIMARY KEY, surface TEXT NOT NULL, model TEXT NOT NULL,"
                " created INTEGER NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, request_hash TEXT NOT NULL,"
                " idempotency_key TEXT UNIQUE, text TEXT NOT NULL DEFAULT '', stop_reason TEXT, stop_sequence TEXT,"
                " input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0, error TEXT,"
                " updated REAL NOT NULL)")
    old.execute("INSERT INTO messages (id, surface, model, created, status, request, request_hash, text, updated)"
                " VALUES ('msg_old', 'anthropic', 'fake', 0, 'complete', '{}', 'h', 'kept', 0)")
    old.close()
    store = MessageStore(str(path))
    assert store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
    assert store.get("msg_old").text == "kept"
    assert store.sweep(10.0, max_age=1, max_bytes=0) == 1


def test_stop_reasons_spelled_by_a_surface_are_read_back_as_stop_reasons(tmp_path):
    """Schema 2 kept the surface's spelling; schema 3 keeps the StopReason and the surface spells it late."""
    path = tmp_path / "v2.sqlite3"
    MessageStore(str(path)).close()
    old = sqlite3.connect(path, isolation_level=None)
    spelled = [("end_turn", None), ("stop", None), ("stop", "###"), ("length", None), ("max_tokens", None),
               ("model_context_window_exceeded", None), ("content_filter", None), ("refusal", None), (None, None)]
    for i, (reason, sequence) in enumerate(spelled):
        old.execute("INSERT INTO messages (id, surface, model, created, status, request, request_hash, stop_reason,"
                    " stop_sequence, updated) VALUES (?, 'openai', 'fake', 0, 'complete', '{}', 'h', ?, ?, 0)",
                    (f"m{i}", reason, sequence))
    old.execute("PRAGMA user_version = 2")
    old.close()
    store = MessageStore(str(path))
    assert [store.get(f"m{i}").stop_reason for i in range(len(spelled))] == [
        StopReason.END, StopReason.END, StopReason.STOP_SEQUENCE, StopReason.MAX_TOKENS, StopReason.MAX_TOKENS,
        StopReason.CONTEXT_FULL, StopReason.REFUSAL, StopReason.REFUSAL, None,
    ]
    assert store.get("m0").status is MessageStatus.COMPLETE


def test_reasoning_blocks_and_reasoning_tokens_come_back(tmp_path):
    store = MessageStore(str(tmp_path / "s.sqlite3"))
    store.insert(row(1, "generating"))
    blocks = (ContentBlock(BlockKind.REASONING, "Plan: 👋"), ContentBlock(BlockKind.TEXT, "Hi."),
              ContentBlock(BlockKind.REASONING, "then call"), ContentBlock(BlockKind.TOOL_CALL, "{}", "f", "a" * 24))
    usage = Usage(7, 12, cached_tokens=3, reasoning_tokens=9)
    store.update("msg_1", **snapshot_fields(Snapshot(MessageStatus.COMPLETE, blocks, usage, StopReason.TOOL_USE)))
    stored = store.get("msg_1")
    assert (stored.blocks, stored.usage, stored.text) == (blocks, usage, "Hi.")
    assert stored.view().usage.reasoning_tokens == 9


@pytest.mark.parametrize("failure", [None, (ErrorKind.OVERLOADED, True)])
def test_log_probabilities_and_their_trace_come_back_exactly(tmp_path, failure):
    """A token cut in the middle of a character (its bytes are not UTF-8), floats that JSON must
    keep to the last bit: the blocks and the trace read back equal, with or without a failure."""
    store = MessageStore(str(tmp_path / "s.sqlite3"))
    store.insert(row(1, "generating"))
    cut = TokenLogprob("€".encode()[:2], -1 / 3, (TopLogprob("€".encode()[:2], -1 / 3), TopLogprob(b"\xff\x00", -7e-9)))
    blocks = (ContentBlock(BlockKind.TEXT, "€ ok", logprobs=(cut, TokenLogprob("€".encode()[2:] + b" ok", -0.0))),)
    trace = Trace((0, 1, 3, -1), failure, (1, 1))
    snap = Snapshot(MessageStatus.COMPLETE, blocks, Usage(5, 2), StopReason.END, trace=trace)
    store.update("msg_1", **snapshot_fields(snap))
    stored = store.get("msg_1")
    assert stored.blocks == blocks and stored_trace(stored) == trace
    assert stored_trace(attrs.evolve(stored, trace=trace_json(Trace((0, -1), failure)))) == Trace((0, -1), failure)


def test_a_file_of_schema_5_reads_no_reasoning_tokens(tmp_path):
    path = tmp_path / "v5.sqlite3"
    MessageStore(str(path)).close()
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("ALTER TABLE messages DROP COLUMN reasoning_tokens")
    old.execute("INSERT INTO messages (id, surface, model, created, status, request, request_hash, output_tokens,"
                " updated) VALUES ('msg_5', 'openai', 'fake', 0, 'complete', '{}', 'h', 4, 0)")
    old.execute("PRAGMA user_version = 5")
    old.close()
    assert MessageStore(str(path)).get("msg_5").usage == Usage(0, 4)


def test_no_operation_scans_the_table(tmp_path):
    """Every statement the store runs finds its rows by an index: memory and time do not grow with its size."""
    clock = Clock()
    store = MessageStore(str(tmp_path / "s.sqlite3"), clock=clock)
    for i in range(50):
        store.insert(row(i, "complete" if i % 2 else "generating", key=f"k{i}"))
    statements: list[str] = []
    for db in (store._db, store._reads):  # the writing connection, and the reading one
        db.set_trace_callback(statements.append)
    store.insert(row(100))
    store.update("msg_100", text="t", status="complete")
    store.get("msg_1")
    store.by_idempotency_key("k3")
    clock.now += 100
    store.sweep(clock(), max_age=10, max_bytes=0)
    store.sweep(clock(), max_age=0, max_bytes=1)
    store.reclaim()
    store.mark_interrupted()
    for db in (store._db, store._reads):
        db.set_trace_callback(None)
    assert any("WHERE idempotency_key" in sql for sql in statements)  # the reads were traced too
    checked = 0
    for sql in statements:
        if sql.split()[0].upper() in {"SELECT", "UPDATE", "DELETE"}:
            plan = " / ".join(r[3] for r in store._db.execute(f"EXPLAIN QUERY PLAN {sql}"))
            # an index walked in order under a LIMIT stops after LIMIT rows (plus unfinished ones skipped)
            walked = "SCAN messages USING INDEX messages_updated" in plan and "LIMIT" in sql
            assert walked or "SCAN messages" not in plan, (sql, plan)
            assert "TEMP B-TREE" not in plan, (sql, plan)
            checked += 1
    assert checked >= 7


def test_only_the_first_server_of_a_store_marks_its_unfinished_messages_interrupted(tmp_path):
    """A second server on the same file leaves the first's live messages alone; once every server
    holding it has closed, the next one marks what they left."""
    path = str(tmp_path / "s.sqlite3")
    first = MessageStore(path)
    first.insert(row(0, "generating"))  # a crashed run's
    assert first.claim() == 1
    first.insert(row(1, "generating"))  # the first server's live message
    second = MessageStore(path)
    assert second.claim() is None
    assert second.get("msg_1").status == "generating"
    third = MessageStore(path)  # the claim is shared: a third server sees both
    assert third.claim() is None
    first.close()
    assert third.get("msg_1").status == "generating"  # the second and third still hold it
    second.close()
    third.close()
    after = MessageStore(path)
    assert after.claim() == 1
    assert after.get("msg_1").status == "interrupted"
    after.close()
    assert stat.S_IMODE(os.stat(path + ".lock").st_mode) == 0o600


def test_keep_prompts_false_stores_no_request(tmp_path):
    store = MessageStore(":memory:", keep_prompts=False)
    store.insert(row(0, request='{"messages": "secret"}'))
    got = store.get("msg_0")
    assert got.request == "" and got.request_hash == "h"


def test_new_files_are_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    old_umask = os.umask(0o022)
    try:
        store = MessageStore.from_config(StoreConfig())
        store.insert(row(0))
    finally:
        os.umask(old_umask)
    path = default_store_path()
    assert store.path == str(path) and path == tmp_path / "data" / "ringserve" / "messages.sqlite3"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        assert stat.S_IMODE(name.stat().st_mode) == 0o600, name
    store.close()
    # an explicit path is still honoured, and ":memory:" works
    explicit = tmp_path / "mine.sqlite3"
    MessageStore.from_config(StoreConfig(path=str(explicit))).close()
    assert stat.S_IMODE(explicit.stat().st_mode) == 0o600
    memory = MessageStore.from_config(StoreConfig(path=":memory:"))
    memory.insert(row(0))
    assert memory.get("msg_0") is not None


@pytest.mark.parametrize("kind", ["corrupt", "missing directory", "a directory"])
def test_a_bad_file_is_one_line_naming_it(tmp_path, kind):
    path = tmp_path / "s.sqlite3"
    if kind == "corrupt":
        path.write_bytes(b"this is not a SQLite database, just some bytes that are long enough" * 4)
    elif kind == "missing directory":
        path = tmp_path / "nope" / "s.sqlite3"
    else:
        path.mkdir()
    with pytest.raises(StoreError) as info:
        MessageStore(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_a_damaged_store_file_stops_the_open(tmp_path):
    """Pages 3 and later overwritten: the header still reads, so only a check at open finds it."""
    path = tmp_path / "s.sqlite3"
    store = MessageStore(str(path))
    for i in range(200):
        store.insert(row(i, text="x" * 500))
    store.close()
    page = 4096
    with path.open("r+b") as f:
        assert os.fstat(f.fileno()).st_size > 8 * page
        f.seek(2 * page)
        f.write(b"\xa5" * (4 * page))
    with pytest.raises(StoreError) as info:
        MessageStore(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert "damaged" in message or "malformed" in message


def test_update_all_writes_every_update_or_none(tmp_path):
    """A persist round is one transaction: a write that fails leaves the rows as they were."""
    store = MessageStore(str(tmp_path / "s.sqlite3"))
    for i in range(3):
        store.insert(row(i, status="generating"))
    store.update_all([("msg_0", {"text": "a"}), ("msg_1", {"text": "b", "output_tokens": 2})])
    assert (store.get("msg_0").text, store.get("msg_1").text, store.get("msg_1").output_tokens) == ("a", "b", 2)
    with pytest.raises(ValueError, match="unknown column"):
        store.update_all([("msg_0", {"text": "c"}), ("msg_2", {"txet": "d"})])
    assert store.get("msg_0").text == "a"
