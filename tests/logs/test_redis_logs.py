"""logs/redis.py against a real redis-server: owned logs mirrored to Redis streams with one
pipelined round trip per flush, remote copies tailed by one shared pump, gaps, close and expiry."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from ringserve.config import StreamConfig
from ringserve.core.ringlog import Gap, LogState
from tests.support.redis_server import RedisServer, needs_redis, redis_server  # noqa: F401 (fixture)

coredis = pytest.importorskip("coredis", reason="the redis extra is not installed (pip install 'ringserve[redis]')")

from ringserve.logs.redis import (  # noqa: E402
    MESSAGE_PREFIX,
    WRITER_CONNECTIONS,
    MirroredMessageStore,
    RedisCluster,
    RedisLogStore,
    stream_key,
)

pytestmark = needs_redis


@asynccontextmanager
async def stores(url: str, count: int = 2, **config: object) -> AsyncIterator[list[RedisLogStore]]:
    """``count`` replicas' stores on one Redis, running."""
    cfg = attrs.evolve(StreamConfig(), **config)
    async with trio.open_nursery() as nursery:
        made = []
        for _ in range(count):
            store = RedisLogStore(cfg, url)
            await nursery.start(store.run)
            made.append(store)
        yield made
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def redis(url: str) -> AsyncIterator[coredis.Redis]:
    client = coredis.Redis.from_url(url)
    async with client:
        yield client


async def until(predicate, timeout: float = 10.0) -> None:
    """Wait for a fact about Redis or a log (polled: Redis tells nobody)."""
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.01)


async def read_all(log, after=None) -> list[bytes]:
    out = []
    while True:
        got = log.read_from(after)
        assert not isinstance(got, Gap)
        for entry in got:
            out.append(entry.data)
            after = entry.seq
        if not got and log.closed:
            return out
        if not got:
            await log.wait_for_entries(after)


async def test_a_log_written_on_one_replica_is_read_on_another_byte_for_byte(redis_server):
    async with stores(redis_server.url) as (a, b):
        owned = a.create("m1")
        sent = [b"data: %d\n\n" % i for i in range(5)]
        for data in sent[:3]:
            owned.append(data)
        async with redis(redis_server.url) as client:
            await until(lambda: _xlen(client, "m1", 3))
        copy = await b.find("m1")
        assert copy is not None and copy is not owned and not copy.closed
        assert [e.data for e in copy.read_from(None)] == sent[:3]
        with copy.reader():
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def reader() -> None:
                    got.extend(await read_all(copy))

                nursery.start_soon(reader)
                for data in sent[3:]:
                    owned.append(data)
                owned.close(LogState.FAILED)
        assert got == sent and copy.state is LogState.FAILED and copy.next_seq == owned.next_seq
        assert await b.find("m1") is not copy  # an ended copy is not kept: the next resume reloads it
        assert await b.find("nobody") is None and await a.find("m1") is owned


async def _xlen(client, message_id: str, n: int) -> bool:
    return await client.xlen(stream_key(message_id)) == n


async def test_appends_of_every_stream_go_in_one_round_trip_per_flush(redis_server):
    async with stores(redis_server.url, count=1, flush_ms=50.0) as (a,):
        logs = [a.create(f"m{i}") for i in range(20)]
        for i in range(10):
            for log in logs:
                log.append(b"data: %d\n\n" % i)  # 200 appends, all before the flusher runs
        async with redis(redis_server.url) as client:
            for i in range(20):
                await until(lambda i=i: _xlen(client, f"m{i}", 10))
            assert a.round_trips_total == 1
            entries = await client.xrange(stream_key("m7"), "-", "+")
            assert [e.identifier for e in entries] == [b"%d-0" % (i + 1) for i in range(10)]  # id = seq + 1


