"""core/scheduler.py: the slot state table and every batching decision, driven by hand."""

from __future__ import annotations

import pytest

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.scheduler import (
    TRANSITIONS,
    CacheChoice,
    IllegalTransition,
    Move,
    QueueFull,
    Scheduler,
    SlotCache,
    SlotState,
    choose_slot,
    common_prefix,
)
from ringserve.core.batch import SlotFeed


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
        (P, Move.REFILLED): D,
        (P, Move.PREEMPT): Q,
        (P, Move.FINISH): F,
        (P, Move.CANCEL): C,
        (D, Move.PREEMPT): Q,
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
    e = s.enqueue(prompt(6), 3)
    assert (e.state, e.slot) == (SlotState.QUEUED, None)

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


def test_forced_tokens_ride_the_sampling_feeds_one_at_a_time_and_survive_a_retry():
    s = sched(n_slots=1, prefill_chunk=4)
    a = s.enqueue(prompt(6), 9)
    s.force(a, (70, 71))  # before admission: the first sample is forced already
    first = s.plan()
    assert [f.forced for f in first.feeds] == [None]  # a chunk that does not sample
    run_step(s)
    last_chunk = s.plan()
    assert last_chunk.feeds[0].sample and last_chunk.feeds[0].forced == 70
    assert s.plan().feeds == last_chunk.feeds  # a failed decode is retried with the same token
    s.commit(last_chunk)
    s.on_sampled(a.slot, 70)
    assert s.plan().feeds[0] == SlotFeed(a.slot, (70,), 6, True, 71)
    run_step(s, 71)
    assert s.plan().feeds[0].forced is None and a.sampled == [70, 71]


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


# -- the prompt-prefix cache: the choice, as a pure function --------------------------


def test_common_prefix_counts_shared_leading_tokens():
    assert common_prefix((), (1, 2)) == 0
    assert common_prefix((1, 2, 3), (1, 2, 3)) == 3
    assert common_prefix((1, 2, 3), (1, 2)) == 2
    assert common_prefix((1, 2, 3, 4, 5, 6, 7), [1, 2, 3, 9, 5, 6, 7]) == 3  # a list compares as a tuple
    assert common_prefix(tuple(range(1000)), (*range(517), -1)) == 517
    assert common_prefix((5,), (6,)) == 0


def test_choice_takes_the_longest_shared_prefix():
    p = prompt(100)
    free = [SlotCache(0, prompt(40), last_used=5), SlotCache(1, prompt(70), last_used=1), SlotCache(2, (), -1)]
    assert choose_slot(p, free) == CacheChoice(1, 70)


def test_choice_reuses_at_most_all_but_the_last_prompt_token():
    p = prompt(50)
    assert choose_slot(p, [SlotCache(0, prompt(80), 0)]) == CacheChoice(0, 49)
    assert choose_slot(p, [SlotCache(0, p, 0)]) == CacheChoice(0, 49)


def test_misses_and_ties_go_to_the_least_recently_used_slot():
    p = prompt(100, start=500)
    template = (500, 501, 502)  # only a few template tokens in common: a miss
    free = [SlotCache(0, template + prompt(50), 7), SlotCache(1, template + prompt(30), 3),
            SlotCache(2, template + prompt(90), 9)]
    assert choose_slot(p, free) == CacheChoice(1, 3)  # LRU, reusing what it shares anyway
    assert choose_slot(p, [*free, SlotCache(3)]) == CacheChoice(3, 0)  # a never-used slot first
    # a tie between hits of the same length that lose the same: least recently used
    q = prompt(60)
    tie = [SlotCache(0, prompt(40), 8), SlotCache(1, prompt(40), 2)]
    assert choose_slot(q, tie) == CacheChoice(1, 40)


def test_among_equal_hits_the_one_that_destroys_least_cache_wins():
    system = prompt(200)
    a = system + prompt(300, start=1000)  # conversation A's history
    b = system + prompt(50, start=2000)  # conversation B's
    new = system + prompt(20, start=3000)
    choice = choose_slot(new, [SlotCache(0, a, 1), SlotCache(1, b, 5)])
    assert choice == CacheChoice(1, 200)  # B's slot loses 50 cached tokens, A's would lose 300


