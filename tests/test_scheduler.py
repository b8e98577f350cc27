"""core/scheduler.py: the slot state table and every batching decision, driven by hand."""

from __future__ import annotations

import pytest

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.scheduler import (
    TRANSITIONS,
    IllegalTransition,
    Move,
    QueueFull,
    Scheduler,
    SlotState,
)
from ringserve.engine.protocol import SlotFeed


def sched(n_slots=2, n_batch=64, prefill_chunk=16, queue_size=4) -> Scheduler:
    return Scheduler(
        n_slots=n_slots, n_batch=n_batch, prefill_chunk=prefill_chunk, queue_size=queue_size
    )


def prompt(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def run_step(s: Scheduler, token: int = 1000):
    """Plan one step, pretend it decoded, sample ``token`` for every sampling feed."""
    plan = s.plan()
    s.commit(plan)
    for feed in plan.feeds:
        if feed.sample:
            s.on_sampled(feed.slot, token)
    return plan


def drain(s: Scheduler) -> None:
    s.released(s.take_releases())


# -- the state table ---------------------------------------------------------


def test_transition_table_is_the_documented_lifecycle():
    Q, P, D, F, C = (
        SlotState.QUEUED,
        SlotState.PREFILL,
        SlotState.DECODE,
        SlotState.FINISHED,
        SlotState.CANCELLED,
    )
    assert dict(TRANSITIONS) == {
        (Q, Move.ADMIT): P,
        (Q, Move.CANCEL): C,
        (P, Move.PROMPT_DONE): D,
        (P, Move.FINISH): F,
        (P, Move.CANCEL): C,
        (D, Move.FINISH): F,
        (D, Move.CANCEL): C,
    }
    # final states have no way out
    assert not [k for k in TRANSITIONS if k[0] in (F, C)]


def test_illegal_moves_raise_naming_the_state():
    s = sched()
    e = s.enqueue(prompt(3), 5)
    with pytest.raises(IllegalTransition, match="cannot finish in state QUEUED"):
        s.finish(e)
    s.cancel(e)
    with pytest.raises(IllegalTransition, match="cannot cancel in state CANCELLED"):
        s.cancel(e)
    e2 = s.enqueue(prompt(3), 5)
    run_step(s)
    assert e2.state is SlotState.DECODE
    s.finish(e2)
    with pytest.raises(IllegalTransition, match="cannot finish in state FINISHED") as info:
        s.finish(e2)
    assert info.value.state is SlotState.FINISHED and info.value.move is Move.FINISH


def test_sample_before_prompt_is_fed_is_illegal():
    s = sched(prefill_chunk=2)
    e = s.enqueue(prompt(5), 3)
    plan = s.plan()
    s.commit(plan)
    assert plan.feeds == (SlotFeed(0, (0, 1), 0, False),)
    with pytest.raises(IllegalTransition, match="prompt_done in state PREFILL"):
        s.on_sampled(0, 7)
    assert e.state is SlotState.PREFILL


def test_full_lifecycle_positions_and_counts():
    s = sched(n_slots=1, prefill_chunk=4)
    e = s.enqueue(prompt(6), 3, tag="mine")
    assert (e.state, e.slot, e.tag) == (SlotState.QUEUED, None, "mine")

    plan = s.plan()
    assert plan.admitted == (e,) and e.state is SlotState.PREFILL and e.slot == 0
    assert plan.feeds == (SlotFeed(0, (0, 1, 2, 3), 0, False),)
    s.commit(plan)
    assert e.pos == 4

    plan = s.plan()
    assert plan.admitted == ()
    assert plan.feeds == (SlotFeed(0, (4, 5), 4, True),)
    s.commit(plan)
    assert s.on_sampled(0, 42) is e
    assert (e.state, e.pos, e.generated, e.next_token) == (SlotState.DECODE, 6, 1, 42)

    plan = s.plan()
    assert plan.feeds == (SlotFeed(0, (42,), 6, True),)
    s.commit(plan)
    s.on_sampled(0, 43)
    assert (e.pos, e.generated, e.budget_left) == (7, 2, 1)

    s.finish(e)
    assert e.state is SlotState.FINISHED and e.done and not e.live
    assert s.plan().feeds == ()


# -- admission: queue, priority, capacity -------------------------------------


def test_fifo_within_priority_smaller_priority_first():
    s = sched(n_slots=1, queue_size=10)
    a = s.enqueue(prompt(2), 1, priority=1)
    b = s.enqueue(prompt(2), 1, priority=0)
    c = s.enqueue(prompt(2), 1, priority=1)
    d = s.enqueue(prompt(2), 1, priority=0)
    e = s.enqueue(prompt(2), 1, priority=-1)
    assert s.queued() == (e, b, d, a, c)
    assert s.statistics().queue_depth == {-1: 1, 0: 2, 1: 2}

    order = []
    for _ in range(5):
        plan = s.plan()
        (admitted,) = plan.admitted
        order.append(admitted)
        s.commit(plan)
        s.on_sampled(admitted.slot, 9)
        s.finish(admitted)
        drain(s)
    assert order == [e, b, d, a, c]


def test_admission_fills_lowest_free_slots():
    s = sched(n_slots=3)
    es = [s.enqueue(prompt(2), 4) for _ in range(4)]
    plan = s.plan()
    assert plan.admitted == tuple(es[:3])
    assert [e.slot for e in es[:3]] == [0, 1, 2]
    assert es[3].state is SlotState.QUEUED
    s.cancel(es[1])
    drain(s)
    plan = s.plan()
    assert plan.admitted == (es[3],) and es[3].slot == 1


def test_queue_full_counts_free_slots_and_queue_size():
    s = sched(n_slots=1, queue_size=1)
    s.enqueue(prompt(2), 1)  # will take the free slot
    s.enqueue(prompt(2), 1)  # waits
    with pytest.raises(QueueFull) as info:
        s.enqueue(prompt(2), 1)
    err = info.value
    assert isinstance(err, RingserveError)
    assert err.kind is ErrorKind.OVERLOADED and err.status == 529
    assert err.retryable and err.retry_after is not None and err.retry_after > 0
    assert (err.depth, err.capacity) == (2, 2)
    assert "queue is full" in str(err)

    s.plan()  # one admitted, one still waiting: capacity is now queue_size only
    with pytest.raises(QueueFull):
        s.enqueue(prompt(2), 1)


def test_queue_size_zero_only_takes_what_free_slots_hold():
    s = sched(n_slots=2, queue_size=0)
    s.enqueue(prompt(2), 1)
    s.enqueue(prompt(2), 1)
    with pytest.raises(QueueFull):
        s.enqueue(prompt(2), 1)


def test_cancel_while_queued_frees_the_place():
    s = sched(n_slots=1, queue_size=1)
    a = s.enqueue(prompt(2), 1)
    b = s.enqueue(prompt(2), 1)
    s.cancel(b)
    assert b.state is SlotState.CANCELLED
    assert s.queued() == (a,)
    assert s.take_releases() == ()  # it never held a slot
    s.enqueue(prompt(2), 1)  # the place is free again
    assert s.statistics().queued == 2


def test_enqueue_rejects_empty_prompt_and_zero_budget():
    s = sched()
    with pytest.raises(ValueError):
        s.enqueue((), 3)
    with pytest.raises(ValueError):
        s.enqueue(prompt(2), 0)


def test_batch_must_fit_one_token_per_slot():
    with pytest.raises(ValueError, match="n_batch"):
        Scheduler(n_slots=4, n_batch=3, prefill_chunk=2)


# -- batching ----------------------------------------------------------------


def test_big_prompt_never_stalls_decoding_slots_for_more_than_one_chunk():
    s = sched(n_slots=2, n_batch=64, prefill_chunk=8)
    small = s.enqueue(prompt(3), 100)
    run_step(s)  # small's whole prompt, first token sampled
    assert small.state is SlotState.DECODE

    big = s.enqueue(prompt(50, start=100), 5)
    chunks = []
    while big.state is not SlotState.DECODE:
        plan = run_step(s)
        # every step: small gets its one token, big at most one chunk
        assert plan.feeds[0].slot == small.slot and len(plan.feeds[0].tokens) == 1
        big_feeds = [f for f in plan.feeds if f.slot == big.slot]
        assert len(big_feeds) == 1 and len(big_feeds[0].tokens) <= 8
        chunks.append(big_feeds[0])
    assert [len(f.tokens) for f in chunks] == [8, 8, 8, 8, 8, 8, 2]
    assert [f.sample for f in chunks] == [False] * 6 + [True]
    assert sum((f.tokens for f in chunks), ()) == prompt(50, start=100)
    assert [f.pos for f in chunks] == [0, 8, 16, 24, 32, 40, 48]
    assert small.generated == 1 + 7


def test_batch_budget_caps_prefill_oldest_first():
    s = sched(n_slots=4, n_batch=10, prefill_chunk=6)
    d1 = s.enqueue(prompt(2), 50)
    d2 = s.enqueue(prompt(2), 50)
    run_step(s)
    assert d1.state is d2.state is SlotState.DECODE

    p1 = s.enqueue(prompt(20), 5)
    p2 = s.enqueue(prompt(20), 5)
    plan = s.plan()
    assert plan.admitted == (p1, p2)
    # 2 decode tokens, then p1 gets a full chunk of 6, p2 the 2 left over
    assert [(f.slot, len(f.tokens), f.sample) for f in plan.feeds] == [
        (d1.slot, 1, True),
        (d2.slot, 1, True),
        (p1.slot, 6, False),
        (p2.slot, 2, False),
    ]
    assert plan.n_tokens == 10


def test_batch_full_with_decodes_skips_prefill_this_step():
    s = sched(n_slots=3, n_batch=3, prefill_chunk=3)
    a = s.enqueue(prompt(1), 9)
    b = s.enqueue(prompt(1), 9)
    run_step(s)
    c = s.enqueue(prompt(4), 9)
    plan = s.plan()
    assert [len(f.tokens) for f in plan.feeds] == [1, 1, 1]
    assert plan.owners == (a, b, c)
    s.commit(plan)
    assert c.pos == 1


def test_plan_is_idempotent_until_commit_so_a_failed_batch_can_be_retried():
    s = sched(n_slots=2, prefill_chunk=4)
    a = s.enqueue(prompt(3), 9)
    b = s.enqueue(prompt(10), 9)
    plan1 = s.plan()
    # decode "failed" for b: finish it, do not commit; a is retried unchanged
    s.finish(b)
    plan2 = s.plan()
    assert plan2.admitted == ()
    assert plan2.feeds == (plan1.feeds[0],)
    s.commit(plan2)
    s.on_sampled(a.slot, 5)
    assert a.state is SlotState.DECODE


def test_commit_skips_requests_cancelled_in_flight():
    s = sched()
    a = s.enqueue(prompt(3), 9)
    plan = s.plan()
    s.cancel(a)  # consumer left while the batch was decoding
    s.commit(plan)
    assert a.pos == 0
    with pytest.raises(RuntimeError, match="holds no request"):
        s.on_sampled(0, 1)


# -- ending and releasing slots ----------------------------------------------


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_cancel_live_request_drains_its_slot_before_reuse(when):
    s = sched(n_slots=1, prefill_chunk=2)
    a = s.enqueue(prompt(4), 9)
    b = s.enqueue(prompt(2), 9)
    run_step(s)
    if when == "decode":
        run_step(s)
        assert a.state is SlotState.DECODE
    else:
        assert a.state is SlotState.PREFILL
    s.cancel(a)
    assert a.state is SlotState.CANCELLED
    st = s.statistics()
    assert (st.slots_busy, st.slots_draining) == (1, 1)
    # slot 0 is draining: b is not admitted until it has been released
    assert s.plan().admitted == ()
    ended = s.take_releases()
    assert ended == (a,)
    assert s.plan().admitted == ()  # handed out, still not released
    s.released(ended)
    plan = s.plan()
    assert plan.admitted == (b,) and b.slot == 0
    assert plan.feeds == (SlotFeed(0, (0, 1), 0, True),)


def test_finish_during_prefill_is_a_failure_path():
    s = sched(prefill_chunk=2)
    a = s.enqueue(prompt(6), 9)
    run_step(s)
    s.finish(a)
    assert a.state is SlotState.FINISHED
    assert [e.slot for e in s.take_releases()] == [0]


def test_release_without_take_is_an_error():
    s = sched()
    a = s.enqueue(prompt(2), 3)
    run_step(s)
    s.finish(a)
    with pytest.raises(RuntimeError, match="without take_releases"):
        s.released([a])


def test_statistics_snapshot():
    s = sched(n_slots=2, prefill_chunk=2, queue_size=5)
    a = s.enqueue(prompt(2), 9)
    s.enqueue(prompt(6), 9)
    s.enqueue(prompt(2), 9, priority=3)
    st0 = s.statistics()
    run_step(s)
    st = s.statistics()
    assert (st.slots_total, st.slots_busy, st.queued) == (2, 2, 1)
    assert st.queue_depth == {3: 1}
    assert (st.prefilling, st.decoding) == (1, 1)
    assert a.state is SlotState.DECODE
    assert st0.queued == 3 and st0.slots_busy == 0  # snapshots do not change later
    with pytest.raises(AttributeError):
        st.queued = 0  # type: ignore[misc]
