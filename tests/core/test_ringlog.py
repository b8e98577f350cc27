"""RingLog: the sans-I/O core of the stream log (sync, no trio)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.ringlog import (
    TRANSITIONS,
    Entry,
    Gap,
    LogState,
    LogStateError,
    RingLog,
    format_event_id,
    parse_event_id,
)


def filled(n: int, *, max_entries: int = 100, max_bytes: int = 10_000) -> RingLog:
    log = RingLog(max_entries, max_bytes)
    for i in range(n):
        log.append(b"e%d" % i)
    return log


def test_seq_is_monotonic_from_zero() -> None:
    log = RingLog(4, 1000)
    assert [log.append(b"x") for _ in range(10)] == list(range(10))
    assert log.next_seq == 10
    assert log.first_seq == 6
    assert log.entry_count == 4


def test_empty_log() -> None:
    log = RingLog(4, 100)
    assert log.read_from(None) == []
    assert (log.next_seq, log.first_seq, log.entry_count, log.nbytes) == (0, 0, 0, 0)
    assert log  # no __len__: an empty log is still truthy
    with pytest.raises(ValueError, match="future"):
        log.read_from(0)


def test_read_from_start_middle_and_caught_up() -> None:
    log = filled(5)
    assert log.read_from(None) == [Entry(i, b"e%d" % i) for i in range(5)]
    assert log.read_from(-1) == log.read_from(None)
    assert log.read_from(2) == [Entry(3, b"e3"), Entry(4, b"e4")]
    assert log.read_from(4) == []  # caught up: "not yet" is a value
    assert log.read_from(0, limit=2) == [Entry(1, b"e1"), Entry(2, b"e2")]
    assert log.read_from(0, limit=0) == []


def test_future_id_and_bad_arguments() -> None:
    log = filled(3)
    with pytest.raises(ValueError, match="future"):
        log.read_from(3)
    with pytest.raises(ValueError, match="future"):
        log.read_from(99)
    with pytest.raises(ValueError):
        log.read_from(-2)
    with pytest.raises(ValueError):
        log.read_from(0, limit=-1)
    with pytest.raises(TypeError):
        log.append("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RingLog(0, 10)
    with pytest.raises(ValueError):
        RingLog(10, 0)


def test_bound_by_entries_and_gap() -> None:
    log = filled(10, max_entries=3)
    assert log.entry_count == 3
    assert [e.seq for e in log.read_from(6)] == [7, 8, 9]  # type: ignore[union-attr]
    assert log.read_from(5) == Gap(after=5, first_available=7)
    gap = log.read_from(None)
    assert gap == Gap(after=-1, first_available=7)
    assert isinstance(gap, Gap) and gap.missing == 7
    assert log.read_from(3, limit=0) == Gap(after=3, first_available=7)
    assert log.evicted_total == 7


def test_bound_by_bytes() -> None:
    log = RingLog(100, 10)
    for _ in range(5):
        log.append(b"abcd")  # 4 bytes each: at most two fit in 10
    assert log.nbytes == 8
    assert [e.seq for e in log.read_from(2)] == [3, 4]  # type: ignore[union-attr]
    assert log.read_from(1) == Gap(after=1, first_available=3)


def test_oversized_entry_is_kept_alone() -> None:
    log = RingLog(100, 10)
    log.append(b"ab")
    seq = log.append(b"x" * 50)
    assert log.read_from(None) == Gap(after=-1, first_available=seq)
    assert log.read_from(0) == [Entry(1, b"x" * 50)]
    assert log.entry_count == 1 and log.nbytes == 50
    log.append(b"cd")  # the big one leaves as soon as something else arrives
    assert log.read_from(1) == [Entry(2, b"cd")]
    assert log.nbytes == 2


def test_wrap_around_reads_are_contiguous() -> None:
    log = filled(13, max_entries=5)  # holds 8..12; slots wrap at 10
    assert [e.seq for e in log.read_from(7)] == [8, 9, 10, 11, 12]  # type: ignore[union-attr]
    assert [e.seq for e in log.read_from(8, limit=3)] == [9, 10, 11]  # type: ignore[union-attr]
    assert [e.data for e in log.read_from(10)] == [b"e11", b"e12"]  # type: ignore[union-attr]


def test_state_table() -> None:
    assert TRANSITIONS[LogState.OPEN] == {LogState.FINISHED, LogState.FAILED}
    for final in (LogState.FINISHED, LogState.FAILED):
        log = filled(2)
        assert not log.closed and log.state is LogState.OPEN
        log.close(final)
        assert log.closed and log.state is final
        assert [e.seq for e in log.read_from(None)] == [0, 1]  # type: ignore[union-attr]
        with pytest.raises(LogStateError, match="append") as info:
            log.append(b"late")
        assert info.value.state is final and info.value.target is None
        for target in LogState:
            with pytest.raises(LogStateError) as info:
                log.close(target)
            assert final.name in str(info.value) and target.name in str(info.value)
    log = RingLog(4, 100)
    with pytest.raises(LogStateError, match="OPEN -> OPEN"):
        log.close(LogState.OPEN)


def test_event_ids() -> None:
    assert format_event_id("msg_1", 41) == "msg_1:41"
    assert parse_event_id("msg_1:41", "msg_1") == 41
    assert parse_event_id("a:b:7", "a:b") == 7
    assert parse_event_id("msg_1:0", "msg_1") == 0
    for bad in ("msg_1", "msg_1:", "msg_1:-1", "msg_1:+3", "msg_1:4x", "msg_1:١",
                "msg_1:01", "msg_1:00", "msg_1: 1", "msg_1:1 1", "msg_1:1_0"):
        with pytest.raises(ValueError, match="malformed"):
            parse_event_id(bad, "msg_1")
    with pytest.raises(ValueError, match="another|does not belong"):
        parse_event_id("msg_2:3", "msg_1")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 12)),
        st.tuples(st.just("read"), st.integers(0, 6)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(
    max_entries=st.integers(1, 8),
    max_bytes=st.integers(1, 40),
    ops=ops,
    probe=st.integers(-1, 300),
)
def test_random_appends_and_reads_never_skip_or_repeat(
    max_entries: int, max_bytes: int, ops: list[tuple[str, int]], probe: int
) -> None:
    log = RingLog(max_entries, max_bytes)
    model: list[bytes] = []  # every entry ever appended, by seq
    cursor = -1  # a reader that follows along with random batch sizes
    delivered: list[int] = []
    for op, arg in ops:
        if op == "append":
            data = bytes([len(model) % 256]) * arg
            assert log.append(data) == len(model)
            model.append(data)
        else:
            got = log.read_from(cursor, arg)
            if isinstance(got, Gap):
                assert got.after == cursor
                assert got.first_available == log.first_seq > cursor + 1
                cursor = got.first_available - 1  # skip the lost ones, knowingly
                continue
            assert [e.seq for e in got] == list(range(cursor + 1, cursor + 1 + len(got)))
            assert len(got) == min(arg, log.next_seq - cursor - 1)
            for e in got:
                assert e.data == model[e.seq]
                delivered.append(e.seq)
            if got:
                cursor = got[-1].seq
        # invariants after every step
        assert log.next_seq == len(model)
        assert log.entry_count <= max_entries
        assert log.nbytes == sum(len(model[s]) for s in range(log.first_seq, log.next_seq))
        assert log.nbytes <= max_bytes or log.entry_count == 1
        if model:  # the newest entry is always held
            assert log.entry_count >= 1
            assert log.read_from(log.next_seq - 2) == [Entry(log.next_seq - 1, model[-1])]
        held = log.read_from(None) if log.first_seq == 0 else log.read_from(log.first_seq - 1)
        assert isinstance(held, list)
        assert [e.seq for e in held] == list(range(log.first_seq, log.next_seq))
    assert delivered == sorted(set(delivered))  # no seq delivered twice, in order
    # an arbitrary probe id answers consistently
    if probe >= log.next_seq:
        with pytest.raises(ValueError):
            log.read_from(probe)
    elif probe + 1 < log.first_seq:
        assert log.read_from(probe) == Gap(probe, log.first_seq)
    else:
        assert [e.seq for e in log.read_from(probe)] == list(  # type: ignore[union-attr]
            range(probe + 1, log.next_seq)
        )


def test_skip_to_drops_what_is_held_and_goes_on_at_the_new_seq_across_the_wrap():
    ring = RingLog(max_entries=4, max_bytes=1000)
    ring.append(b"a")
    ring.skip_to(6)  # slot 6 % 4 = 2: the slots before it stay unused until the wrap
    assert (ring.first_seq, ring.next_seq, ring.entry_count, ring.nbytes, ring.evicted_total) == (6, 6, 0, 0, 1)
    assert [ring.append(bytes([c])) for c in b"wxyz"] == [6, 7, 8, 9]  # wraps at 8
    assert [(e.seq, e.data) for e in ring.read_from(5)] == [(6, b"w"), (7, b"x"), (8, b"y"), (9, b"z")]
    assert ring.read_from(4) == Gap(after=4, first_available=6)
    ring.append(b"!")  # evicts 6
    assert [e.seq for e in ring.read_from(6)] == [7, 8, 9, 10]
    with pytest.raises(ValueError):
        ring.skip_to(3)
    ring.close(LogState.FINISHED)
    with pytest.raises(LogStateError):
        ring.skip_to(20)