def test_among_equal_hits_the_slot_of_the_same_cache_key_wins_and_loses_its_own_stale_cells():
    """Codex's ``prompt_cache_key`` (its session): session A's prompt changed after the shared
    system prompt (a compaction); its own slot's cells past the system prompt are stale, and go
    before session B's history, which a fewer-cells rule alone would destroy."""
    system = prompt(200)
    a_old = system + prompt(300, start=1000)
    b = system + prompt(50, start=2000)
    a_new = system + prompt(20, start=3000)
    free = [SlotCache(0, a_old, 1, cache_key="A"), SlotCache(1, b, 5, cache_key="B")]
    assert choose_slot(a_new, free) == CacheChoice(1, 200)  # no key: B's slot loses least
    assert choose_slot(a_new, free, cache_key="A") == CacheChoice(0, 200)
    assert choose_slot(a_new, free, cache_key="C") == CacheChoice(1, 200)  # a key no slot has
    # a longer hit still wins over the key, and a miss goes to the least recently used
    assert choose_slot(b + prompt(5, start=4000), free, cache_key="A") == CacheChoice(1, 250)
    assert choose_slot(prompt(100, start=5000), free, cache_key="B") == CacheChoice(0, 0)


def test_the_scheduler_keeps_each_slots_cache_key_for_the_next_choice():
    s = cached(n_slots=2)
    system = prompt(40)
    first = s.enqueue(system + prompt(30, start=1000), 2, cache_key="A")
    other = s.enqueue(system + prompt(10, start=2000), 2, cache_key="B")
    s.plan()
    slot_a = first.slot
    finish_after(s, first, [7, 8])
    finish_after(s, other, [7, 8])
    again = s.enqueue(system + prompt(5, start=3000), 2, cache_key="A")
    s.plan()
    assert (again.slot, again.cached) == (slot_a, 40)


def test_shared_prefix_is_copied_into_a_free_slot_rather_than_evicting_a_conversation():
    system = prompt(200)
    a = system + prompt(300, start=1000)
    new = system + prompt(20, start=3000)
    choice = choose_slot(new, [SlotCache(0, a, 9), SlotCache(1, (), -1)])
    assert choice == CacheChoice(1, 200, source=0)
    # from a live request's cells too
    assert choose_slot(new, [SlotCache(1, (), -1)], {0: a}) == CacheChoice(1, 200, source=0)
    # not when the copy saves fewer than min_copy tokens over the slot's own cells
    own = system[:180]
    assert choose_slot(new, [SlotCache(1, own, 0)], {0: a}, min_copy=32) == CacheChoice(1, 180)
    assert choose_slot(new, [SlotCache(1, own, 0)], {0: a}, min_copy=20) == CacheChoice(1, 200, source=0)


def test_choice_rejects_no_slot_and_empty_prompt():
    with pytest.raises(ValueError, match="no free slot"):
        choose_slot(prompt(3), [])
    with pytest.raises(ValueError, match="at least one token"):
        choose_slot((), [SlotCache(0)])


# -- the prompt-prefix cache in the scheduler ------------------------------------------


def cached(n_slots=2, n_batch=64, prefill_chunk=64) -> Scheduler:
    return Scheduler(n_slots=n_slots, n_batch=n_batch, prefill_chunk=prefill_chunk, queue_size=4,
                     prefix_cache=True, min_hit=4, min_copy=8)


def finish_after(s: Scheduler, entry, samples: list[int]) -> None:
    """Run ``entry`` until it has sampled ``samples``, finish it and drain its slot."""
    while entry.generated < len(samples):
        plan = s.plan()
        s.commit(plan)
        for feed in plan.feeds:
            if feed.sample:
                owner = plan.owner(feed.slot)
                s.on_sampled(feed.slot, samples[owner.generated] if owner is entry else 999)
    s.finish(entry)
    drain(s)


