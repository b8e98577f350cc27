"""The producer chain as plain values (``core/producer.py``): no server, no clock, no Trio.

Covers block order, coalescing, the safety hold-back, event ids and the retry hint,
persistence cadence, and every way a message ends.
"""

from __future__ import annotations

import attrs
import pytest

from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ContentBlock,
    Failure,
    Finish,
    StopReason,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ringserve.core.producer import Producer, replay
from ringserve.core.render import WireEvent
from ringserve.core.ringlog import LogState
from ringserve.core.safety import PatternChecker, Verdict
from ringserve.core.sse import SSEParser
from ringserve.core.status import CancelReason, MessageStatus
from tests.support.helpers import RecordingRenderer, entry_data

USAGE = Usage(5, 0)
TEXT = BlockStart(0, BlockKind.TEXT)


def make(*, flush_seconds=0.0, flush_tokens=1, persist_seconds=1e9, window_tokens=0, retry_ms=None) -> Producer:
    return Producer("msg_1", RecordingRenderer(), USAGE, flush_seconds=flush_seconds, flush_tokens=flush_tokens,
                    persist_seconds=persist_seconds, window_tokens=window_tokens, retry_ms=retry_ms)


def run(p: Producer, events, now: float = 0.0, checker=None) -> list[str]:
    """Feed ``events`` (checks answered by ``checker``); the data of every entry appended."""
    out = []
    for event in events:
        step = p.event(event, Usage(5, 1), now)
        while step.check is not None:
            step = p.verdict(checker.check(step.check.released, step.check.window), now)
        out += entry_data(step.entries)
    return out


def test_a_text_message_in_order_with_ids_and_the_retry_hint_on_the_first_entry():
    p = make(retry_ms=1500)
    start = p.start(0.0)
    [first] = SSEParser().feed(start.entries[0])
    assert (first.id, first.retry, first.data) == ("msg_1:0", 1500, "start")
    data = run(p, [TEXT, BlockDelta(0, "Hel", 1), BlockDelta(0, "lo", 1), BlockStop(0),
                   Finish(StopReason.END, Usage(5, 3))])
    assert data == ["block_start 0 text", "delta 0 'Hel'", "delta 0 'lo'", "block_stop 0", "finish end"]
    assert p.content == (ContentBlock(BlockKind.TEXT, "Hello"),)
    assert (p.status, p.last_seq, p.ended) == (MessageStatus.COMPLETE, 5, True)
    snap = p.snapshot()
    assert (snap.final_seq, snap.usage, snap.stop_reason) == (5, Usage(5, 3), StopReason.END)


def test_blocks_of_two_kinds_keep_their_indexes_and_content():
    p = make()
    p.start(0.0)
    data = run(p, [TEXT, BlockDelta(0, "I'll call it.", 1), BlockStop(0),
                   BlockStart(1, BlockKind.TOOL_CALL, "get_weather", "ab" * 12),
                   BlockDelta(1, '{"city":', 1), BlockDelta(1, '"Paris"}', 1), BlockStop(1),
                   Finish(StopReason.END, Usage(5, 4))])
    assert data[3:7] == ["block_start 1 tool_call", "delta 1 '{\"city\":'", "delta 1 '\"Paris\"}'", "block_stop 1"]
    assert p.content[1] == ContentBlock(BlockKind.TOOL_CALL, '{"city":"Paris"}', "get_weather", "ab" * 12)


def test_coalescing_releases_the_first_text_at_once_then_by_window_or_tokens():
    p = make(flush_seconds=0.05, flush_tokens=3)
    p.start(0.0)
    assert entry_data(p.event(TEXT, USAGE, 0.0).entries) == ["block_start 0 text"]
    assert entry_data(p.event(BlockDelta(0, "a", 1), USAGE, 0.0).entries) == ["delta 0 'a'"]  # TTFT not delayed
    assert p.event(BlockDelta(0, "b", 1), USAGE, 0.01).entries == ()
    assert p.deadline == pytest.approx(0.05)  # one window after the release at 0.0
    assert p.tick(0.03).entries == ()
    assert entry_data(p.tick(0.051).entries) == ["delta 0 'b'"]  # the window passed
    p.event(BlockDelta(0, "c", 1), USAGE, 0.07)
    p.event(BlockDelta(0, "d", 1), USAGE, 0.07)
    assert entry_data(p.event(BlockDelta(0, "e", 1), USAGE, 0.07).entries) == ["delta 0 'cde'"]  # 3 tokens
    p.event(BlockDelta(0, "f", 1), USAGE, 0.08)
    # a block boundary releases what waits before the stop
    assert entry_data(p.event(BlockStop(0), USAGE, 0.08).entries) == ["delta 0 'f'", "block_stop 0"]


