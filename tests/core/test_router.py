"""core/router.py: which models are loaded, and which to load or unload next, driven by hand."""

from __future__ import annotations

import math

import pytest

from ringserve.core.router import (
    TRANSITIONS,
    Evict,
    IllegalModelMove,
    Load,
    ModelMove,
    ModelStatus,
    NoRoom,
    Router,
    Wait,
)

U, L, D, X, F = (ModelStatus.UNLOADED, ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.UNLOADING,
                 ModelStatus.FAILED)


def loaded(router: Router, name: str, now: float, memory: int = 0, keep_alive: float = 0.0) -> None:
    router.add(name, keep_alive).move(ModelMove.LOAD)
    router.loaded(name, now, memory)


def test_the_transition_table_is_the_documented_lifecycle():
    assert dict(TRANSITIONS) == {
        (U, ModelMove.LOAD): L, (F, ModelMove.LOAD): L, (L, ModelMove.LOADED): D, (L, ModelMove.FAILED): F,
        (U, ModelMove.FAILED): F, (F, ModelMove.FAILED): F,
        (D, ModelMove.UNLOAD): X, (X, ModelMove.UNLOADED): U,
    }
    router = Router(2)
    with pytest.raises(IllegalModelMove, match="cannot unload when unloaded"):
        router.add("a", 0).move(ModelMove.UNLOAD)


def test_a_load_under_max_loaded_that_fits_goes_ahead():
    router = Router(2)
    loaded(router, "a", 1.0)
    router.add("b", 0)
    assert router.plan_load("b", need=100, free=200) == Load()
    assert router.plan_load("b", need=0, free=None) == Load()


def test_at_max_loaded_the_least_recently_released_idle_model_goes_first():
    router = Router(2)
    loaded(router, "a", 1.0)
    loaded(router, "b", 2.0)
    router.add("c", 0)
    assert router.plan_load("c", 0, None) == Evict("a")
    router.hold("a")
    router.release("a", 5.0)  # used again since: b is now the least recently used
    assert router.plan_load("c", 0, None) == Evict("b")


def test_a_model_held_by_a_request_is_never_evicted_and_the_load_waits():
    router = Router(1)
    loaded(router, "a", 1.0)
    router.hold("a")
    router.add("b", 0)
    decision = router.plan_load("b", 0, None)
    assert isinstance(decision, Wait) and "max_loaded = 1" in decision.reason
    router.release("a", 2.0)
    assert router.plan_load("b", 0, None) == Evict("a")


def test_memory_that_does_not_fit_evicts_idle_models_then_waits():
    router = Router(4)
    loaded(router, "a", 1.0, memory=300)
    loaded(router, "b", 2.0, memory=300)
    router.hold("b")
    router.add("c", 0)
    assert router.plan_load("c", need=500, free=200) == Evict("a")
    router["a"].move(ModelMove.UNLOAD)
    router.unloaded("a")
    decision = router.plan_load("c", need=500, free=400)
    assert isinstance(decision, Wait) and "do not fit" in decision.reason
    assert router.plan_load("c", need=500, free=600) == Load()


def test_a_model_loading_counts_its_memory_against_the_next_load():
    """Two loads planned while the first has not allocated yet must not both fit the same free bytes."""
    router = Router(4)
    router.add("a", 0)
    router.add("b", 0)
    assert router.plan_load("a", need=300, free=400) == Load()
    router.loading("a", 300)
    assert isinstance(router.plan_load("b", need=200, free=400), Wait)  # 100 left of the 400
    assert router.plan_load("b", need=100, free=400) == Load()
    router.failed("a")
    assert router["a"].memory == 0 and router.plan_load("b", need=200, free=400) == Load()


def test_memory_that_would_not_fit_with_every_other_model_unloaded_is_no_room():
    """Nothing loaded to free (a start-up load), or not enough: no wait for a release that cannot help."""
    router = Router(4)
    router.add("a", 0)
    assert router.plan_load("a", need=500, free=400) == NoRoom(500, 400)
    loaded(router, "b", 1.0, memory=50)
    router.hold("b")
    assert router.plan_load("a", need=500, free=400) == NoRoom(500, 450)
    assert isinstance(router.plan_load("a", need=500, free=460), Wait)


def test_idle_models_expire_after_their_keep_alive_and_zero_keeps_them():
    router = Router(4)
    loaded(router, "a", 10.0, keep_alive=5.0)
    loaded(router, "b", 10.0, keep_alive=0.0)
    loaded(router, "c", 10.0, keep_alive=5.0)
    router.hold("c")
    assert router.next_expiry() == 15.0
    assert router.expired(14.9) == ()
    assert router.expired(15.0) == ("a",)
    router.release("c", 20.0)
    assert router.next_expiry() == 15.0 and router.expired(25.0) == ("a", "c")
    assert router.expired(1e9) == ("a", "c")  # b never


def test_no_expiry_when_nothing_is_idle():
    router = Router(1)
    router.add("a", 5.0)
    assert router.next_expiry() == math.inf and router.expired(1e9) == ()


def test_releasing_more_than_held_is_a_bug():
    router = Router(1)
    router.add("a", 0)
    with pytest.raises(RuntimeError, match="released more often than held"):
        router.release("a", 1.0)