def test_turn_two_feeds_only_what_the_cache_lacks():
    s = cached(n_slots=1)
    turn1 = prompt(20)
    a = s.enqueue(turn1, 9)
    finish_after(s, a, [900, 901, 902])
    # the cells hold the prompt and the fed-back samples, not the last sample
    assert a.kept == (*turn1, 900, 901)
    assert s.statistics().cached_cells == 22
    turn2 = (*turn1, 900, 901, 902, *prompt(5, start=50))
    b = s.enqueue(turn2, 9)
    plan = s.plan()
    assert plan.admitted == (b,) and (b.slot, b.cached, b.source, b.pos) == (0, 22, None, 22)
    assert plan.feeds == (SlotFeed(0, turn2[22:], 22, True),)
    assert plan.prompt_tokens == len(turn2) - 22
    st = s.statistics()
    assert (st.prefix_lookup_tokens, st.prefix_hit_tokens) == (20 + len(turn2), 22)
    assert st.cached_cells == 0  # the entry is in use now


def test_two_conversations_alternating_keep_their_own_slots():
    s = cached(n_slots=2)
    convs = {"a": list(prompt(30, start=100)), "b": list(prompt(30, start=200))}
    slots: dict[str, list[int]] = {"a": [], "b": []}
    for turn in range(4):
        for name, history in convs.items():
            e = s.enqueue(history, 9)
            finish_after(s, e, [7000 + turn, 7100 + turn])
            slots[name].append(e.slot)
            if turn:
                # all but the last sample (never fed) and the new user turn (5 tokens)
                assert e.cached == len(history) - 6
            history += [7000 + turn, 7100 + turn, *prompt(5, start=300 + 10 * turn)]
    assert len(set(slots["a"])) == 1 and len(set(slots["b"])) == 1 and slots["a"] != slots["b"]


def test_cancelled_request_keeps_only_committed_cells():
    s = cached(n_slots=1)
    a = s.enqueue(prompt(10), 9)
    run_step(s, token=500)  # prompt fed, 500 sampled (not in the cells yet)
    run_step(s, token=501)  # 500 fed, 501 sampled
    plan = s.plan()  # 501 in flight ...
    s.cancel(a)  # ... when the consumer leaves
    s.commit(plan)
    assert a.kept == (*prompt(10), 500)
    (ended,) = s.take_releases()
    s.released([ended])
    b = s.enqueue((*prompt(10), 500, 501, 502), 9)
    s.plan()
    assert b.cached == 11  # not 501: its cell was decoded after the cancel, uncommitted


def test_failed_request_and_lost_release_keep_nothing():
    s = cached(n_slots=1)
    a = s.enqueue(prompt(10), 9)
    run_step(s)
    s.finish(a, keep_cells=False)
    assert a.kept == ()
    drain(s)
    b = s.enqueue(prompt(10), 9)
    s.plan()
    assert b.cached == 0
    run_step(s)
    s.finish(b)
    ended = s.take_releases()
    s.released(ended, lost=[0])  # the engine could not release it
    c = s.enqueue(prompt(10), 9)
    s.plan()
    assert c.cached == 0


def test_forget_cache_after_a_crash_drops_every_entry():
    s = cached(n_slots=2)
    a = s.enqueue(prompt(10), 9)
    finish_after(s, a, [1])
    assert s.statistics().cached_cells == 10
    s.forget_cache()
    assert s.statistics().cached_cells == 0
    b = s.enqueue(prompt(10), 9)
    s.plan()
    assert b.cached == 0


def test_without_the_cache_nothing_is_kept_or_looked_up():
    s = sched(n_slots=1)
    a = s.enqueue(prompt(10), 9)
    run_step(s)
    s.finish(a)
    assert a.kept == ()
    drain(s)
    b = s.enqueue(prompt(10), 9)
    s.plan()
    assert (b.cached, b.pos) == (0, 0)
    st = s.statistics()
    assert (st.cached_cells, st.prefix_lookup_tokens, st.prefix_hit_tokens) == (0, 0, 0)


def test_a_new_conversation_copies_a_live_slots_system_prompt():
    s = cached(n_slots=2)
    system = prompt(40)
    a = s.enqueue((*system, *prompt(5, start=100)), 9)
    run_step(s)  # a's whole prompt is fed (45 <= chunk)
    b = s.enqueue((*system, *prompt(5, start=200)), 9)
    plan = s.plan()
    assert plan.admitted == (b,) and (b.slot, b.cached, b.source) == (1, 40, 0)
    assert SlotFeed(1, prompt(5, start=200), 40, True) in plan.feeds