def test_persistence_cadence_status_changes_at_once_text_every_persist_seconds():
    p = make(persist_seconds=1.0)
    p.start(0.0)
    step = p.event(TEXT, USAGE, 0.0)
    assert step.persist is not None and step.persist.status is MessageStatus.GENERATING
    step = p.event(BlockDelta(0, "a", 1), USAGE, 0.1)
    assert step.released and step.persist is not None and step.persist.content[0].text == "a"
    assert p.event(BlockDelta(0, "b", 1), USAGE, 0.5).persist is None
    step = p.event(BlockDelta(0, "c", 1), USAGE, 1.2)
    assert step.persist is not None and step.persist.content[0].text == "abc"
    end = p.event(Failure(ErrorKind.API_ERROR, "boom", Usage(5, 3), True), USAGE, 1.3)
    assert end.persist is not None and end.persist.final_seq == p.last_seq


def test_hold_back_releases_what_falls_out_and_checks_the_rest_before_the_block_stops():
    p = make(window_tokens=2)
    p.start(0.0)
    checker = PatternChecker(["bad"])
    assert run(p, [TEXT, BlockDelta(0, "a", 1), BlockDelta(0, "b", 1)], checker=checker) == ["block_start 0 text"]
    assert run(p, [BlockDelta(0, "cd", 1)], checker=checker) == ["delta 0 'a'"]
    assert run(p, [BlockDelta(0, "e", 2)], checker=checker) == ["delta 0 'bcd'"]  # two tokens push two out
    assert run(p, [BlockStop(0)], checker=checker) == ["delta 0 'e'", "block_stop 0"]
    assert p.content[0].text == "abcde"


def test_hold_back_leaves_tool_arguments_alone():
    p = make(window_tokens=4)
    p.start(0.0)
    data = run(p, [BlockStart(0, BlockKind.TOOL_CALL, "f", "0" * 24), BlockDelta(0, '{"bad":1}', 1)],
               checker=PatternChecker(["bad"]))
    assert data[-1] == "delta 0 '{\"bad\":1}'"


def test_a_refusal_mid_stream_closes_the_block_and_ends_the_message():
    p = make(window_tokens=2)
    p.start(0.0)
    checker = PatternChecker(["bad"])
    run(p, [TEXT, BlockDelta(0, "x", 1), BlockDelta(0, "b", 1), BlockDelta(0, "a", 1)], checker=checker)
    step = p.event(BlockDelta(0, "d", 1), Usage(5, 4), 0.0)
    assert step.check is not None
    end = p.verdict(checker.check(step.check.released, step.check.window), 0.0)
    assert entry_data(end.entries) == ["block_stop 0", "finish refusal"]
    assert end.end is not None and end.end.state is LogState.FINISHED
    assert end.end.terminal == Finish(StopReason.REFUSAL, Usage(5, 4))
    assert p.content[0].text == "x" and p.status is MessageStatus.COMPLETE


def test_a_failed_check_is_a_retryable_error_and_no_unchecked_text_is_sent():
    p = make(window_tokens=1)
    p.start(0.0)
    run(p, [TEXT, BlockDelta(0, "a", 1)])
    step = p.event(BlockDelta(0, "b", 1), USAGE, 0.0)
    with pytest.raises(RuntimeError, match="awaits its verdict"):
        p.event(BlockDelta(0, "c", 1), USAGE, 0.0)
    end = p.check_failed("ZeroDivisionError", 0.0)
    assert step.check is not None and entry_data(end.entries) == ["fail api_error"]
    assert end.end is not None and isinstance(end.end.terminal, Failure) and end.end.terminal.retryable
    assert "ZeroDivisionError" in end.end.terminal.message
    assert p.content[0].text == "" and p.status is MessageStatus.FAILED