async def test_a_reader_behind_what_redis_kept_gets_a_gap(redis_server):
    # ring_max_entries 8 with MAXLEN ~: Redis trims whole nodes (4 entries each here), keeping >= 8.
    async with stores(redis_server.url, ring_max_entries=8) as (a, b):
        owned = a.create("m1")
        for i in range(40):
            owned.append(b"data: %d\n\n" % i)
        async with redis(redis_server.url) as client:
            await until(lambda: _has_seq(client, "m1", 39))
            first = await client.xrange(stream_key("m1"), "-", "+", count=1)
        copy = await b.find("m1")
        assert copy.first_seq == int(first[0].identifier.split(b"-")[0]) - 1 > 0
        gap = copy.read_from(None)
        assert isinstance(gap, Gap) and gap.first_available == copy.first_seq
        assert [e.seq for e in copy.read_from(copy.first_seq - 1)] == list(range(copy.first_seq, 40))
        # Live: the pump falls behind by more than Redis keeps -> the copy skips ahead.
        with copy.reader():
            for i in range(40, 200):
                owned.append(b"data: %d\n\n" % i)
            with trio.fail_after(10):
                while copy.next_seq < 200:
                    await copy.wait_for_entries(copy.next_seq - 1)
            assert isinstance(copy.read_from(39), Gap)


async def _has_seq(client, message_id: str, seq: int) -> bool:
    last = await client.xrevrange(stream_key(message_id), "+", "-", count=1)
    return bool(last) and last[0].identifier == b"%d-0" % (seq + 1)


async def test_a_closed_log_expires_in_redis_after_ttl_seconds(redis_server):
    async with stores(redis_server.url, ttl_seconds=1.0) as (a, b):
        owned = a.create("m1")
        owned.append(b"data: x\n\n")
        async with redis(redis_server.url) as client:
            await until(lambda: _xlen(client, "m1", 1))
            assert await client.ttl(stream_key("m1")) > 60  # live: kept while the owner writes
            owned.close(LogState.FINISHED)
            await until(lambda: _xlen(client, "m1", 2))  # the terminal marker
            assert 0 < await client.ttl(stream_key("m1")) <= 1
            copy = await b.find("m1")
            assert copy.closed and copy.state is LogState.FINISHED and copy.next_seq == 1
            await until(lambda: _gone(client, "m1"), timeout=5)
        assert await b.find("m1") is None


async def _gone(client, message_id: str) -> bool:
    return not await client.exists([stream_key(message_id)])


async def test_readers_of_many_messages_share_one_pump_and_a_bounded_pool(redis_server):
    async with stores(redis_server.url) as (a, b):
        owned = [a.create(f"m{i}") for i in range(10)]
        for log in owned:
            log.append(b"data: 0\n\n")
        async with redis(redis_server.url) as client:
            for i in range(10):
                await until(lambda i=i: _xlen(client, f"m{i}", 1))
            got: dict[tuple[int, int], list[bytes]] = {}
            async with trio.open_nursery() as nursery:

                async def reader(i: int, j: int) -> None:
                    copy = await b.find(f"m{i}")
                    with copy.reader():
                        got[i, j] = await read_all(copy)

                for i in range(10):
                    for j in range(5):  # 50 readers over 10 messages
                        nursery.start_soon(reader, i, j)
                with trio.fail_after(10):
                    while sum(copy.readers for copy in b._remote.values()) < 50:
                        await trio.sleep(0.01)
                assert len(b._remote) == 10  # one copy per message, however many readers
                clients = await client.client_list()
                # this client + each store's writer pool and pump, whatever the number of readers
                assert len(clients) <= 1 + 2 * (WRITER_CONNECTIONS + 1)
                for i, log in enumerate(owned):
                    log.append(b"data: %d\n\n" % i)
                    log.close(LogState.FINISHED)
        assert got == {(i, j): [b"data: 0\n\n", b"data: %d\n\n" % i] for i in range(10) for j in range(5)}


async def test_a_new_stream_wakes_the_blocked_pump(redis_server, monkeypatch):
    import ringserve.logs.redis as redis_logs

    monkeypatch.setattr(redis_logs, "PUMP_BLOCK_MS", 600_000)  # unwoken, the pump would miss m2 for 10 minutes
    async with stores(redis_server.url) as (a, b):
        first, second = a.create("m1"), a.create("m2")
        first.append(b"data: 1\n\n")
        second.append(b"data: 2\n\n")
        async with redis(redis_server.url) as client:
            await until(lambda: _xlen(client, "m2", 1))
        one = await b.find("m1")
        with one.reader():
            await until(lambda: _is(b._pump_blocked))  # blocked in XREAD on m1 only
            two = await b.find("m2")
            with two.reader():
                second.append(b"data: 3\n\n")
                with trio.fail_after(10):
                    await two.wait_for_entries(0)
                assert [e.data for e in two.read_from(0)] == [b"data: 3\n\n"]


