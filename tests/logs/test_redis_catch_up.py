"""A resume on one replica naming an event the owner sent before its flush reached this replica's
copy: the copy is given a bounded time to catch up (``logs.wait_until_holds``, ``RedisLogStore.find``),
and the memory backend still refuses such an id at once. Deterministic: Trio's autojump clock, no
redis-server (a copy is put in the store by hand, as ``RedisLogStore.find`` would after its XRANGE)."""

from __future__ import annotations

import pytest
import trio

from ringserve.config import StreamConfig
from ringserve.core.ringlog import LogState, RingLog
from ringserve.logs.memory import MemoryLogStore, MemoryMessageLog, holds, wait_until_holds

pytest.importorskip("coredis", reason="the redis extra is not installed (pip install 'ringserve[redis]')")

from ringserve.logs.redis import CATCH_UP_SECONDS, RedisLogStore  # noqa: E402

FLUSH_MS = 25.0
BOUND = 2 * FLUSH_MS / 1000 + CATCH_UP_SECONDS


def _log(entries: int) -> MemoryMessageLog:
    log = MemoryMessageLog("m", RingLog(64, 1 << 16), clock=lambda: 0.0)
    for i in range(entries):
        log.append(b"data: %d\n\n" % i)
    return log


def test_holds_is_false_only_for_an_open_log_behind_the_id() -> None:
    log = _log(3)  # seqs 0..2
    assert holds(log, None) and holds(log, 0) and holds(log, 2)
    assert not holds(log, 3) and not holds(log, 10)
    log.close(LogState.FINISHED)
    assert holds(log, 10)  # closed: nothing more will come, the caller decides


async def test_wait_until_holds_returns_when_the_entry_arrives(autojump_clock) -> None:
    log = _log(3)
    async with trio.open_nursery() as nursery:
        async def arrive() -> None:
            await trio.sleep(0.03)
            log.append(b"data: 3\n\n")
            await trio.sleep(0.03)
            log.append(b"data: 4\n\n")
        nursery.start_soon(arrive)
        start = trio.current_time()
        assert await wait_until_holds(log, 4, BOUND)
        assert trio.current_time() - start == pytest.approx(0.06)


async def test_wait_until_holds_gives_up_after_the_bound_and_returns_at_once_when_held(autojump_clock) -> None:
    log = _log(3)
    start = trio.current_time()
    assert not await wait_until_holds(log, 3, BOUND)
    assert trio.current_time() - start == pytest.approx(BOUND)
    start = trio.current_time()
    assert await wait_until_holds(log, 2, BOUND)
    assert trio.current_time() == start
    async with trio.open_nursery() as nursery:
        async def close() -> None:
            await trio.sleep(0.01)
            log.close(LogState.FAILED)
        nursery.start_soon(close)
        assert await wait_until_holds(log, 7, BOUND)  # the close ends the wait; the id was never sent
        assert trio.current_time() - start == pytest.approx(0.01)


def _redis_store_with_copy(entries: int) -> tuple[RedisLogStore, MemoryMessageLog]:
    """A store (never run: nothing here talks to Redis) holding a copy of another replica's log."""
    store = RedisLogStore(StreamConfig(flush_ms=FLUSH_MS), "redis://127.0.0.1:1/0")
    copy = _log(entries)
    store._remote["m"] = copy
    return store, copy


async def test_find_waits_for_a_copy_behind_the_resume_id_and_keeps_it_from_the_pump_meanwhile(autojump_clock):
    store, copy = _redis_store_with_copy(3)
    async with trio.open_nursery() as nursery:
        async def pump() -> None:  # what the pump does meanwhile: prune, then deliver the owner's flush
            await trio.sleep(0.01)
            store._prune()
            await trio.sleep(0.02)
            copy.append(b"data: 3\n\n")
            store._prune()
        nursery.start_soon(pump)
        start = trio.current_time()
        found = await store.find("m", 3)
        assert found is copy and holds(copy, 3)
        assert trio.current_time() - start == pytest.approx(0.03)
    # nothing was awaited since: the caller's reader enters while the copy is still tailed
    assert store._remote.get("m") is copy and not store._waiting
    store._prune()
    assert "m" not in store._remote  # no reader came: the next pump round lets it go


async def test_find_returns_a_copy_still_behind_after_the_bound(autojump_clock):
    store, copy = _redis_store_with_copy(3)
    start = trio.current_time()
    found = await store.find("m", 5)  # never sent: the hub answers 400 once find returns
    assert found is copy and not holds(copy, 5)
    assert trio.current_time() - start == pytest.approx(BOUND)
    start = trio.current_time()
    assert await store.find("m", 2) is copy and await store.find("m", None) is copy
    assert trio.current_time() == start  # held: no wait


async def test_find_does_not_wait_for_a_log_this_replica_owns(autojump_clock):
    store = RedisLogStore(StreamConfig(flush_ms=FLUSH_MS), "redis://127.0.0.1:1/0")
    owned = store.create("m")
    start = trio.current_time()
    assert await store.find("m", 0) is owned
    assert trio.current_time() == start


async def test_the_memory_backend_does_not_wait(autojump_clock):
    store = MemoryLogStore(StreamConfig())
    log = store.create("m")
    log.append(b"data: 0\n\n")
    start = trio.current_time()
    assert await store.find("m", 5) is log
    assert trio.current_time() == start
    with pytest.raises(ValueError):
        log.read_from(5, limit=0)  # Resume.open_log: 400 "never sent", at once