@pytest.mark.parametrize(
    ("reason", "status", "last", "state"),
    [
        (CancelReason.REQUESTED, MessageStatus.CANCELLED, "finish cancelled", LogState.FINISHED),
        (CancelReason.DRAIN, MessageStatus.INTERRUPTED, "fail unavailable", LogState.FAILED),
        (None, MessageStatus.FAILED, "fail api_error", LogState.FAILED),
    ],
)
def test_interrupted_mid_block_and_before_any_block(reason, status, last, state):
    p = make()
    p.start(0.0)
    run(p, [TEXT, BlockDelta(0, "par", 1)])
    end = p.interrupted(reason, Usage(5, 2), 0.0)
    closing = ["block_stop 0"] if state is LogState.FINISHED else []
    assert entry_data(end.entries) == [*closing, last]
    assert end.end is not None and end.end.state is state and p.status is status
    assert p.snapshot().usage == Usage(5, 2) and p.content[0].text == "par"

    q = make()
    q.start(0.0)
    end = q.interrupted(reason, USAGE, 0.0)
    if state is LogState.FINISHED:  # a finished message has at least one (empty) block
        assert entry_data(end.entries) == ["block_start 0 text", "block_stop 0", last]
        assert q.content == (ContentBlock(BlockKind.TEXT, ""),)
    else:
        assert entry_data(end.entries) == [last] and q.content == ()


def test_a_runner_failure_drops_held_text_and_nothing_moves_after_the_end():
    p = make(window_tokens=3)
    p.start(0.0)
    run(p, [TEXT, BlockDelta(0, "held", 1)])
    end = p.event(Failure(ErrorKind.API_ERROR, "boom", Usage(5, 1), True), USAGE, 0.0)
    assert entry_data(end.entries) == ["fail api_error"] and p.content[0].text == ""
    with pytest.raises(RuntimeError, match="after the message ended"):
        p.event(Finish(StopReason.END, USAGE), USAGE, 0.0)
    assert p.tick(1.0).entries == ()


def test_verdict_allows_only_the_pending_check():
    p = make(window_tokens=1)
    p.start(0.0)
    run(p, [TEXT, BlockDelta(0, "a", 1)])
    step = p.event(BlockDelta(0, "b", 1), USAGE, 0.0)
    assert step.check is not None and step.check.window == "ab"
    assert entry_data(p.verdict(Verdict.allow(), 0.0).entries) == ["delta 0 'a'"]


# -- replay: the same entries again from the stored trace ---------------------------------------


def _surfaces():
    from ringserve.surfaces.registry import SURFACES
    from ringserve.surfaces.responses import ResponseOptions, ResponsesSurface

    return [*SURFACES.surfaces, ResponsesSurface(ResponseOptions(metadata={"k": "v"}, background=True))]


CALL = BlockStart(1, BlockKind.TOOL_CALL, "get_weather", "ab" * 12)
ENDINGS = {
    "finish": [TEXT, BlockDelta(0, "héllo", 1), BlockDelta(0, " wörld", 1), BlockDelta(0, "!", 1), BlockStop(0),
               CALL, BlockDelta(1, '{"city":', 1), BlockDelta(1, '"Paris"}', 1), BlockStop(1),
               Finish(StopReason.TOOL_USE, Usage(5, 9))],
    "failure in a block": [TEXT, BlockDelta(0, "par", 1), BlockDelta(0, "tial", 1),
                           Failure(ErrorKind.API_ERROR, "boom", Usage(5, 2), retryable=True)],
    "empty": [Finish(StopReason.MAX_TOKENS, Usage(5, 0))],
}


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("surface", _surfaces(), ids=lambda s: s.name)
def test_replay_renders_the_entries_the_producer_appended(surface, ending):
    """Deltas coalesced at times the text does not keep (a window, a token cap), then replayed
    from the snapshot's trace: the same bytes, seq by seq, on every surface."""
    p = Producer("m_1", surface.renderer("m_1", "model", 7, True), USAGE, flush_seconds=0.05, flush_tokens=2,
                 persist_seconds=1e9, retry_ms=900)
    entries = list(p.start(0.0).entries)
    for i, event in enumerate(ENDINGS[ending]):
        entries += p.event(event, Usage(5, i), i * 0.03).entries
        entries += p.tick(i * 0.03 + 0.01).entries
    snap = p.snapshot()
    terminal = ENDINGS[ending][-1]
    again = replay("m_1", surface.renderer("m_1", "model", 7, True), USAGE, snap.content, snap.trace, terminal, 900)
    assert list(again) == entries
    assert snap.final_seq == len(entries) - 1
    if isinstance(terminal, Failure):
        assert snap.trace.failure == (ErrorKind.API_ERROR, True)