def test_a_conversations_next_turn_stays_in_its_slot_even_with_an_empty_one_free():
    history = prompt(300)
    cells = history + prompt(20, start=5000)  # its last reply, which the next prompt re-renders differently
    nxt = history + prompt(40, start=6000)
    free = [SlotCache(0, cells, 3, prompt_tokens=300), SlotCache(1, (), -1)]
    assert choose_slot(nxt, free) == CacheChoice(0, 300)  # it destroys none of its last prompt


def test_without_output_cells_only_the_prompt_is_kept():
    s = Scheduler(n_slots=1, n_batch=64, prefill_chunk=64, prefix_cache=True, cache_output=False, min_hit=4)
    a = s.enqueue(prompt(20), 9)
    finish_after(s, a, [900, 901, 902])
    assert a.kept == prompt(20)
    b = s.enqueue((*prompt(20), 900, 901, 902, 7), 9)
    s.plan()
    assert (b.cached, b.pos) == (20, 20)  # the reply is prefilled again


def test_a_short_prompt_sent_again_is_a_hit():
    p = prompt(6)
    free = [SlotCache(0, (*p, 99), 5), SlotCache(1, (), -1)]
    assert choose_slot(p, free, min_hit=16) == CacheChoice(0, 5)


# -- one KV pool shared by the slots -------------------------------------------------------------


def pool(n_cells: int, n_slots: int = 4, **kwargs) -> Scheduler:
    return Scheduler(n_slots=n_slots, n_batch=64, prefill_chunk=64, queue_size=8, n_cells=n_cells, **kwargs)


def engine_cells(s: Scheduler) -> int:
    """What the books hold now (the claims of the step just planned and committed)."""
    return s.statistics().claimed_cells


def test_one_request_may_take_the_whole_pool():
    s = pool(100)
    e = s.enqueue(prompt(90), 10)
    for _ in range(11):
        run_step(s)
    assert e.state is SlotState.DECODE and e.generated == 10 and e.pos == 99


def test_a_prompt_and_budget_larger_than_the_pool_are_refused_at_enqueue():
    s = pool(100)
    with pytest.raises(ValueError, match="exceed the pool of 100 cells"):
        s.enqueue(prompt(90), 11)


def test_a_request_that_does_not_fit_waits_at_the_head_of_the_queue_and_blocks_those_behind():
    s = pool(300)
    old = s.enqueue(prompt(200), 50)
    run_step(s)
    big = s.enqueue(prompt(70), 40)  # 70 + 40 beside the 200 old claims: 310 > 300
    small = s.enqueue(prompt(5), 5)  # would fit, but waits behind it (FIFO)
    plan = run_step(s)
    assert plan.admitted == () and big.state is small.state is SlotState.QUEUED
    s.finish(old)
    drain(s)
    assert s.plan().admitted == (big, small)


def test_admission_needs_room_for_the_prompt_and_the_headroom_or_the_whole_budget_when_smaller():
    from ringserve.core.scheduler import ADMIT_HEADROOM

    s = pool(400)
    first = s.enqueue(prompt(100), 10)
    assert s.plan().admitted == (first,)  # it claims its 100 prompt cells from now on
    wide = s.enqueue(prompt(50), 300)  # 50 + ADMIT_HEADROOM beside 100: over 400
    assert 100 + 50 + ADMIT_HEADROOM > 400
    assert s.plan().admitted == ()
    s.cancel(wide)
    narrow = s.enqueue(prompt(50), 200)  # 50 + its whole budget of 200 beside 100: 350
    assert s.plan().admitted == (narrow,)


