"""logs/memory.py: MemoryMessageLog wake-ups and readers, MemoryLogStore cap and TTL."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ringserve.config import StreamConfig
from ringserve.core.ringlog import Entry, LogState, LogStateError, RingLog
from ringserve.logs.memory import LogStoreStatistics, MemoryLogStore, MemoryMessageLog


def make_log(message_id: str = "m") -> MemoryMessageLog:
    return MemoryMessageLog(message_id, RingLog(16, 1024))


def small_config(**changes: object) -> StreamConfig:
    base = {"ring_max_entries": 8, "ring_max_bytes": 100, "memory_cap_bytes": 1000, "ttl_seconds": 60.0}
    base.update(changes)
    return StreamConfig(**base)  # type: ignore[arg-type]


async def test_readers_park_and_wake_on_append(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    woke: list[tuple[str, float]] = []

    async def wait(name: str, after: int | None) -> None:
        await log.wait_for_entries(after)
        woke.append((name, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "a", None)
        nursery.start_soon(wait, "b", None)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []  # parked, not polling
        await trio.sleep(3)
        assert woke == []
        log.append(b"one")
    assert sorted(woke) == [("a", 3.0), ("b", 3.0)]
    assert log.read_from(None) == [Entry(0, b"one")]

    # caught up at 0: waits for seq 1; not at once
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "c", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert len(woke) == 2
        log.append(b"two")
    assert woke[-1][0] == "c"

    # already something after `after`: returns at once (with a checkpoint)
    with trio.testing.assert_checkpoints():
        await log.wait_for_entries(0)
    with pytest.raises(ValueError, match="future"):
        await log.wait_for_entries(2)


async def test_close_wakes_readers_and_later_waits_return(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    log.append(b"x")
    done = trio.Event()

    async def wait() -> None:
        await log.wait_for_entries(0)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        log.close(LogState.FINISHED)
    assert done.is_set()
    assert log.completed_at == trio.current_time()
    with trio.testing.assert_checkpoints():
        await log.wait_for_entries(0)  # closed: no waiting
    with pytest.raises(LogStateError):
        log.append(b"late")


async def test_wait_is_cancellable(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    with trio.move_on_after(5) as scope:
        await log.wait_for_entries(None)
    assert scope.cancelled_caught
    assert log.next_seq == 0 and not log.closed
    log.append(b"a")  # still works after an abandoned wait
    await log.wait_for_entries(None)


async def test_reader_count_and_on_idle() -> None:
    log = make_log()
    idle: list[int] = []
    log.on_idle = lambda: idle.append(log.readers)
    with log.reader():
        assert log.readers == 1
        with log.reader():
            assert log.readers == 2
        assert idle == []
    assert idle == [0]
    assert log.readers == 0
    # leaving by an exception (e.g. Cancelled) still counts down
    with pytest.raises(KeyError):
        with log.reader():
            raise KeyError("boom")
    assert idle == [0, 0] and log.readers == 0


async def test_store_create_get_forget() -> None:
    store = MemoryLogStore(small_config())
    log = store.create("a")
    assert store.get("a") is log
    assert store.get("nope") is None and not store.evicted("nope")
    with pytest.raises(ValueError, match="already exists"):
        store.create("a")
    store.forget("a")
    assert store.get("a") is None and store.evicted("a")
    store.forget("a")  # no-op
    # the producer's handle keeps working; the store no longer counts it
    log.append(b"1234")
    assert store.statistics().bytes == 0
    assert store.create("a") is not log  # an id can come back
    assert not store.evicted("a")


async def test_memory_cap_evicts_completed_oldest_first_never_live(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = MemoryLogStore(small_config(memory_cap_bytes=250, ring_max_bytes=100))
    live = store.create("live")
    live.append(b"L" * 100)
    old = store.create("old")
    new = store.create("new")
    old.append(b"o" * 60)
    new.append(b"n" * 60)
    await trio.sleep(1)
    old.close(LogState.FINISHED)
    await trio.sleep(1)
    new.close(LogState.FAILED)
    assert store.statistics().bytes == 220

    # 40 more bytes: 260 > 250 -> the oldest completed log goes, and only it
    third = store.create("third")
    third.append(b"t" * 40)
    assert store.get("old") is None and store.evicted("old")
    assert store.get("new") is new and store.get("live") is live
    assert store.statistics().bytes == 200
    assert store.statistics().evictions_total == 1
    assert old.read_from(None) == [Entry(0, b"o" * 60)]  # a holder still reads it

    # more live bytes: "new" goes, then nothing completed is left; live ones stay over the cap
    third.append(b"t" * 60)
    live.append(b"L" * 100)  # its ring drops the first 100 B: live stays at 100
    fourth = store.create("fourth")
    fourth.append(b"f" * 100)
    assert store.get("new") is None and store.evicted("new")
    stats = store.statistics()
    assert stats.bytes == 300 > stats.memory_cap_bytes
    assert stats.live_logs == stats.logs == 3
    assert stats.evictions_total == 2
    assert {m for m in ("live", "third", "fourth") if store.get(m) is not None} == {
        "live",
        "third",
        "fourth",
    }

    # the moment a live log completes and the total is over, it is eligible
    third.close(LogState.FINISHED)
    assert store.get("third") is None and store.evicted("third")
    assert store.statistics().bytes == 200


async def test_ttl_expiry_and_evicted(autojump_clock: trio.abc.Clock) -> None:
    store = MemoryLogStore(small_config(ttl_seconds=10.0))
    a = store.create("a")
    b = store.create("b")
    live = store.create("live")
    a.append(b"aa")
    b.append(b"bb")
    live.append(b"ll")
    a.close(LogState.FINISHED)
    await trio.sleep(5)
    b.close(LogState.FINISHED)
    await trio.sleep(4.9)
    assert store.expire() == 0
    await trio.sleep(0.1)  # a is 10 s old
    assert store.expire() == 1
    assert store.get("a") is None and store.evicted("a")
    assert store.get("b") is b and not store.evicted("b")
    await trio.sleep(100)
    assert store.get("live") is live  # live logs never expire
    # get() does not hand out a log past its TTL even before a sweep
    assert store.get("b") is None and store.evicted("b")
    stats = store.statistics()
    assert (stats.expirations_total, stats.logs, stats.bytes) == (2, 1, 2)


async def test_sweep_loop(autojump_clock: trio.abc.Clock) -> None:
    store = MemoryLogStore(small_config(ttl_seconds=3.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        log = store.create("a")
        log.close(LogState.FINISHED)
        closed_at = trio.current_time()
        while "a" in store._logs:  # watch the dict, not get(), which would expire it itself
            await trio.sleep(0.25)
        assert 3.0 <= trio.current_time() - closed_at <= 4.0
        assert store.evicted("a")
        assert store.statistics().expirations_total == 1
        nursery.cancel_scope.cancel()


def test_evicted_memory_is_bounded() -> None:
    store = MemoryLogStore(small_config(), clock=lambda: 0.0, remember_gone=3)
    for i in range(5):
        store.create(str(i))
        store.forget(str(i))
    assert [store.evicted(str(i)) for i in range(5)] == [False, False, True, True, True]


async def test_the_gone_ids_remembered_are_those_of_the_last_ttl(autojump_clock: trio.abc.Clock) -> None:
    """Ten messages a second for 100 s, a TTL of 10 s: the store remembers the ids it let go of
    in the last 10 s (a Redis stream expires by then), about 100, not the 900 of its life."""
    store = MemoryLogStore(small_config(ttl_seconds=10.0))
    for i in range(1000):
        store.create(str(i)).close(LogState.FINISHED)
        store.expire()
        await trio.sleep(0.1)
    store.expire()
    assert len(store._logs) <= 101 and len(store._gone) <= 101
    assert store.evicted("880") and not store.evicted("10")


async def test_freed_memory_is_given_back_once_no_log_is_live() -> None:
    """20 MiB of entries leave a live log's ring: no trim while it is live; one at the sweep after
    it ended; none again until another 16 MiB (heap.TRIM_AFTER_BYTES) are let go of."""
    trims: list[int] = []
    store = MemoryLogStore(small_config(ring_max_bytes=1 << 20, memory_cap_bytes=1 << 30),
                           trim=lambda: trims.append(1))  # (on a worker thread)
    log = store.create("a")
    for _ in range(20):
        log.append(b"x" * (1 << 20))
    await store._trim_when_idle()
    assert trims == []  # 19 MiB left the ring, but the log is live
    log.close(LogState.FINISHED)
    await store._trim_when_idle()
    assert trims == [1]
    store.forget("a")  # its last MiB: not enough for another
    await store._trim_when_idle()
    assert trims == [1]


async def test_statistics_snapshot(autojump_clock: trio.abc.Clock) -> None:
    store = MemoryLogStore(small_config(ring_max_entries=8, ring_max_bytes=1000))
    a = store.create("a")
    b = store.create("b")
    for _ in range(10):
        a.append(b"12345")
    b.append(b"xy")
    b.close(LogState.FINISHED)
    with a.reader(), a.reader(), b.reader():
        stats = store.statistics()
    assert isinstance(stats, LogStoreStatistics)
    assert stats == LogStoreStatistics(
        logs=2,
        live_logs=1,
        readers=3,
        entries=9,
        bytes=42,
        memory_cap_bytes=1000,
        appends_total=11,
        append_bytes_total=52,
        entries_evicted_total=2,
        evictions_total=0,
        expirations_total=0,
        append_seconds_total=stats.append_seconds_total,
        last_append_seconds=stats.last_append_seconds,
    )
    assert stats.append_seconds_total >= stats.last_append_seconds >= 0
    with pytest.raises(AttributeError):
        stats.logs = 5  # type: ignore[misc]  # frozen
    assert store.statistics().readers == 0  # a snapshot, not a live view
    assert stats.readers == 3
