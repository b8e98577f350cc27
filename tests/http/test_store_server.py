"""The message store in a running server (fake engine): expiry per route, bounded file size, keep_prompts, bad files."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from ringserve.core.sse import SSEParser
from ringserve.store.sqlite import MessageStore, StoredMessage, run_retention
from tests.support.helpers import anthropic_text, sse_events
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

ASYNC = {"Prefer": "respond-async"}
LONG_ECHO = "echo:" + " ".join(f"w{i}" for i in range(400))


def anthropic(content: str, **extra) -> dict:
    return {"model": "any", "max_tokens": 1000, "messages": [{"role": "user", "content": content}], **extra}


def openai(content: str, **extra) -> dict:
    return {"model": "any", "max_tokens": 1000, "messages": [{"role": "user", "content": content}], **extra}


def store_files(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")) if p.exists()]


def assert_expired(resp: httpx.Response, message_id: str, surface: str) -> None:
    assert resp.status_code == 404, resp.text
    body = resp.json()
    error = body["error"]
    if surface == "anthropic":
        assert body["type"] == "error" and error["type"] == "not_found_error"
    else:
        assert error["code"] == "not_found"
    assert message_id in error["message"] and "retention" in error["message"]


async def test_finished_messages_expire_and_answer_404_generating_ones_stay(tmp_path):
    config = fake_config(
        tmp_path,
        store={"max_age_seconds": 0.5, "sweep_interval_seconds": 0.02},
        stream={"ttl_seconds": 0.05},
        engine={"slots": 1},
    )
    async with running_server(config, step_seconds=0.004) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        key = {"Idempotency-Key": "kept-as-long-as-its-message"}
        a = await client.post("/v1/messages", json=anthropic("hi"), headers=key)
        b = await client.post("/v1/chat/completions", json=openai("hi"))
        assert a.status_code == b.status_code == 200
        a_id, b_id = a.json()["id"], b.json()["id"]
        # with one slot, the second long message waits "queued" while the first is "generating"
        long_ids = [(await client.post("/v1/messages", json=anthropic(LONG_ECHO), headers=ASYNC)).json()["id"]
                    for _ in range(2)]

        async def gone(message_id: str) -> bool:
            return (await client.get(f"/v1/messages/{message_id}")).status_code == 404

        await wait_until(lambda: gone(a_id))
        await wait_until(lambda: gone(b_id))
        seen = set()
        pending = list(long_ids)
        while pending:  # sweeps keep running meanwhile; the unfinished messages are never among them
            for message_id in list(pending):
                resp = await client.get(f"/v1/messages/{message_id}")
                assert resp.status_code == 200, resp.text
                seen.add(resp.json()["status"])
                if resp.json()["status"] == "complete":
                    pending.remove(message_id)  # from now on it may expire
            await trio.sleep(0.02)
        assert seen == {"queued", "generating", "complete"}
        assert state.hub.store.statistics().swept_total >= 2
        metrics = (await client.get("/metrics")).text
        swept = next(line for line in metrics.splitlines() if line.startswith("ringserve_store_swept_messages_total"))
        assert float(swept.split()[1]) >= 2 and "ringserve_store_bytes " in metrics

        assert_expired(await client.get(f"/v1/messages/{a_id}"), a_id, "anthropic")
        assert_expired(await client.get(f"/v1/messages/{b_id}"), b_id, "openai")
        assert_expired(await client.post(f"/v1/messages/{a_id}/cancel"), a_id, "anthropic")
        assert_expired(await client.post(f"/v1/messages/{b_id}/stream_token"), b_id, "openai")
        await wait_until(lambda: _true(state.hub.logs.get(a_id) is None))
        assert_expired(await client.get(f"/v1/messages/{a_id}/stream"), a_id, "anthropic")
        # the key went with its message: the same request makes a new one
        again = await client.post("/v1/messages", json=anthropic("hi"), headers=key)
        assert again.status_code == 200 and again.json()["id"] != a_id
        for message_id in long_ids:
            await wait_until(lambda message_id=message_id: gone(message_id))


async def _true(value: bool) -> bool:
    return value


async def test_file_size_stops_growing_under_a_steady_load_of_long_answers(tmp_path):
    max_bytes = 2 * 1024 * 1024
    config = fake_config(
        tmp_path,
        store={"max_bytes": max_bytes, "sweep_interval_seconds": 0.05},
        engine={"slots": 4, "ctx_per_slot": 4096},
        stream={"ttl_seconds": 0.0},
    )
    path = Path(config.store.path)
    reply = "".join(f"{i:07d} " for i in range(8192))  # 64 KiB
    sizes = []
    async with running_server(config, reply=reply, piece_bytes=512) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:

        async def one(i: int) -> None:
            resp = await client.post("/v1/messages", json=anthropic(f"question {i} " * 200))
            assert resp.status_code == 200 and len(resp.json()["content"][0]["text"]) == len(reply)

        for round_ in range(12):  # 12 x 16 answers of 64 KiB and 2 KiB prompts: 13 MiB written
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, round_ * 16 + i)
            sizes.append(sum(p.stat().st_size for p in store_files(path)))
        print("store file sizes (bytes, database + WAL) after each round:", sizes)
        stats = state.hub.store.statistics()
        print("longest sweep or vacuum step:", stats.longest_step_seconds, "s; swept", stats.swept_total)
    written = 12 * 16 * len(reply)
    # Without retention the file would hold every answer (> 12 MiB). It stays under the limit plus
    # a WAL of at most a checkpoint's worth, and its late size is no larger than its early one.
    assert max(sizes) < max_bytes + 8 * 1024 * 1024 < written
    assert max(sizes[6:]) <= max(sizes[:6]) * 1.25
    assert stats.swept_total >= 12 * 16 - 2 * max_bytes // len(reply)


@pytest.mark.parametrize("keep_prompts", [False, True])
async def test_keep_prompts_false_leaves_no_prompt_in_any_file(tmp_path, keep_prompts):
    secret = "zebra-quasar-4417-PROMPT-MARKER"
    config = fake_config(tmp_path, store={"keep_prompts": keep_prompts})
    path = Path(config.store.path)
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        key = {"Idempotency-Key": "one"}
        first = await client.post("/v1/messages", json=anthropic(f"tell me about {secret}"), headers=key)
        assert first.status_code == 200
        await sse_events(client, "POST", "/v1/chat/completions", json=openai(f"and {secret}", stream=True))
        await client.post("/v1/messages", json=anthropic(f"later {secret}"), headers=ASYNC)
        # idempotency works on the hash alone
        retry = await client.post("/v1/messages", json=anthropic(f"tell me about {secret}"), headers=key)
        assert retry.json()["id"] == first.json()["id"]
        other = await client.post("/v1/messages", json=anthropic("another body"), headers=key)
        assert other.status_code == 422
        assert secret not in (await client.get(f"/v1/messages/{first.json()['id']}")).text
        live = b"".join(p.read_bytes() for p in store_files(path))  # the WAL is still there now
    closed = b"".join(p.read_bytes() for p in store_files(path))
    found = secret.encode() in live + closed
    assert found is keep_prompts  # with keep_prompts the same search finds it: the search is real


def _cli(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringserve", "serve", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=60)


def _assert_one_line(result: subprocess.CompletedProcess, path: Path) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in result.stderr, result.stderr


def _config_for(tmp_path: Path, store: Path) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\npath = "{store}"\n')
    return config


def test_a_corrupt_store_file_is_one_line_at_start(tmp_path):
    store = tmp_path / "corrupt.sqlite3"
    store.write_bytes(b"not a database at all; " * 100)
    _assert_one_line(_cli(_config_for(tmp_path, store)), store)


def test_a_read_only_store_file_is_one_line_at_start(tmp_path):
    store = tmp_path / "ro.sqlite3"
    MessageStore(str(store)).close()
    if os.geteuid() == 0:  # root writes through file modes; an immutable file stops it
        if subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without chattr +i")
        undo = ["chattr", "-i", str(store)]
    else:
        store.chmod(0o444)
        undo = ["chmod", "600", str(store)]
    try:
        result = _cli(_config_for(tmp_path, store))
    finally:
        subprocess.run(undo, check=True)
    _assert_one_line(result, store)
    assert "readonly" in result.stderr or "read-only" in result.stderr


def test_a_store_file_damaged_past_its_header_is_one_line_at_start(tmp_path):
    """The header reads and the server used to start, then answer every POST with a 500."""
    store = tmp_path / "damaged.sqlite3"
    db = MessageStore(str(store))
    for i in range(200):
        db.insert(StoredMessage(id=f"msg_{i}", surface="anthropic", model="fake", created=0, status="complete",
                                request="{}", request_hash="h", idempotency_key=None, text="x" * 500))
    db.close()
    with store.open("r+b") as f:
        f.seek(2 * 4096)  # pages 3 and later
        f.write(b"\xa5" * (4 * 4096))
    result = _cli(_config_for(tmp_path, store))
    _assert_one_line(result, store)
    assert "damaged" in result.stderr


def _malformed(*_args, **_kwargs):
    raise sqlite3.DatabaseError("database disk image is malformed")


async def test_a_store_that_fails_at_run_time_answers_503_not_500_or_404(tmp_path):
    """Damaged after the start: each surface's 503 with Retry-After naming SQLite's reason."""
    async with running_server(fake_config(tmp_path)) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        kept = (await client.post("/v1/messages", json=anthropic("hi"))).json()["id"]
        await wait_until(lambda: _true(state.hub.live(kept) is None))
        store = state.hub.store
        store.insert = store.get = store.by_idempotency_key = _malformed
        for path, body in (("/v1/messages", anthropic("hi")), ("/v1/chat/completions", openai("hi"))):
            for extra in ({}, {"stream": True}):
                resp = await client.post(path, json={**body, **extra})
                assert resp.status_code == 503, resp.text
                assert resp.headers["retry-after"] == "1"
                message = resp.json()["error"]["message"]
                assert "message store failed" in message and "malformed" in message
        resp = await client.get(f"/v1/messages/{kept}")
        assert resp.status_code == 503 and "malformed" in resp.json()["error"]["message"], resp.text


class FailingDb:
    """A store connection whose writes (or, with ``reads``, every statement) raise ``error`` while
    ``failing`` is set, as SQLite's do on a full or failing disk or a lock held past busy_timeout.
    :meth:`install` puts it in a store's place (both its connections with ``reads``)."""

    WRITES = ("INSERT", "UPDATE", "DELETE", "BEGIN", "PRAGMA INCREMENTAL_VACUUM")

    def __init__(self, db: sqlite3.Connection, error: str, *, reads: bool) -> None:
        self.db, self.error, self.reads = db, error, reads
        self.failing = False

    def _check(self, sql: str) -> None:
        if self.failing and (self.reads or sql.lstrip().upper().startswith(self.WRITES)):
            raise sqlite3.OperationalError(self.error)

    def execute(self, sql: str, *args):
        self._check(sql)
        return self.db.execute(sql, *args)

    def executescript(self, sql: str):
        self._check(sql)
        return self.db.executescript(sql)

    def __getattr__(self, name: str):
        return getattr(self.db, name)

    @classmethod
    def install(cls, store: MessageStore, error: str, *, reads: bool) -> FailingDb:
        """Wrap ``store``'s writing connection (and its reading one, with ``reads``): the
        ``failing`` switch of the one returned turns them all."""
        db = store._db = cls(store._db, error, reads=reads)
        if reads:
            store._reads = db
        return db


