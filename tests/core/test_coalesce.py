"""The coalescer: first text at once, then at most one entry per window, or one per N tokens."""

import ast
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.coalesce import BUSY_SHARE, LAG_FLOOR, LAG_SHARE, Coalescer
from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop, Finish, StopReason, Usage
from ringserve.core.producer import Producer, replay
from ringserve.core.safety import Verdict
from tests.support.helpers import RecordingRenderer, entry_data

SETTINGS = settings(max_examples=200, deadline=None)
WINDOW = 0.025
#: Time steps between moves: zero (equal timestamps) often, whole windows (the edge), and any other.
DTS = st.sampled_from([0.0, 0.0, WINDOW, 2 * WINDOW]) | st.floats(0.0, 3 * WINDOW)
WINDOWS = st.sampled_from([0.0, 0.001, WINDOW, 1.0])


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


def test_due_ahead_releases_text_whose_deadline_passes_before_the_next_ask():
    """A caller that asks once per decode step of 10 ms: at 0.020 the deadline (0.025) falls
    before the next ask (0.030), so the text goes then, not 5 ms late; at 0.010 it waits."""
    c = Coalescer(window=0.025, max_tokens=16)
    assert c.add("a", 1, now=0.0) == "a"
    assert c.add("b", 1, now=0.010) is None
    assert c.due(0.010, ahead=0.010) is None
    assert c.add("c", 1, now=0.020) is None
    assert c.due(0.020, ahead=0.010) == "bc"
    assert c.add("d", 1, now=0.030) is None
    assert c.deadline == pytest.approx(0.045)  # one window after the release at 0.020


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


@SETTINGS
@given(moves=st.lists(st.tuples(st.sampled_from(["add", "add", "add", "due", "flush", "flush_now"]), DTS,
                                st.text(max_size=3), st.integers(0, 3)), max_size=60),
       window=WINDOWS, max_tokens=st.integers(1, 17))
def test_any_moves_release_the_text_in_order_never_past_a_window_and_at_most_once_per_window(moves, window, max_tokens):
    """Any adds, dues and flushes at non-decreasing times (equal ones included): what comes out is
    what went in, in order; held text always has a deadline in the future, at most a window after
    it arrived, and ``due`` at that deadline releases it; a release that neither the first text,
    the token count nor a flush forced comes a window or more after the last timed one."""
    c = Coalescer(window=window, max_tokens=max_tokens)
    now, added, released = 0.0, "", ""
    held_since = None  # when the oldest text still held arrived
    last_release = -math.inf  # the last release with a time (add, due, flush(now))
    tokens = 0  # tokens added since the last release
    for kind, dt, text, n in moves:
        now += dt
        if kind == "add":
            first = released == ""
            added, tokens = added + text, tokens + n
            out = c.add(text, n, now)
            if out is not None:
                assert first or window <= 0 or tokens >= max_tokens or now >= last_release + window
                released, last_release, tokens, held_since = released + out, now, 0, None
            elif text and held_since is None:
                held_since = now
        elif kind == "due":
            deadline, out = c.deadline, c.due(now)
            if now >= deadline:
                assert out and now >= last_release + window
                released, last_release, tokens, held_since = released + out, now, 0, None
            else:
                assert out is None
        else:
            out = c.flush(now if kind == "flush_now" else None)
            released, tokens, held_since = released + out, 0, None
            if out and kind == "flush_now":
                last_release = now
        assert added.startswith(released)  # nothing lost, doubled or reordered so far
        if added == released:
            assert c.deadline == math.inf
        else:
            assert now < c.deadline <= held_since + window
    assert released + c.flush() == added