def test_replay_of_a_trace_that_does_not_fit_the_text_is_a_value_error():
    from ringserve.core.producer import Trace

    with pytest.raises(ValueError, match="past the text"):
        replay("m_1", RecordingRenderer(), USAGE, (ContentBlock(BlockKind.TEXT, "ab"),), Trace((0, 3, -1)), None, None)
    with pytest.raises(ValueError, match="starts block 1"):
        replay("m_1", RecordingRenderer(), USAGE, (ContentBlock(BlockKind.TEXT, "ab"),), Trace((0, -1, 0)), None, None)


def test_a_numbered_event_carries_the_producers_seq_in_its_data():
    """One counter: a format that numbers its events in their data (the Responses API's
    ``sequence_number``) gets the producer's seq, the one in the event's id."""
    import json

    from ringserve.surfaces.responses import RESPONSES

    p = Producer("resp_1", RESPONSES.renderer("resp_1", "model", 7, False), USAGE, flush_seconds=0.0,
                 flush_tokens=1, persist_seconds=1e9)
    entries = list(p.start(0.0).entries)
    for event in (TEXT, BlockDelta(0, "a", 1), BlockDelta(0, "b", 1), BlockStop(0), Finish(StopReason.END, USAGE)):
        entries += p.event(event, USAGE, 0.0).entries
    events = [e for entry in entries for e in SSEParser().feed(entry)]
    assert [json.loads(e.data)["sequence_number"] for e in events] == [int(e.id.rsplit(":", 1)[1]) for e in events]
    assert len(events) > 5


def test_replay_with_a_terminal_seq_numbers_the_end_after_a_log_that_holds_more_than_the_trace():
    """The end of a log whose producer died after its last snapshot (``live/resume.py``
    ``owner_lost_entries``): only the terminal entries, from the seq the log reached, rendered
    after the stored trace (a Response object's output is the stored text)."""
    import json

    from ringserve.surfaces.responses import ResponseOptions, ResponsesSurface

    surface = ResponsesSurface(ResponseOptions(metadata={"k": "v"}, background=True))
    p = Producer("resp_1", surface.renderer("resp_1", "model", 7, False), USAGE, flush_seconds=0.0, flush_tokens=1,
                 persist_seconds=1e9)
    p.start(0.0)
    for event in (TEXT, BlockDelta(0, "par", 1)):
        p.event(event, USAGE, 0.0)
    snap = p.snapshot()  # then the log went on to seq 40 before its owner died
    failure = Failure(ErrorKind.UNAVAILABLE, "gone; retry", Usage(5, 30), retryable=True)
    end = replay("resp_1", surface.renderer("resp_1", "model", 7, False), USAGE, snap.content, snap.trace, failure,
                 None, terminal_seq=41)
    events = [e for entry in end for e in SSEParser().feed(entry)]
    seqs = [json.loads(e.data)["sequence_number"] for e in events]
    assert seqs == [int(e.id.rsplit(":", 1)[1]) for e in events] == list(range(41, 41 + len(events)))
    final = json.loads(events[-1].data)
    assert final["type"] == "response.failed" and final["response"]["metadata"] == {"k": "v"}
    assert final["response"]["background"] is True
    assert final["response"]["output"][0]["content"][0]["text"] == "par"


# -- keepalives --------------------------------------------------------------------------------


def test_a_keepalive_after_each_silence_of_keepalive_seconds_and_never_after_the_end():
    """Nothing appended for 15 s (a 400 s prefill, then a pause in a block): a keepalive at each
    15 s of silence, timed from the last entry; a text release resets the clock; none after the end."""
    p = Producer("msg_1", RecordingRenderer(), USAGE, flush_seconds=0.0, flush_tokens=1, persist_seconds=1e9,
                 keepalive_seconds=15.0)
    data = entry_data(p.start(0.0).entries)
    while (deadline := p.deadline) < 400:  # the shell ticks at each deadline while the prompt is prefilled
        data += entry_data(p.tick(deadline).entries)
    assert data == ["start"] + ["keepalive"] * 26
    data = run(p, [TEXT, BlockDelta(0, "a", 1)], now=400.0)
    assert p.deadline == 415.0
    assert p.tick(414.9).entries == ()
    data += entry_data(p.tick(415.0).entries)
    data += run(p, [BlockStop(0), Finish(StopReason.END, Usage(5, 2))], now=416.0)
    assert data[-5:] == ["block_start 0 text", "delta 0 'a'", "keepalive", "block_stop 0", "finish end"]
    assert p.deadline == float("inf") and p.tick(1000.0).entries == ()


