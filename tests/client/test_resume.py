"""The resume core as values: bytes in, events, requests and waits out; the Phase table.

No server and no clock: each test drives :class:`ResumeState` as a shell would, with the bytes
the server's renderers write (``tests/support/helpers.py`` ``rendered``), whole or split anywhere
(h11's ``tests/test_io.py`` habit).
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from ringserve.client import (
    Backoff,
    ClientError,
    ConnectionLost,
    NoServer,
    Phase,
    PhaseError,
    RequestTimeout,
    ResumeState,
    StreamError,
    ToolCall,
)
from ringserve.client._resume import TRANSITIONS, Body, Trigger
from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop, Finish, StopReason, Usage
from ringserve.core.sse import encode_comment
from ringserve.surfaces.registry import SURFACES
from tests.support.helpers import rendered

FAST = Backoff(base=0.002, cap=0.02)
MID = "msg_" + "1" * 24
EVENT_STREAM = {"content-type": "text/event-stream; charset=utf-8", "x-message-id": MID}
REPLY = "Résumé ✓ 👍🏽 你好"
#: A reply in one text block, one delta per character (so an event boundary falls inside every character's bytes).
EVENTS = [BlockStart(0, BlockKind.TEXT), *(BlockDelta(0, c, 1) for c in REPLY), BlockStop(0),
          Finish(StopReason.END, Usage(5, len(REPLY)))]


def server_bytes(surface: str = "anthropic", message_id: str = MID, events: list | None = None) -> bytes:
    return rendered(SURFACES.by_name(surface), EVENTS if events is None else events, message_id=message_id)


def opened(state: ResumeState, headers: dict[str, str] = EVENT_STREAM) -> ResumeState:
    assert state.received(200, headers) is Body.EVENTS
    return state


def follow(**kwargs) -> ResumeState:
    kwargs.setdefault("surface", "anthropic")
    return ResumeState.follow(MID, now=0.0, timeout=kwargs.pop("timeout", None), **kwargs)


def head(events: int, surface: str = "anthropic") -> bytes:
    """The first ``events`` complete events of :func:`server_bytes`."""
    return b"".join(block + b"\n\n" for block in server_bytes(surface).split(b"\n\n")[:events])


def split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=min(40, len(data) - 1)))
    return [data[a:b] for a, b in itertools.pairwise([0, *cuts, len(data)])]


# -- bytes in, events out --------------------------------------------------------------------------


@pytest.mark.parametrize("surface", ["anthropic", "openai", "responses"])
def test_the_same_events_whole_byte_by_byte_and_split_anywhere(surface: str) -> None:
    data = server_bytes(surface, {"anthropic": MID, "openai": "chatcmpl-x", "responses": "resp_x"}[surface])
    feeds = {"whole": [data], "bytes": [data[i:i + 1] for i in range(len(data))],
             "random": split(data, random.Random(7))}
    results = {}
    for name, chunks in feeds.items():
        state = opened(ResumeState.follow("?", surface=surface, now=0.0, timeout=None), {"content-type":
                                                                                        "text/event-stream"})
        state.message_id = None  # learnt from the first event's id
        events = [event for piece in chunks for event in state.feed(piece)]
        results[name] = (events, state.finish_or_raise())
    assert results["whole"] == results["bytes"] == results["random"]
    events, final = results["whole"]
    assert final.text == REPLY == "".join(e.text for e in events)
    assert [e.seq for e in events] == list(range(len(events)))


def test_duplicates_are_dropped_a_gap_or_another_message_refused() -> None:
    blocks = [head(n + 1)[len(head(n)):] for n in range(6)]  # one SSE block each
    state = follow()
    assert "Last-Event-ID" not in state.next_request().headers
    opened(state)
    assert [e.seq for e in state.feed(b"".join(blocks[:3]))] == [0, 1, 2]
    assert state.feed(b"".join(blocks[:3])) == []  # replayed after a reconnect: dropped
    assert state.feed(encode_comment("ping")) == []  # a heartbeat dispatches nothing
    assert [e.text for e in state.feed(blocks[3])] == [REPLY[1]]
    assert state.last_event_id == f"{MID}:3"
    with pytest.raises(ClientError, match="gap"):
        state.feed(blocks[5])
    assert state.phase is Phase.FAILED and state.error is not None and state.error.text == REPLY[:2]
    with pytest.raises(ClientError, match="does not belong"):
        opened(follow()).feed(server_bytes(message_id="msg_other"))


def test_events_after_the_terminal_one_are_not_read() -> None:
    state = opened(follow())
    events = state.feed(server_bytes() + server_bytes())  # a second copy after message_stop
    assert state.done and state.leave and events[-1].event == "message_stop"
    assert state.finish_or_raise().text == REPLY


# -- requests and waits out ---------------------------------------------------------------------------


def test_a_drop_mid_event_resumes_with_last_event_id_and_drops_the_half_event() -> None:
    data = server_bytes()
    cut = data.index(b"\n\n", len(data) // 2) + 5  # inside the event after a complete one
    state = ResumeState.create("anthropic", {"model": "m"}, now=0.0, timeout=None, backoff=FAST, rng=random.Random(1))
    post = state.next_request()
    assert (post.method, post.url, post.json) == ("POST", "/v1/messages", {"model": "m"})
    assert post.headers["Ringserve-Disconnect-Policy"] == "continue" and post.headers["Idempotency-Key"]
    delivered = opened(state).feed(data[:cut])
    wait = state.reconnect(None, 0.0)
    assert wait is not None and (wait.attempt, wait.cause) == (1, "the stream closed before its terminal event")
    assert 0 <= wait.delay <= FAST.bound(0) and wait.last_event_id == f"{MID}:{delivered[-1].seq}"
    resume = state.next_request()
    assert (resume.method, resume.url, resume.headers["Last-Event-ID"]) == ("GET", f"/v1/messages/{MID}/stream",
                                                                            wait.last_event_id)
    delivered += opened(state).feed(data)  # the server replays from the start here: duplicates dropped
    assert state.finish_or_raise().text == REPLY == "".join(e.text for e in delivered)
    assert [e.seq for e in delivered] == list(range(len(delivered))) and state.reconnects == 1


def test_a_create_request_that_named_no_message_is_sent_again_with_the_same_key() -> None:
    state = ResumeState.create("responses", {"input": "hi"}, now=0.0, timeout=None, backoff=FAST)
    key = state.next_request().headers["Idempotency-Key"]
    assert state.answered(503, {"retry-after": "0"}, b"{}") == []
    assert state.reconnect(None, 0.0) is not None and state.phase is Phase.CREATE
    opened(state, {"content-type": "text/event-stream"})  # no X-Message-Id
    state.reconnect(OSError("reset"), 0.0)  # dropped before the first event named it
    again = state.next_request()
    assert (again.method, again.url, again.headers["Idempotency-Key"]) == ("POST", "/v1/responses", key)


def test_gives_up_after_max_retries_without_progress_and_resets_on_progress() -> None:
    state = follow(max_retries=2, backoff=FAST)
    state.received(502, {})
    state.answered(502, {}, b"")
    assert state.reconnect(None, 0.0).attempt == 1
    assert opened(state).feed(head(1))  # progress resets the count
    assert state.reconnect(OSError("boom"), 0.0).cause == "OSError: boom"
    assert state.reconnect(OSError(), 0.0).attempt == 2  # (the request failed before an answer)
    with pytest.raises(ConnectionLost, match="gave up after 2 retries"):
        state.reconnect(None, 0.0)
    assert state.phase is Phase.FAILED


def test_retry_after_and_the_deadline() -> None:
    state = follow(timeout=10.0, backoff=FAST)
    state.answered(503, {"retry-after": "3"}, b"{}")
    wait = state.reconnect(None, 0.0)
    assert wait.delay >= 3.0 and wait.cause == "HTTP 503"
    state.answered(529, {"retry-after": "3"}, b"{}")
    with pytest.raises(RequestTimeout):
        state.reconnect(None, 8.0)  # the next attempt would start after the deadline


def test_an_ended_stream_reads_the_stored_message_then_polls_until_it_ends() -> None:
    """204 (nothing after the last event) switches to the stored message at once; a message still generating
    is polled with backoff; its text arrives as fallback events."""
    state = follow(backoff=FAST)
    opened(state).feed(head(5))
    have = state.text
    assert have == REPLY[:3]
    state.reconnect(None, 0.0)  # dropped; the resume finds the stream ended
    assert state.answered(204, {}, b"") == []
    wait = state.reconnect(None, 0.0)
    assert (wait.attempt, wait.delay, wait.last_event_id) == (0, 0.0, None) and "ended (204)" in wait.cause
    assert state.next_request().url == f"/v1/messages/{MID}" and state.received(200, {}) is Body.WHOLE
    running = {"status": "generating", "text": REPLY[:len(have) + 1], "usage": {}}
    assert [e.text for e in state.answered(200, {}, json.dumps(running).encode())] == [REPLY[len(have)]]
    assert state.reconnect(None, 0.0).cause == "the message is still generating"
    done = {"status": "complete", "text": REPLY, "stop_reason": "end_turn", "usage": {"input_tokens": 5,
            "output_tokens": 9}, "model": "fake", "content": [{"type": "text", "text": REPLY},
                                                              {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                               "input": {"a": 1}}]}
    events = state.answered(200, {}, json.dumps(done).encode())
    assert [(e.seq, e.event, e.text) for e in events] == [(None, "fallback", REPLY[len(have) + 1:])]
    final = state.finish_or_raise()
    assert (final.text, final.stop_reason, final.usage.output_tokens) == (REPLY, "end_turn", 9)
    assert final.tool_calls == events[0].tool_calls == (ToolCall("toolu_1", "f", '{"a":1}'),)


def test_stored_text_that_does_not_continue_the_stream_is_an_error() -> None:
    state = follow()
    opened(state).feed(head(5))
    state.reconnect(None, 0.0)
    state.answered(410, {}, b"")
    state.reconnect(None, 0.0)
    with pytest.raises(ClientError, match="stored text does not continue"):
        state.answered(200, {}, json.dumps({"status": "complete", "text": "other"}).encode())


def test_a_failed_stored_message_raises_a_stream_error() -> None:
    state = follow()
    state.answered(410, {}, b"")
    state.reconnect(None, 0.0)
    with pytest.raises(StreamError, match="interrupted"):
        state.answered(200, {}, json.dumps({"status": "interrupted", "text": ""}).encode())


def test_follow_without_a_surface_looks_it_up_first() -> None:
    state = ResumeState.follow(MID, now=0.0, timeout=None)
    lookup = state.next_request()
    assert (state.phase, lookup.method, lookup.url) == (Phase.LOOKUP, "GET", f"/v1/messages/{MID}")
    assert state.received(200, {"content-type": "application/json"}) is Body.WHOLE
    assert state.answered(200, {}, json.dumps({"id": MID, "surface": "responses"}).encode()) == []
    assert state.reconnect(None, 0.0) is None and state.reconnects == 0  # not a reconnect
    assert state.next_request().url == f"/v1/messages/{MID}/stream" and state.wire.name == "responses"
    unknown = ResumeState.follow(MID, now=0.0, timeout=None)
    with pytest.raises(ClientError, match="surface 'gemini'"):
        unknown.answered(200, {}, json.dumps({"surface": "gemini"}).encode())


def test_an_http_error_ends_the_stream() -> None:
    state = follow()
    with pytest.raises(ClientError, match="HTTP 404 not_found_error: no message"):
        state.answered(404, {}, json.dumps({"type": "error", "error": {"type": "not_found_error",
                                                                       "message": "no message"}}).encode())
    with pytest.raises(ClientError, match="expected an event stream"):
        follow().answered(200, {}, b"{}")


# -- the Phase table --------------------------------------------------------------------------------


def test_every_move_the_table_lacks_raises_naming_the_phase_and_the_trigger() -> None:
    for phase in Phase:
        for trigger in Trigger:
            state = follow()
            state.phase = phase
            if trigger in TRANSITIONS[phase]:
                state._move(trigger)
                assert state.phase is TRANSITIONS[phase][trigger]
            else:
                with pytest.raises(PhaseError, match=f"{trigger.name} is not a move in phase {phase.name}"):
                    state._move(trigger)


def test_the_table_every_phase_but_the_ends_can_fail_and_only_done_finishes() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.DONE] == TRANSITIONS[Phase.FAILED] == {}
    assert all(moves[Trigger.ERROR] is Phase.FAILED for phase, moves in TRANSITIONS.items() if moves)
    assert {p for p, moves in TRANSITIONS.items() for t, to in moves.items() if to is Phase.DONE} == {Phase.READ,
                                                                                                   Phase.FETCH}


def test_calls_out_of_phase_are_phase_errors() -> None:
    state = follow()
    with pytest.raises(PhaseError, match="feed is not allowed in phase STREAM"):
        state.feed(b"data: x\n\n")
    opened(state).feed(server_bytes())
    for call in (state.next_request, lambda: state.received(200, EVENT_STREAM), lambda: state.reconnect(None, 0.0)):
        with pytest.raises(PhaseError, match="phase DONE"):
            call()
    with pytest.raises(PhaseError, match="surface is not known yet"):
        _ = ResumeState.follow(MID, now=0.0, timeout=None).wire


# -- backoff ---------------------------------------------------------------------------------------


def test_backoff_is_exponential_with_full_jitter() -> None:
    backoff, rng = Backoff(base=0.1, cap=2.0), random.Random(7)
    assert [backoff.bound(n) for n in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert backoff.bound(10_000) == 2.0
    for n in range(8):
        delays = [backoff.delay(n, rng) for _ in range(400)]
        assert all(0.0 <= d <= backoff.bound(n) for d in delays)
        # Full jitter: spread over the whole range, not clustered near the bound.
        assert min(delays) < 0.1 * backoff.bound(n) and max(delays) > 0.9 * backoff.bound(n)
    with pytest.raises(ValueError):
        Backoff(base=1.0, cap=0.5)


def test_a_refused_connection_the_shell_found_unanswered_fails_at_once() -> None:
    state = follow(backoff=FAST)
    with pytest.raises(NoServer, match=r"nothing listens at the server's address \(ConnectionRefusedError: no\)"):
        state.reconnect(ConnectionRefusedError("no"), 0.0, refused=True)
    assert state.phase is Phase.FAILED and state.reconnects == 0


def test_a_retry_says_the_servers_reason():
    """What a retry may not fix (a model that cannot be loaded) is said at the first retry, not
    only as ``HTTP 503`` after the last."""
    state = follow(timeout=10.0, backoff=FAST)
    body = b'{"type": "error", "error": {"type": "overloaded_error", "message": "the model \'gone\' cannot be loaded"}}'
    state.answered(503, {"retry-after": "1"}, body)
    assert state.reconnect(None, 0.0).cause == "HTTP 503: the model 'gone' cannot be loaded"
