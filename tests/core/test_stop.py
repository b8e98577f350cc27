"""core/stop.py: stop strings with hold-back, never leaking a prefix (case C7)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.stop import StopMatch, StopMatcher

SETTINGS = settings(max_examples=300, deadline=None)


def reference(text: str, stops) -> tuple[str, str | None]:
    """Simple and slow: the first position where some stop string has just completed.

    Among stops ending there, the longest (earliest start) wins.
    """
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


def hold_len(text: str, stops) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
    for k in range(len(text), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def run(stops, pieces) -> tuple[str, str | None, list[StopMatch]]:
    matcher = StopMatcher(stops)
    results = []
    for piece in pieces:
        result = matcher.feed(piece)
        results.append(result)
        if result.stop is not None:
            return "".join(r.text for r in results), result.stop, results
    return "".join(r.text for r in results) + matcher.flush(), None, results


def test_c7_beta_gamma():
    pieces = ["alpha", " be", "ta g", "amma", " delta"]
    matcher = StopMatcher(["beta gamma"])
    results = [matcher.feed(p) for p in pieces[:4]]
    assert results == [
        StopMatch("alpha"),
        StopMatch(" "),
        StopMatch(""),
        StopMatch("", "beta gamma"),
    ]
    assert matcher.stop == "beta gamma"
    with pytest.raises(RuntimeError):
        matcher.feed(" delta")
    assert matcher.flush() == ""


@pytest.mark.parametrize("pieces", [
    ["alpha beta gamma delta"],
    list("alpha beta gamma delta"),
    ["alpha", " be", "ta g", "amma", " delta"],
    ["alpha b", "eta", " ", "gamma delta"],
])
def test_c7_any_split(pieces):
    released, stop, results = run(["beta gamma"], pieces)
    assert (released, stop) == ("alpha ", "beta gamma")
    assert not any("b" in r.text for r in results)


def test_false_start_is_released():
    matcher = StopMatcher(["beta gamma"])
    assert matcher.feed("a be") == StopMatch("a ")
    assert matcher.held == "be"
    assert matcher.feed("ta") == StopMatch("")
    assert matcher.feed("s!") == StopMatch("betas!")
    assert matcher.held == ""
    assert matcher.flush() == ""


def test_flush_releases_held_prefix():
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("end </") == StopMatch("end ")
    assert matcher.flush() == "</"
    assert matcher.done
    with pytest.raises(RuntimeError):
        matcher.feed("x")
    assert matcher.flush() == ""


def test_text_after_match_in_same_feed_is_dropped():
    assert StopMatcher(["STOP"]).feed("abSTOPcdSTOP") == StopMatch("ab", "STOP")


def test_first_to_complete_wins():
    # "bc" completes before "abcde" could; the generation stops there.
    assert run(["abcde", "bc"], ["abcdef"])[:2] == ("a", "bc")
    assert run(["abcde", "bc"], list("abcdef"))[:2] == ("a", "bc")
    # Both end at the same character: the longer (earlier start) wins.
    assert run(["\n", "a\n"], ["xa\ny"])[:2] == ("x", "a\n")
    assert run(["\n", "a\n"], list("xa\ny"))[:2] == ("x", "a\n")
    # Same end, other order in the list.
    assert run(["a\n", "\n"], ["xa", "\n"])[:2] == ("x", "a\n")


def test_overlapping_prefixes():
    # Held "aa" could be the start of "aab" shifted by one; nothing may leak.
    assert run(["aab"], ["a", "a", "a", "b"])[:2] == ("a", "aab")
    assert run(["abab"], ["ab", "ab", "ab"])[:2] == ("", "abab")
    assert run(["abac"], ["aba", "bac"])[:2] == ("ab", "abac")


def test_empty_and_duplicate_stops_ignored():
    matcher = StopMatcher(["", "x", "x"])
    assert matcher.stops == ("x",)
    assert StopMatcher([""]).feed("anything") == StopMatch("anything")
    assert StopMatcher([]).feed("abc") == StopMatch("abc")


def test_bad_stops():
    with pytest.raises(TypeError):
        StopMatcher("stop")
    with pytest.raises(TypeError):
        StopMatcher([b"stop"])


alphabet = st.sampled_from(list("ab c\n👍"))
texts = st.text(alphabet=alphabet, max_size=30)
stop_lists = st.lists(st.text(alphabet=alphabet, max_size=5), max_size=4)


@st.composite
def splits(draw, text):
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=10))
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@SETTINGS
@given(data=st.data(), text=texts, stops=stop_lists)
def test_matches_reference_for_any_split(data, text, stops):
    pieces = data.draw(splits(text))
    expected = reference(text, stops)
    released, stop, _ = run(stops, pieces)
    assert (released, stop) == expected
    # Whole, and one character at a time, agree.
    assert run(stops, [text])[:2] == expected
    assert run(stops, list(text))[:2] == expected


@SETTINGS
@given(data=st.data(), text=texts, stops=stop_lists)
def test_never_leaks_and_releases_as_early_as_possible(data, text, stops):
    pieces = data.draw(splits(text))
    final_text, final_stop = reference(text, stops)
    live = [s for s in stops if s]
    matcher = StopMatcher(stops)
    fed = released = ""
    for piece in pieces:
        fed += piece
        result = matcher.feed(piece)
        released += result.text
        # Never ahead of the final answer: no character of the matched stop is ever out.
        assert final_text.startswith(released)
        if result.stop is not None:
            assert (released, result.stop) == (final_text, final_stop)
            return
        # Held back is exactly the longest suffix that could still start a stop.
        assert released + matcher.held == fed
        assert len(matcher.held) == hold_len(fed, live)
    assert final_stop is None
    assert released + matcher.flush() == text
