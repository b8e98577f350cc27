"""core/cache.py: a least-recently-used cache bounded by the bytes of what it holds."""

from __future__ import annotations

import pytest

from ringserve.core.cache import ByteLRU, CacheStatistics


def sized(max_bytes: int) -> ByteLRU[str]:
    return ByteLRU(max_bytes, lambda key, value: len(str(key)) + len(value))


def test_the_least_recently_used_go_first_once_past_the_bytes() -> None:
    cache = sized(10)
    assert cache.get("a", lambda: "1234") == "1234"  # 5 bytes
    cache.get("b", lambda: "1234")  # 10
    assert cache.get("a", lambda: pytest.fail("kept")) == "1234"  # a is now the most recent
    cache.get("c", lambda: "12")  # 13: b goes
    assert cache.statistics() == CacheStatistics(entries=2, held=8, max_bytes=10, hits=1, misses=3)
    assert cache.get("b", lambda: "new") == "new"


def test_an_entry_larger_than_the_budget_is_made_but_not_kept() -> None:
    cache = sized(10)
    cache.get("a", lambda: "1")
    assert cache.get("big", lambda: "x" * 20) == "x" * 20
    assert cache.statistics().entries == 1 and cache.statistics().held == 2


def test_a_failure_is_not_kept() -> None:
    cache = sized(10)

    def fail() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError):
        cache.get("a", fail)
    assert cache.get("a", lambda: "1") == "1"
    cache.clear()
    assert cache.statistics() == CacheStatistics(0, 0, 10, 0, 0)