async def _is(value: bool) -> bool:
    return value


async def test_redis_down_gives_503_with_retry_after_and_ready_503_then_recovers(tmp_path, redis_server):
    import httpx

    from tests.support.helpers import ANTHROPIC_BODY
    from tests.support.server import fake_config, running_server

    config = fake_config(tmp_path, stream={"backend": "redis", "redis_url": redis_server.url})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert (await client.get("/ready")).status_code == 200
        assert (await client.post("/v1/messages", json=ANTHROPIC_BODY)).status_code == 200
        redis_server.stop()
        with trio.fail_after(10):
            while (await client.get("/ready")).status_code == 200:
                await trio.sleep(0.05)
        resp = await client.post("/v1/messages", json=ANTHROPIC_BODY)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"]  # the Anthropic error shape
        missing = await client.get("/v1/messages/msg_elsewhere/stream")
        assert missing.status_code == 503 and missing.headers["Retry-After"] == "1"
        restarted = RedisServer(tmp_path, port=redis_server.port)
        try:
            with trio.fail_after(20):
                while (await client.get("/ready")).status_code != 200:
                    await trio.sleep(0.05)
            resp = await client.post("/v1/messages", json=ANTHROPIC_BODY)
            assert resp.status_code == 200 and resp.json()["content"][0]["text"]
        finally:
            restarted.stop()


async def test_readers_on_another_replica_count_on_the_owner_and_their_leaving_makes_it_idle(redis_server):
    async with stores(redis_server.url) as (a, b):
        owned = a.create("m1")
        idle: list[int] = []
        owned.on_idle = lambda: idle.append(owned.readers)
        owned.append(b"data: 0\n\n")
        async with redis(redis_server.url) as client:
            await until(lambda: _xlen(client, "m1", 1))
        copy = await b.find("m1")
        with owned.reader():
            with copy.reader(), copy.reader():
                await until(lambda: _is(owned.readers == 3))
            await until(lambda: _is(owned.readers == 1))
            assert idle == []  # the local reader is still there
        assert idle == [0]
        with copy.reader():
            await until(lambda: _is(owned.readers == 1))
        await until(lambda: _is(idle == [0, 0]))  # the last reader, elsewhere, left


async def test_a_resume_elsewhere_before_the_first_flush_still_finds_the_stream(redis_server):
    async with stores(redis_server.url, flush_ms=25.0) as (a, b):
        owned = a.create("m1")
        owned.append(b"data: 0\n\n")  # queued; the flusher has not sent it yet
        copy = await b.find("m1")
        assert copy is not None and [e.data for e in copy.read_from(None)] == [b"data: 0\n\n"]


async def test_the_pump_recovers_after_redis_restarts_once_its_read_failed(tmp_path, redis_server):
    # Redis comes back only after the pump's XREAD has failed (the tester's kill, ~3 s, restart): a
    # failed read can leave coredis's connection busy for good, and the pump must not reuse it.
    from tests.support.redis_server import RedisServer

    async with stores(redis_server.url) as (a, b):
        owned = a.create("before")
        owned.append(b"data: 0\n\n")
        copy = await b.find("before")
        with copy.reader():
            await until(lambda: _is(b._pump_blocked))  # blocked in XREAD when Redis goes
            redis_server.stop()
            await until(lambda: _is(not b._pump_blocked and not a.available and not b.available))  # the read failed
        restarted = RedisServer(tmp_path, port=redis_server.port)
        try:
            await until(lambda: _is(a.available and b.available), timeout=15)
            owned = a.create("after")
            owned.append(b"data: 1\n\n")
            copy = await b.find("after")
            assert copy is not None
            with copy.reader():
                owned.append(b"data: 2\n\n")
                owned.close(LogState.FINISHED)
                with trio.fail_after(10):
                    got = await read_all(copy)  # tailed by b's pump
            assert got == [b"data: 1\n\n", b"data: 2\n\n"]
        finally:
            restarted.stop()