def test_without_keepalive_seconds_a_silence_appends_nothing():
    p = make()
    p.start(0.0)
    assert p.deadline == float("inf") and p.tick(1e6).entries == ()


@pytest.mark.parametrize("surface", _surfaces(), ids=lambda s: s.name)
def test_keepalives_are_numbered_like_every_entry_and_replayed_where_they_were(surface):
    """Keepalives before the first block, inside a text block and inside a call: the seqs count
    them, the snapshot's trace keeps them, and a rebuild from the store renders the same bytes."""
    p = Producer("m_1", surface.renderer("m_1", "model", 7, True), USAGE, flush_seconds=0.05, flush_tokens=2,
                 persist_seconds=1e9, retry_ms=900, keepalive_seconds=15.0)
    entries = list(p.start(0.0).entries)
    entries += p.tick(15.0).entries + p.tick(30.0).entries
    events = ENDINGS["finish"]
    for i, event in enumerate(events):
        now = 31.0 + 20 * i
        entries += p.tick(now - 1).entries  # 19 s after the last event: its text, then a keepalive
        entries += p.event(event, Usage(5, i), now).entries
    snap = p.snapshot()
    again = replay("m_1", surface.renderer("m_1", "model", 7, True), USAGE, snap.content, snap.trace, events[-1], 900)
    assert list(again) == entries
    assert snap.trace.ops.count(-2) >= 3 or surface.name == "openai"
    parsed = [e for entry in entries for e in SSEParser().feed(entry)]
    assert [e.id for e in parsed] == [f"m_1:{i}" for i in range(len(parsed))]


def test_each_responses_keepalive_is_a_strict_in_progress_event_with_the_whole_output_so_far():
    """What the OpenAI Node SDK's stream helper replaces its snapshot with (docs/agents.md): the
    same response id, every item so far with its text or arguments, the next sequence number."""
    import json

    from openai.types.responses import ResponseInProgressEvent

    from ringserve.surfaces.responses import RESPONSES

    p = Producer("resp_1", RESPONSES.renderer("resp_1", "model", 7, False), USAGE, flush_seconds=0.0,
                 flush_tokens=1, persist_seconds=1e9, keepalive_seconds=1.0)
    entries = list(p.start(0.0).entries) + list(p.tick(1.0).entries)
    for event in (TEXT, BlockDelta(0, "Hel", 1), BlockStop(0), CALL, BlockDelta(1, '{"city":', 1)):
        entries += p.event(event, USAGE, 2.0).entries
    entries += p.tick(3.0).entries
    events = [e for entry in entries for e in SSEParser().feed(entry)]
    keepalives = [(i, json.loads(e.data)) for i, e in enumerate(events) if e.event == "response.in_progress"]
    assert [i for i, _ in keepalives] == [1, 2, len(events) - 1]  # the opening one, then one per silence
    for i, data in keepalives:
        event = ResponseInProgressEvent.model_validate(data, strict=True)
        assert event.sequence_number == i and event.response.id == "resp_1"
    last = keepalives[-1][1]["response"]["output"]
    assert [item["type"] for item in last] == ["message", "function_call"]
    assert last[0]["content"][0]["text"] == "Hel" and last[1]["arguments"] == '{"city":'


# -- log probabilities -------------------------------------------------------------------------


def lp(piece: str) -> TokenLogprob:
    return TokenLogprob(piece.encode(), -0.5, (TopLogprob(piece.encode(), -0.5), TopLogprob(b"x", -1.5)))


class LogprobRenderer(RecordingRenderer):
    """Each delta with the tokens its log probabilities are of: ``delta 0 'Hello' [Hel,lo]``."""

    def delta(self, delta):
        pieces = ",".join(lp.piece.decode() for lp in delta.logprobs)
        return [WireEvent(f"delta {delta.index} {delta.text!r} [{pieces}]")]