def _sample(metrics: str, name: str) -> float:
    return float(next(line for line in metrics.splitlines() if line.startswith(name + " ")).split()[1])


@pytest.mark.parametrize(("error", "reads"), [("disk I/O error", True), ("database is locked", False)])
async def test_a_store_that_fails_during_a_generation_loses_nothing(tmp_path, caplog, error, reads):
    """Writes raise mid-stream: readers get the whole generation from its log, the failure is logged
    once for the message and counted, GET answers the final state, which is stored once writes work."""
    caplog.set_level(logging.INFO, logger="ringserve.hub")
    config = fake_config(tmp_path, stream={"persist_seconds": 0.02})
    async with running_server(config, step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        hub, store = state.hub, state.hub.store
        before = (await client.post("/v1/messages", json=anthropic(LONG_ECHO))).json()
        expected = before["content"][0]["text"]
        assert len(expected) > 1000
        db = FailingDb.install(store, error, reads=reads)
        parser, events = SSEParser(), []
        key = {"Idempotency-Key": "k-store-fails"}
        async with client.stream("POST", "/v1/messages", json=anthropic(LONG_ECHO, stream=True), headers=key) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_raw():
                events += parser.feed(chunk)
                if not db.failing and any(e.event == "content_block_delta" for e in events):
                    db.failing = True  # from the first text on, every write fails
        message_id = json.loads(events[0].data)["message"]["id"]
        assert anthropic_text(events) == expected and events[-1].event == "message_stop"
        # the store stays broken across more than one write of this message (the retries included)
        await wait_until(lambda: _true(store.statistics().write_failures_total >= 3))
        got = await client.get(f"/v1/messages/{message_id}")
        assert got.status_code == 200, got.text
        assert got.json()["status"] == "complete" and got.json()["content"][0]["text"] == expected
        # its key is answered too: the retry replays the message's log
        retry, replayed, _ = await sse_events(client, "POST", "/v1/messages", json=anthropic(LONG_ECHO, stream=True),
                                              headers=key)
        assert retry.status_code == 200 and retry.headers["x-message-id"] == message_id
        assert anthropic_text(replayed) == expected and replayed[-1].event == "message_stop"
        if reads:  # a message only the broken store holds is a 503, never a 404 or a 500
            old = await client.get(f"/v1/messages/{before['id']}")
            assert old.status_code == 503 and error in old.json()["error"]["message"], old.text
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert _sample(metrics.text, "ringserve_store_write_failures_total") >= 3
        assert _sample(metrics.text, "ringserve_store_unsaved_messages") == 1
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR and message_id in r.getMessage()]
        assert len(logged) == 1, logged

        db.failing = False
        await wait_until(lambda: _true(hub.statistics().unsaved_messages == 0))
        stored = store.get(message_id)
        assert stored.status == "complete" and stored.text == expected and stored.final_seq is not None
        assert hub.live(message_id) is None
        metrics = (await client.get("/metrics")).text
        assert _sample(metrics, "ringserve_store_unsaved_messages") == 0
        again = await client.post("/v1/messages", json=anthropic("hi"))  # the server kept serving
        assert again.status_code == 200, again.text


