"""The coalescer: first text at once, then at most one entry per window, or one per N tokens."""

import math

import pytest

from ringserve.core.coalesce import Coalescer


def test_first_text_is_released_at_once_then_windowed():
    c = Coalescer(window=0.025, max_tokens=16)
    assert c.add("Hel", 1, now=0.0) == "Hel"
    assert c.deadline == math.inf
    assert c.add("lo", 1, now=0.001) is None
    assert c.deadline == pytest.approx(0.025)  # one window after the last release
    assert c.add(" wor", 1, now=0.010) is None
    assert c.deadline == pytest.approx(0.025)  # the window does not slide
    assert c.due(0.020) is None
    assert c.due(0.0251) == "lo wor"
    assert c.deadline == math.inf
    assert c.add("ld", 1, now=0.030) is None  # 5 ms after the release at 0.0251
    assert c.deadline == pytest.approx(0.0501)


def test_a_delta_a_window_or_more_after_the_last_release_goes_at_once():
    """Decode steps slower than the window (a CPU box): each step's text goes at once, no deadline is set."""
    c = Coalescer(window=0.025, max_tokens=16)
    assert c.add("a", 1, now=0.0) == "a"
    for k in range(1, 6):
        assert c.add("b", 1, now=0.09 * k) == "b"
        assert c.deadline == math.inf
    assert c.add("c", 1, now=0.46) is None  # 10 ms after the last release: waits for the window
    assert c.deadline == pytest.approx(0.475)


def test_token_count_releases_before_the_window():
    c = Coalescer(window=10.0, max_tokens=3)
    c.add("a", 1, 0.0)
    assert c.add("b", 1, 0.0) is None
    assert c.add("c", 1, 0.0) is None
    assert c.add("d", 1, 0.0) == "bcd"


def test_empty_deltas_count_tokens_but_release_nothing():
    c = Coalescer(window=1.0, max_tokens=4)
    assert c.add("", 2, 0.0) is None  # held-back tokens: nothing to show yet
    assert c.deadline == math.inf
    assert c.add("x", 1, 0.0) == "x"  # still the first text, so at once
    assert c.flush() == ""


def test_zero_window_releases_every_delta():
    c = Coalescer(window=0.0, max_tokens=16)
    assert [c.add(t, 1, 0.0) for t in "abc"] == ["a", "b", "c"]