@SETTINGS
@given(times=st.lists(st.floats(-1.0, 1.0), max_size=40), data=st.data())
def test_times_that_go_backwards_lose_nothing_and_due_at_the_deadline_releases(times, data):
    c = Coalescer(window=WINDOW, max_tokens=16)
    added, released = "", ""
    for t in times:
        text = data.draw(st.text(min_size=1, max_size=2))
        added += text
        out = c.add(text, 1, t)
        if out is not None:
            released += out
        else:
            assert c.deadline < math.inf
            if data.draw(st.booleans()):
                released += c.due(c.deadline)
        assert added.startswith(released)
    assert released + c.flush() == added


USAGE = Usage(5, 0)
DELTAS = st.lists(st.tuples(st.text(max_size=3), st.integers(0, 2), DTS, st.booleans()), max_size=12)


@settings(max_examples=100, deadline=None)
@given(program=st.lists(st.tuples(st.sampled_from([BlockKind.TEXT, BlockKind.TOOL_CALL]), DELTAS), max_size=4),
       window=WINDOWS, flush_tokens=st.integers(1, 17), window_tokens=st.sampled_from([0, 0, 1, 3]))
def test_through_the_producer_blocks_reach_the_log_whole_in_order_and_replay_the_same(
        program, window, flush_tokens, window_tokens):
    """Text and tool-call blocks, with and without a safety stage, ticks when the deadline passed
    (or skipped): each block's deltas in the log join to exactly its text, flushes at block
    boundaries included; without a safety stage held text always has a deadline at most a window
    away; and the stored trace replays the same entries (what a resume from the store sends)."""
    p = Producer("msg_1", RecordingRenderer(), USAGE, flush_seconds=window, flush_tokens=flush_tokens,
                 persist_seconds=math.inf, window_tokens=window_tokens)
    entries = list(p.start(0.0).entries)
    now, fed, released = 0.0, [], []

    def perform(step):
        while step.check is not None:
            entries.extend(step.entries)
            step = p.verdict(Verdict.allow(), now)
        entries.extend(step.entries)
        for data in entry_data(step.entries):
            if data.startswith("delta "):
                _, index, text = data.split(" ", 2)
                released[int(index)] += ast.literal_eval(text)

    for i, (kind, deltas) in enumerate(program):
        fed.append("")
        released.append("")
        name, call_id = ("get_time", f"call_{i}") if kind is BlockKind.TOOL_CALL else ("", "")
        perform(p.event(BlockStart(i, kind, name, call_id), USAGE, now))
        for text, tokens, dt, tick in deltas:
            now += dt
            if tick and now >= p.deadline:
                perform(p.tick(now))
            fed[i] += text
            perform(p.event(BlockDelta(i, text, tokens), USAGE, now))
            assert fed[i].startswith(released[i])
            if window_tokens == 0 and fed[i] != released[i]:
                assert now < p.deadline <= now + window
        perform(p.event(BlockStop(i), USAGE, now))
        assert released[i] == fed[i]
    finish = Finish(StopReason.END, USAGE)
    perform(p.event(finish, USAGE, now))
    assert [b.text for b in p.content][:len(fed)] == fed
    assert replay("msg_1", RecordingRenderer(), USAGE, p.content, p.snapshot().trace, finish, None) == tuple(entries)


# -- the window widens while the loop lags (issue 42) -------------------------------------------

STEP = 0.010
LAG = 0.001  # over LAG_SHARE of a 10 ms step
KEPT_UP = 0.0002  # under it


def at(k: int) -> float:
    """The time of the ``k``-th pass, one per 10 ms step (mid-step: no float ties with window edges)."""
    return k * STEP + STEP / 2


def test_the_window_doubles_at_most_once_per_window_while_the_loop_lags_up_to_its_bound():
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    widths = []
    for k in range(40):  # every step lags
        c.pace(LAG, STEP, 0.0, now=at(k))
        widths.append(c.current)
    assert widths[0] == 0.05  # the first lag doubles it at once
    assert widths[1:5] == [0.05] * 4  # then not again within that window
    assert widths[5:15] == [0.1] * 10 and widths[15] == 0.2
    assert set(widths[15:]) == {0.2}  # the bound