async def test_a_state_the_owners_sqlite_fails_to_write_still_reaches_the_other_replicas(redis_server, tmp_path):
    """The hub writes a failed snapshot again later; meanwhile the other replicas read it from Redis."""
    import sqlite3

    from ringserve.core.status import MessageStatus
    from ringserve.logs.redis import MirroredMessageStore, RedisCluster
    from ringserve.store.sqlite import StoredMessage
    from tests.http.test_store_server import FailingDb

    async with stores(redis_server.url) as (a, b):
        store = MirroredMessageStore(str(tmp_path / "a.sqlite3")).mirror_to(a)
        store.insert(StoredMessage(id="msg_m", surface="anthropic", model="fake", created=0,
                                   status=MessageStatus.GENERATING, request="{}", request_hash="h"))
        db = FailingDb.install(store, "disk I/O error", reads=False)
        db.failing = True
        with pytest.raises(sqlite3.OperationalError):
            store.update("msg_m", status=MessageStatus.COMPLETE, text="the whole answer", final_seq=9)

        async def seen_on_b() -> bool:
            found = await RedisCluster(b).find_message("msg_m")
            return found is not None and found.status is MessageStatus.COMPLETE

        await until(seen_on_b)
        found = await RedisCluster(b).find_message("msg_m")
        assert (found.text, found.final_seq) == ("the whole answer", 9)
        assert store.statistics().write_failures_total == 1


async def test_an_update_whose_status_hash_is_gone_writes_it_whole_again(redis_server, tmp_path):
    """Redis lost the hash (a restart, an eviction): the next update writes the owner's whole row,
    not only the fields it changed, so the other replicas read a complete message; a hash that
    lacks a field (left by an owner of an older version) reads as none, never as a broken
    message, and is written whole at the next update; a deleted row takes its hash with it and is
    not written back."""
    from ringserve.core.status import MessageStatus
    from ringserve.store.sqlite import StoredMessage

    async with stores(redis_server.url) as (a, b), redis(redis_server.url) as client:
        store = MirroredMessageStore(str(tmp_path / "a.sqlite3")).mirror_to(a, frozenset({"responses"}))
        row = StoredMessage(id="resp_m", surface="responses", model="fake", created=7,
                            status=MessageStatus.GENERATING, request='{"input": "hi"}', request_hash="h")
        store.insert(row)
        cluster = RedisCluster(b)

        async def on_b(**expected: object) -> bool:
            found = await cluster.find_message("resp_m", request=True)
            return found is not None and all(getattr(found, k) == v for k, v in expected.items())

        await until(lambda: on_b(status=MessageStatus.GENERATING))
        await client.delete([MESSAGE_PREFIX + "resp_m"])  # what a restart leaves
        store.update("resp_m", text="so far")
        await until(lambda: on_b(text="so far"))
        found = await cluster.find_message("resp_m", request=True)
        assert found == attrs.evolve(row, text="so far")  # every field, the request body too
        assert (await cluster.find_message("resp_m")).request == ""  # read only when asked for

        # what an owner of an older version left after a restart: only the fields it changed
        await client.delete([MESSAGE_PREFIX + "resp_m"])
        await client.hset(MESSAGE_PREFIX + "resp_m", {"status": '"generating"', "text": '"so far"'})
        assert await cluster.find_message("resp_m") is None
        store.update("resp_m", status=MessageStatus.COMPLETE)
        await until(lambda: on_b(status=MessageStatus.COMPLETE, surface="responses"))
        assert store.delete("resp_m")
        await until(lambda: _no_status(client, "resp_m"))
        trips = a.round_trips_total
        store.update("resp_m", text="late")  # a write after the delete does not bring it back
        # (a flush already under way when the write was queued may end first: wait for the write's own)
        await until(lambda: _is(a.round_trips_total > trips and not a._writer.pending))
        assert await cluster.find_message("resp_m") is None


async def _no_status(client, message_id: str) -> bool:
    return not await client.exists([MESSAGE_PREFIX + message_id])
