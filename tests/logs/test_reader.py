"""logs/reader.py: tail() replays, follows live, pings, ends, and reports lag."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio
import trio.testing

from ringserve.core.ringlog import LogState, RingLog, format_event_id
from ringserve.core.sse import SSEParser, encode_comment, encode_event
from ringserve.logs.memory import MemoryMessageLog
from ringserve.logs.reader import ReaderLagged, tail

PING = encode_comment("ping")


def make_log(max_entries: int = 64, max_bytes: int = 64 * 1024) -> MemoryMessageLog:
    return MemoryMessageLog("msg_1", RingLog(max_entries, max_bytes))


def append_event(log: MemoryMessageLog, text: str) -> int:
    seq = log.next_seq
    data = encode_event(text, event="delta", id=format_event_id(log.message_id, seq))
    assert log.append(data) == seq
    return seq


def entries(chunks: list[bytes]) -> int:
    """How many entries ``chunks`` hold (each starts with its ``id:`` line)."""
    return b"".join(chunks).count(b"id: ")


def held(log: MemoryMessageLog) -> list[bytes]:
    """The bytes of every entry the log holds, one item per entry."""
    got = log.read_from(None)
    assert isinstance(got, list)
    return [e.data for e in got]


async def collect(log: MemoryMessageLog, after: int | None, **kwargs: object) -> list[bytes]:
    kwargs.setdefault("heartbeat_interval", 15.0)
    out: list[bytes] = []
    async with aclosing(tail(log, after, **kwargs)) as chunks:  # type: ignore[arg-type]
        async for chunk in chunks:
            out.append(chunk)
    return out


async def test_replay_then_live_then_end(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    for i in range(3):
        append_event(log, f"old {i}")
    got: list[bytes] = []
    n_replayed = trio.Event()

    async def consume() -> None:
        async with aclosing(tail(log, None, heartbeat_interval=15)) as chunks:
            async for chunk in chunks:
                got.append(chunk)
                n_replayed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await n_replayed.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert len(got) == 1 and entries(got) == 3  # the replay in one chunk
        append_event(log, "new 3")
        await trio.testing.wait_all_tasks_blocked()
        assert len(got) == 2  # delivered live, without waiting for a heartbeat
        append_event(log, "new 4")
        log.close(LogState.FINISHED)  # the reader still drains the last entry, then ends
    events = SSEParser().feed(b"".join(got))
    assert [e.data for e in events] == ["old 0", "old 1", "old 2", "new 3", "new 4"]
    assert [e.id for e in events] == [f"msg_1:{i}" for i in range(5)]
    assert trio.current_time() == 0  # no heartbeat needed: nothing waited 15 s


async def test_resume_from_the_middle_is_byte_identical(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    for i in range(10):
        append_event(log, f"token {i}\nline two")
    log.close(LogState.FINISHED)
    full = held(log)
    assert await collect(log, None) == [b"".join(full)]  # read at once: one chunk
    for after in range(-1, 10):
        assert b"".join(await collect(log, after)) == b"".join(full[after + 1 :])
    # batch size does not change the bytes, only the chunks
    batched = await collect(log, None, batch=3)
    assert b"".join(batched) == b"".join(full) and [entries([c]) for c in batched] == [3, 3, 3, 1]


async def test_resume_while_live_returns_exactly_the_rest(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()

    async def produce() -> None:
        for i in range(20):
            append_event(log, f"t{i}")
            await trio.sleep(0.5)
        log.close(LogState.FINISHED)

    results: dict[str, list[bytes]] = {}

    async def read(name: str, after: int | None, start_at: float) -> None:
        await trio.sleep(start_at)
        results[name] = await collect(log, after, heartbeat_interval=1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        nursery.start_soon(read, "full", None, 0.0)
        nursery.start_soon(read, "resumed", 6, 4.2)  # joins mid-stream, with id msg_1:6
    full, resumed = results["full"], results["resumed"]
    assert PING not in full  # entries every 0.5 s, interval 1 s
    assert b"".join(full) == b"".join(held(log))
    assert b"".join(resumed) == b"".join(held(log)[7:])


async def test_heartbeats_while_silent(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    got: list[tuple[float, bytes]] = []
    beats: list[float] = []

    async def consume() -> None:
        async with aclosing(
            tail(log, None, heartbeat_interval=1, on_heartbeat=lambda: beats.append(trio.current_time()))
        ) as chunks:
            async for chunk in chunks:
                got.append((trio.current_time(), chunk))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.sleep(5)  # the log is silent for 5 s of (autojump) time
        append_event(log, "finally")
        log.close(LogState.FINISHED)

    chunks = [c for _, c in got]
    first_entry = next(i for i, c in enumerate(chunks) if c != PING)
    assert first_entry >= 4
    assert set(chunks[:first_entry]) == {PING}
    assert len(beats) == first_entry  # one on_heartbeat per ping
    assert [t for t, _ in got[:4]] == [1.0, 2.0, 3.0, 4.0]
    assert chunks[first_entry:] == [log.read_from(None)[0].data]  # type: ignore[index]


async def test_heartbeat_timer_restarts_after_output(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    got: list[tuple[float, bytes]] = []

    async def consume() -> None:
        async with aclosing(tail(log, None, heartbeat_interval=2)) as chunks:
            async for chunk in chunks:
                got.append((trio.current_time(), chunk))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.sleep(1.5)
        append_event(log, "a")
        await trio.sleep(2.5)  # silent from 1.5: one ping at 3.5, none at 2.0
        log.close(LogState.FINISHED)
    assert [(t, c == PING) for t, c in got] == [(1.5, False), (3.5, True)]


async def test_ends_after_close_even_when_empty(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()

    async def close_later() -> None:
        await trio.sleep(0.5)
        log.close(LogState.FAILED)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_later)
        assert await collect(log, None, heartbeat_interval=10) == []
    assert trio.current_time() == 0.5


async def test_gap_at_start_raises_reader_lagged(autojump_clock: trio.abc.Clock) -> None:
    log = make_log(max_entries=4)
    for i in range(10):
        append_event(log, str(i))
    with pytest.raises(ReaderLagged) as info:
        await collect(log, 2)
    assert (info.value.gap.after, info.value.gap.first_available) == (2, 6)
    assert "3 missing" in str(info.value)
    assert entries(await collect_until_blocked(log, 5)) == 4  # within the window: fine


async def collect_until_blocked(log: MemoryMessageLog, after: int | None) -> list[bytes]:
    out: list[bytes] = []
    with trio.move_on_after(0.1):
        async with aclosing(tail(log, after, heartbeat_interval=10)) as chunks:
            async for chunk in chunks:
                out.append(chunk)
    return out


async def test_slow_reader_falls_behind_and_lags(autojump_clock: trio.abc.Clock) -> None:
    log = make_log(max_entries=4)
    got: list[bytes] = []
    with pytest.raises(ReaderLagged) as info:
        async with aclosing(tail(log, None, heartbeat_interval=10)) as chunks:
            for i in range(3):
                append_event(log, str(i))
            got.append(await chunks.__anext__())  # took seqs 0..2
            for i in range(3, 12):
                append_event(log, str(i))  # ring now holds 8..11
            async for chunk in chunks:
                got.append(chunk)
    # seqs 0..2 were read in the first batch, one chunk; 3..7 are gone
    assert len(got) == 1 and entries(got) == 3
    assert (info.value.gap.after, info.value.gap.first_available) == (2, 8)


async def test_future_id_is_a_value_error() -> None:
    log = make_log()
    append_event(log, "x")
    with pytest.raises(ValueError, match="future"):
        await collect(log, 1)


async def test_cancel_and_aclose_leave_the_log_untouched(autojump_clock: trio.abc.Clock) -> None:
    log = make_log()
    append_event(log, "a")
    idle: list[int] = []
    log.on_idle = lambda: idle.append(1)

    # cancelled while parked
    with trio.move_on_after(3):
        with log.reader():
            await collect(log, None, heartbeat_interval=100)
    assert idle == [1] and log.readers == 0

    # the consumer stops early (client gone): aclosing finalizes at once
    with log.reader():
        async with aclosing(tail(log, None, heartbeat_interval=100)) as chunks:
            async for _chunk in chunks:
                break
    assert idle == [1, 1]
    assert log.next_seq == 1 and not log.closed
    append_event(log, "b")
    log.close(LogState.FINISHED)
    assert entries(await collect(log, None)) == 2


async def test_bad_heartbeat_interval() -> None:
    with pytest.raises(ValueError):
        await collect(make_log(), None, heartbeat_interval=0)