def test_the_window_halves_back_to_its_base_once_the_average_lag_is_under_half_the_share():
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    c.pace(LAG, STEP, 0.0, now=at(0))
    c.pace(LAG, STEP, 0.0, now=at(5))
    assert c.current == 0.1
    changes = []
    for k in range(6, 80):  # the loop keeps up from now on
        before = c.current
        c.pace(KEPT_UP, STEP, 0.0, now=at(k))
        if c.current != before:
            changes.append((k, c.current))
    # the average over about a window (10 steps of 10 ms at 100 ms) needs 26 steps to fall under
    # half the share; then one halving per window, never below the base
    assert changes == [(31, 0.05), (36, 0.025)]


def test_a_lag_spike_once_per_window_is_averaged_over_the_window():
    """Lockstep streams write once per window: one step in three lags 2.5 ms (an average of 8 %
    of a 10 ms step, over the share), then one in three lags 0.9 ms (3 %, within it)."""
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    for k in range(30):
        c.pace(0.0025 if k % 3 == 0 else 0.0, STEP, 0.0, now=at(k))
    assert c.current > 0.025
    d = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    for k in range(1, 30):
        d.pace(0.0009 if k % 3 == 0 else 0.0, STEP, 0.0, now=at(k))
    assert d.current == 0.025


def test_a_lag_within_the_share_of_a_step_or_without_a_bound_changes_nothing():
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    for k in range(50):
        c.pace(LAG_SHARE * STEP, STEP, 0.0, now=k * STEP)  # at the share, not over it
    assert c.current == 0.025
    fixed = Coalescer(window=0.025, max_tokens=16)  # bound 0: the window as configured
    fixed.pace(1.0, STEP, 0.0, now=0.0)
    assert fixed.current == 0.025


def test_with_short_steps_a_lag_under_the_floor_changes_nothing():
    """2 ms steps: a lag of 0.4 ms is 20 % of a step but under the floor (the hop back from the
    engine's thread, which fewer writes would not shorten); 0.6 ms is over both."""
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    for k in range(100):
        c.pace(0.8 * LAG_FLOOR, 0.002, 0.0, now=k * 0.002 + 0.001)
    assert c.current == 0.025
    for k in range(100, 120):
        c.pace(1.2 * LAG_FLOOR, 0.002, 0.0, now=k * 0.002 + 0.001)
    assert c.current > 0.025


def test_a_loop_busy_over_its_share_widens_the_window_and_under_half_of_it_narrows_it():
    """No lag (the loop took each step's result at once) but a loop busy 60 % of the time: the
    engine's thread waits for the interpreter lock, readers for the loop. Widened; narrowed again
    once the loop is busy 20 % of the time, not at 30 %."""
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    for k in range(20):
        c.pace(0.0, STEP, 0.6, now=at(k))
    assert c.current == 0.2
    for k in range(20, 200):
        c.pace(0.0, STEP, 0.3, now=at(k))
    assert c.current == 0.2
    for k in range(200, 400):
        c.pace(0.0, STEP, 0.2, now=at(k))
    assert c.current == 0.025


def test_text_waiting_for_its_window_takes_the_new_windows_deadline():
    c = Coalescer(window=0.025, max_tokens=16, bound=0.2)
    assert c.add("a", 1, now=0.0) == "a"
    assert c.add("b", 1, now=0.01) is None
    assert c.deadline == pytest.approx(0.025)
    c.pace(LAG, STEP, 0.0, now=0.012)  # widened to 50 ms: one window after the last release
    assert c.deadline == pytest.approx(0.05)
    assert c.due(0.03) is None and c.add("c", 1, now=0.03) is None  # sooner than a (new) window
    assert c.due(0.05) == "bc"
    assert c.add("d", 1, now=0.06) is None and c.deadline == pytest.approx(0.1)
    now = 0.06
    while c.current > 0.025:  # the loop keeps up: back to 25 ms
        now += STEP
        c.pace(KEPT_UP, STEP, 0.0, now)
    assert c.deadline == pytest.approx(0.075) and c.deadline < now  # due at once
    assert c.due(now) == "d"