async def test_a_retention_sweep_the_store_fails_is_tried_again_and_ends_nothing(tmp_path):
    store = MessageStore(str(tmp_path / "s.sqlite3"))
    store.insert(StoredMessage(id="msg_old", surface="anthropic", model="fake", created=0, status="complete",
                               request="{}", request_hash="h"))
    db = FailingDb.install(store, "database is locked", reads=False)
    db.failing = True
    config = fake_config(tmp_path, store={"max_age_seconds": 1e-9, "sweep_interval_seconds": 0.01}).store
    async with trio.open_nursery() as nursery:
        await nursery.start(run_retention, store, config)
        await wait_until(lambda: store.statistics().write_failures_total >= 5)  # five sweeps fail, none ends the task
        assert store.get("msg_old") is not None
        db.failing = False
        await wait_until(lambda: store.get("msg_old") is None)  # a later sweep
        nursery.cancel_scope.cancel()


async def test_the_drain_writes_a_final_state_the_store_failed_to_write(tmp_path, monkeypatch):
    """A message ended unsaved and the store works again by the drain: the drain writes it, even if the
    retry is not due (an hour here)."""
    import ringserve.live.persist as persist_module

    monkeypatch.setattr(persist_module, "STORE_RETRY_SECONDS", 3600.0)
    config = fake_config(tmp_path)
    async with running_server(config, step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        hub = state.hub
        db = FailingDb.install(hub.store, "disk I/O error", reads=False)
        db.failing = False
        accepted = await client.post("/v1/messages", json=anthropic(LONG_ECHO), headers=ASYNC)
        message_id = accepted.json()["id"]
        db.failing = True
        await wait_until(lambda: _true(hub.statistics().unsaved_messages == 1))
        db.failing = False
    stored = MessageStore(config.store.path).get(message_id)
    assert stored.status == "complete" and len(stored.text) > 1000


async def test_writes_are_not_tried_again_until_the_retry_is_due(tmp_path, monkeypatch):
    """A locked store holds the event loop for its busy_timeout (1 s) at each write: after one failed,
    neither the later snapshots, nor the final state, nor a new message's row are tried until the
    retry is due (an hour here)."""
    import ringserve.live.persist as persist_module

    monkeypatch.setattr(persist_module, "STORE_RETRY_SECONDS", 3600.0)
    config = fake_config(tmp_path, stream={"persist_seconds": 0.01})
    async with running_server(config, step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        hub, store = state.hub, state.hub.store
        db = FailingDb.install(store, "database is locked", reads=False)
        parser, events = SSEParser(), []
        async with client.stream("POST", "/v1/messages", json=anthropic(LONG_ECHO, stream=True)) as resp:
            async for chunk in resp.aiter_raw():
                events += parser.feed(chunk)
                if not db.failing and any(e.event == "content_block_delta" for e in events):
                    db.failing = True
        assert events[-1].event == "message_stop" and len(anthropic_text(events)) > 1000
        message_id = json.loads(events[0].data)["message"]["id"]
        assert store.statistics().write_failures_total == 1 and hub.statistics().unsaved_messages == 1
        # a new message is refused at once (503, each surface's shape), its row not tried either
        for path, body in (("/v1/messages", anthropic("hi")), ("/v1/chat/completions", openai("hi"))):
            refused = await client.post(path, json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert "database is locked" in refused.json()["error"]["message"]
        assert store.statistics().write_failures_total == 1
        db.failing = False
        assert await hub.persister.save_unsaved() == 0
        assert store.get(message_id).status == "complete"


async def test_a_store_locked_by_another_process_holds_up_no_stream(tmp_path, monkeypatch):
    """Another connection holds the file's write lock (``BEGIN EXCLUSIVE``, as a backup tool or the
    sqlite3 shell may): every write waits for it on a worker thread, never on the event loop. A
    running stream keeps going to its end while a new message's row waits for the lock, which
    then gets its 503 (the next one at once, its row not tried); once the lock goes, the running
    message's final state is written."""
    import ringserve.store.sqlite as sqlite_module

    monkeypatch.setattr(sqlite_module, "BUSY_TIMEOUT_MS", 3000)  # a long lock: a stall would show
    config = fake_config(tmp_path, stream={"persist_seconds": 0.02})
    short_echo = "echo:" + " ".join(f"w{i}" for i in range(100))
    loop_thread = threading.get_ident()
    async with running_server(config, step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        hub, store = state.hub, state.hub.store
        writers: set[int] = set()  # the threads that ran a statement on the writing connection
        store._db.set_trace_callback(lambda _sql: writers.add(threading.get_ident()))
        ticks: list[float] = []
        locker = sqlite3.connect(config.store.path, isolation_level=None)
        order: list[str] = []
        locked = trio.Event()
        stream: list = []

        async def tick() -> None:  # a task beside the server's: its gaps are the event loop's stalls
            while True:
                ticks.append(time.monotonic())
                await trio.sleep(0.01)

        async def read_stream() -> None:
            parser = SSEParser()
            async with client.stream("POST", "/v1/messages", json=anthropic(short_echo, stream=True)) as resp:
                async for chunk in resp.aiter_raw():
                    stream.extend(parser.feed(chunk))
                    if not locked.is_set() and any(e.event == "content_block_delta" for e in stream):
                        locker.execute("BEGIN EXCLUSIVE")
                        locked.set()
                    if stream and stream[-1].event == "message_stop" and "stream ended" not in order:
                        order.append("stream ended")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            nursery.start_soon(read_stream)
            await locked.wait()
            refused = await client.post("/v1/messages", json=anthropic("hi"))
            order.append("new message answered")
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert "database is locked" in refused.json()["error"]["message"]
            failures = store.statistics().write_failures_total
            again = await client.post("/v1/chat/completions", json=openai("hi"))  # within the retry's second
            assert again.status_code == 503 and "database is locked" in again.json()["error"]["message"]
            assert store.statistics().write_failures_total == failures  # its row was not tried
            lock_ends = time.monotonic()
            locker.execute("COMMIT")
            locker.close()
            nursery.cancel_scope.cancel()

        message_id = json.loads(stream[0].data)["message"]["id"]
        assert stream[-1].event == "message_stop" and anthropic_text(stream) == " ".join(f"w{i}" for i in range(100))
        assert order == ["stream ended", "new message answered"]  # the stream went on while the row waited
        assert threading.get_ident() == loop_thread and loop_thread not in writers and writers
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b <= lock_ends]
        assert max(gaps) < sqlite_module.BUSY_TIMEOUT_MS / 1000 / 2, max(gaps)  # no write's wait on the loop
        await wait_until(lambda: _true(hub.live(message_id) is None))  # written once the lock went
        assert store.get(message_id).status == "complete"
        assert (await client.post("/v1/messages", json=anthropic("hi"))).status_code == 200


async def test_a_resume_on_another_server_sharing_the_store_says_where_the_stream_is(tmp_path):
    """Two servers on one SQLite store (no Redis): a message generating on one is resumed on the
    other, which has no log of it: the 410 says so, not that its log expired."""
    config = fake_config(tmp_path, engine={"slots": 1})
    async with running_server(config, step_seconds=0.05) as first, running_server(config) as second, \
            httpx.AsyncClient(timeout=30) as client:
        created = (await client.post(f"{first.urls[0]}/v1/messages", json=anthropic(LONG_ECHO), headers=ASYNC)).json()
        message_id = created["id"]
        resp = await client.get(f"{second.urls[0]}/v1/messages/{message_id}/stream",
                                headers={"Last-Event-ID": f"{message_id}:0"})
        assert resp.status_code == 410, resp.text
        said = resp.json()["error"]["message"]
        assert said.startswith(f"{message_id} is generating on another server that shares this message store")
        assert "expired" not in said
        stored = await client.get(f"{second.urls[0]}/v1/messages/{message_id}")
        assert stored.status_code == 200 and stored.json()["status"] in ("queued", "generating")
        await client.post(f"{first.urls[0]}/v1/messages/{message_id}/cancel")