def test_coalesced_deltas_carry_all_their_tokens_log_probabilities():
    p = Producer("msg_1", LogprobRenderer(), USAGE, flush_seconds=0.05, flush_tokens=10, persist_seconds=1e9)
    p.start(0.0)
    data = run(p, [TEXT, BlockDelta(0, "Hel", 1, (lp("Hel"),))], now=0.0)
    data += run(p, [BlockDelta(0, "lo", 1, (lp("lo"),)), BlockDelta(0, " you", 1, (lp(" y"), lp("ou")))], now=0.01)
    data += entry_data(p.tick(0.05).entries)
    assert data == ["block_start 0 text", "delta 0 'Hel' [Hel]", "delta 0 'lo you' [lo, y,ou]"]
    assert p.content[0].logprobs == (lp("Hel"), lp("lo"), lp(" y"), lp("ou"))
    data += run(p, [BlockStop(0), Finish(StopReason.END, Usage(5, 4))])
    snap = p.snapshot()
    assert snap.trace.logprobs == (1, 3)  # the first delta's too
    again = replay("msg_1", LogprobRenderer(), USAGE, snap.content, snap.trace, Finish(StopReason.END, Usage(5, 4)),
                   None)
    assert entry_data(again) == ["start", *data]


def test_held_back_text_releases_its_tokens_log_probabilities_with_it():
    """The safety stage releases the text that falls out of its window (and the rest at the
    block's stop): each token's log probability goes out with the text that ends its token."""
    p = Producer("msg_1", LogprobRenderer(), USAGE, flush_seconds=0.0, flush_tokens=1, persist_seconds=1e9,
                 window_tokens=2)
    p.start(0.0)
    checker = PatternChecker(["bad"])
    data = run(p, [TEXT, BlockDelta(0, "ab", 1, (lp("ab"),)), BlockDelta(0, "cd", 1, (lp("cd"),))], checker=checker)
    assert data == ["block_start 0 text"]
    data += run(p, [BlockDelta(0, "e", 1, (lp("e"),)), BlockStop(0)], checker=checker)
    assert data == ["block_start 0 text", "delta 0 'ab' [ab]", "delta 0 'cde' [cd,e]", "block_stop 0"]


@pytest.mark.parametrize("surface", _surfaces(), ids=lambda s: s.name)
def test_replay_gives_the_same_log_probabilities_in_the_same_entries(surface):
    """Coalesced at times the text does not keep, with a call between two text blocks: the
    snapshot's content and trace rebuild the same bytes, and a message without any has no counts."""
    events = [BlockStart(0, BlockKind.TOOL_CALL, "g", "cd" * 12), BlockDelta(0, "{}", 2), BlockStop(0),
              BlockStart(1, BlockKind.TEXT), BlockDelta(1, "héllo", 1, (lp("h"), lp("éllo"))),
              BlockDelta(1, " wörld", 1, (lp(" wö"),)), BlockDelta(1, "!", 1, (lp("rld"), lp("!"))), BlockStop(1),
              BlockStart(2, BlockKind.TOOL_CALL, "f", "ab" * 12), BlockDelta(2, "{}", 3), BlockStop(2),
              BlockStart(3, BlockKind.TEXT), BlockDelta(3, "ok", 1, (lp("ok"),)), BlockStop(3),
              Finish(StopReason.END, Usage(5, 12))]
    p = Producer("m_1", surface.renderer("m_1", "model", 7, True), USAGE, flush_seconds=0.05, flush_tokens=2,
                 persist_seconds=1e9, retry_ms=900)
    entries = list(p.start(0.0).entries)
    for i, event in enumerate(events):
        entries += p.event(event, Usage(5, i), i * 0.03).entries
        entries += p.tick(i * 0.03 + 0.01).entries
    snap = p.snapshot()
    assert snap.content[1].logprobs == (lp("h"), lp("éllo"), lp(" wö"), lp("rld"), lp("!"))
    assert snap.content[3].logprobs == (lp("ok"),) and snap.content[0].logprobs == snap.content[2].logprobs == ()
    assert sum(snap.trace.logprobs) == 6 and len(snap.trace.logprobs) == sum(op > 0 for op in snap.trace.ops)
    again = replay("m_1", surface.renderer("m_1", "model", 7, True), USAGE, snap.content, snap.trace, events[-1], 900)
    assert list(again) == entries
    with pytest.raises(ValueError, match="log probabilities past"):
        replay("m_1", surface.renderer("m_1", "model", 7, True), USAGE,
               tuple(attrs.evolve(b, logprobs=()) for b in snap.content), snap.trace, events[-1], 900)
    plain = Producer("m_2", RecordingRenderer(), USAGE, flush_seconds=0.0, flush_tokens=1, persist_seconds=1e9)
    plain.start(0.0)
    run(plain, [TEXT, BlockDelta(0, "a", 1), BlockStop(0)])
    assert plain.snapshot().trace.logprobs == ()