def test_a_widened_window_holds_as_many_more_tokens():
    """Widened four times (25 to 100 ms), a window holds 4 x 4 tokens before the count releases it,
    so steps of one token each still make one entry per (wider) window; narrowed back, 4 again."""
    c = Coalescer(window=0.025, max_tokens=4, bound=0.1)
    c.pace(LAG, STEP, 0.0, now=at(0))
    c.pace(LAG, STEP, 0.0, now=at(5))
    assert c.current == 0.1
    assert c.add("t", 1, now=at(5)) == "t"  # the first text goes at once
    held = [c.add("t", 1, now=at(5) + k * 0.001) for k in range(1, 16)]
    assert held == [None] * 15
    assert c.add("t", 1, now=at(5) + 0.016) == "t" * 16
    d = Coalescer(window=0.025, max_tokens=4, bound=0.1)
    assert d.add("t", 1, now=0.0) == "t"
    assert [d.add("t", 1, now=k * 0.001) for k in range(1, 5)] == [None, None, None, "tttt"]


@SETTINGS
@given(moves=st.lists(st.tuples(st.sampled_from(["add", "add", "due", "pace", "pace"]), DTS, st.text(max_size=3),
                                st.integers(0, 3), st.booleans()), max_size=60),
       max_tokens=st.integers(1, 17))
def test_a_loop_that_keeps_up_sees_the_same_releases_as_a_fixed_window(moves, max_tokens):
    """Any moves, the loop never lagging over the share of a step nor busy over its share: a
    coalescer with a bound releases the same text at the same moves as one without (a reader not
    behind waits no longer)."""
    paced = Coalescer(window=WINDOW, max_tokens=max_tokens, bound=8 * WINDOW)
    fixed = Coalescer(window=WINDOW, max_tokens=max_tokens)
    now = 0.0
    for kind, dt, text, n, big in moves:
        now += dt
        if kind == "add":
            assert paced.add(text, n, now) == fixed.add(text, n, now)
        elif kind == "due":
            assert paced.due(now) == fixed.due(now)
        else:
            paced.pace(LAG_SHARE * (0.1 if big else 1.0) * STEP, STEP, BUSY_SHARE * (1.0 if big else 0.1), now)
        assert paced.deadline == fixed.deadline and paced.current == WINDOW


@SETTINGS
@given(moves=st.lists(st.tuples(st.sampled_from(["add", "add", "due", "pace", "flush"]), DTS, st.text(max_size=3),
                                st.integers(0, 3), st.booleans()), max_size=80),
       max_tokens=st.integers(1, 17), bound=st.sampled_from([WINDOW, 4 * WINDOW, 8 * WINDOW]))
def test_while_the_window_moves_text_is_released_whole_in_order_within_the_bound(moves, max_tokens, bound):
    """Lagging and keeping up in any order (the shell releases what a narrowed window made due at
    once, as ``live/produce.py`` ticks after a pace): nothing is lost, doubled or reordered, the
    window stays between the base and the bound, and held text waits at most the bound."""
    c = Coalescer(window=WINDOW, max_tokens=max_tokens, bound=bound)
    now, added, released, held_since = 0.0, "", "", None
    for kind, dt, text, n, lagging in moves:
        now += dt
        if kind == "add":
            added += text
            out = c.add(text, n, now)
            if out is None and text and held_since is None:
                held_since = now
        elif kind == "due":
            out = c.due(now)
        elif kind == "pace":
            c.pace(LAG if lagging else KEPT_UP, STEP, 0.0, now)
            out = c.due(now)
        else:
            out = c.flush(now)
        if out:
            released, held_since = released + out, None
        assert added.startswith(released)
        assert WINDOW <= c.current <= bound
        if added != released:
            assert now < c.deadline <= held_since + bound
    assert released + c.flush() == added