def test_at_the_edge_the_youngest_gives_way_and_resumes_from_its_last_sample():
    s = pool(30, n_slots=2)
    old = s.enqueue(prompt(10), 18)  # 10 + 18: it alone may hold 28 of the 30 cells
    young = s.enqueue(prompt(4, start=100), 16)  # 4 + 16 beside the 10 old claims: 30, it fits
    assert run_step(s).admitted == (old, young)
    token = iter(range(500, 600))
    preempted = None
    while preempted is None:  # both grow one cell a step: 16 claimed after the first, 2 more per step
        plan = run_step(s, token=next(token))
        if plan.preempted:
            preempted = plan
        assert old.live and old.preemptions == 0
    assert preempted.preempted == (young,) and preempted.clear == (1,)  # its cells go before the batch
    assert young.state is SlotState.QUEUED and young.slot is None and young.generated == 9
    last, sampled = young.next_token, list(young.sampled)
    assert young.refill == prompt(4, start=100) + tuple(sampled[:-1])
    assert s.queued() == (young,)
    while old.generated < old.max_tokens:  # the old one goes on to its end; the young one waits
        assert run_step(s, token=next(token)).admitted == ()
    s.finish(old)
    drain(s)
    plan = s.plan()
    assert plan.admitted == (young,)
    assert plan.feeds == (SlotFeed(young.slot, young.refill, 0, False),)  # its cells again, no sample
    s.commit(plan)
    assert young.state is SlotState.DECODE
    plan = s.plan()
    assert plan.feeds == (SlotFeed(young.slot, (last,), len(young.refill), True),)  # its last sample
    assert young.sampled == sampled and young.generated == 9 and young.preemptions == 1


def test_a_request_preempted_before_its_first_sample_starts_its_prompt_again():
    s = Scheduler(n_slots=2, n_batch=8, prefill_chunk=4, queue_size=8, n_cells=40)
    old = s.enqueue(prompt(4), 30)  # 4 + 30 = 34
    run_step(s)
    young = s.enqueue(prompt(30, start=100), 1)  # 30 + 1 beside the old one's 5: 36
    plans = [run_step(s)]
    assert plans[0].admitted == (young,)
    while not plans[-1].preempted:  # it claims all 30 prompt cells while it is fed 4 a step; the old one grows
        assert young.state is SlotState.PREFILL
        plans.append(run_step(s))
    assert plans[-1].preempted == (young,) and young.generated == 0
    assert young.refill is None and young.pos == 0  # nothing sampled: its prompt from the start
    while old.generated < old.max_tokens:
        run_step(s)
    s.finish(old)
    drain(s)
    plan = s.plan()
    assert plan.admitted == (young,) and plan.feeds[0] == SlotFeed(young.slot, prompt(4, start=100), 0, False)


def test_cache_entries_are_evicted_before_anyone_waits_or_is_preempted():
    s = pool(60, n_slots=3, prefix_cache=True, min_hit=4)
    a = s.enqueue(prompt(30), 1)
    run_step(s)
    drain(s) if not a.live else (s.finish(a), drain(s))
    assert s.statistics().cached_cells == 30
    b = s.enqueue(prompt(20, start=500), 10)  # 20 + 10 beside the 30 cached: 60
    plan = run_step(s)
    assert plan.admitted == (b,) and plan.clear == ()
    c = s.enqueue(prompt(25, start=900), 5)  # 25 + 5 beside b's 21 and the 30 cached: one must go
    plan = s.plan()
    assert plan.admitted == (c,) and plan.clear == (a.slot,)
    assert s.statistics().cached_cells == 0


def test_a_copy_from_a_cache_entry_that_does_not_fit_reuses_that_entry_in_place():
    s = pool(100, n_slots=2, prefix_cache=True, min_hit=4)
    a = s.enqueue(prompt(60), 1)
    run_step(s)
    drain(s) if not a.live else (s.finish(a), drain(s))
    b = s.enqueue(prompt(70), 20)  # shares 60 tokens with slot 0's cache; a copy into slot 1 would count 60 + 90
    plan = s.plan()
    assert plan.admitted == (b,) and b.slot == a.slot and b.reuse == 60 and b.source is None


def test_the_books_never_hold_more_than_the_pool_under_random_load():
    import random

    rng = random.Random(7)
    s = pool(1200, n_slots=4, prefix_cache=True, min_hit=4)
    for step in range(3000):
        if rng.random() < 0.3 and s.statistics().queued < 6:
            n = rng.randint(1, 200)
            s.enqueue(prompt(n, start=rng.choice([0, 1000])), rng.randint(1, 1200 - n))
        plan = s.plan()
        assert engine_cells(s) <= 1200, (step, engine_cells(s))
        s.commit(plan)
        for feed in plan.feeds:
            if feed.sample:
                e = s.on_sampled(feed.slot, 3)
                if e.generated >= e.max_tokens:
                    s.finish(e)
        for e in [e for e in s.active() if rng.random() < 0.003]:
            s.cancel(e)
        drain(s)
    assert s.statistics().preemptions > 0  # the load did reach the edge
