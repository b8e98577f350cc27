"""The client's wires read what the server's renderers write, on every surface.

Each test renders ``core/events.py`` values with the server's own renderer and producer
(``tests/support/helpers.py`` ``rendered``: ``surfaces/*`` renderers, ``core/sse.py`` encoding),
feeds the bytes to a :class:`ResumeState` and compares what the client read with what was
rendered, reasoning in every form a surface shows it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ringserve.client import ClientError, FinalMessage, ResumeState, StreamError, StreamEvent, ToolCall, Usage
from ringserve.client import _wires
from ringserve.core.errors import ErrorKind
from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop, ContentBlock, Failure, Finish, StopReason
from ringserve.core.events import Usage as ServerUsage
from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.core.sse import encode_event
from ringserve.core.status import MessageStatus
from ringserve.surfaces import anthropic, openai, responses
from ringserve.core.view import MessageView
from ringserve.surfaces.base import CANCELLED_KEY
from ringserve.surfaces.registry import SURFACES
from ringserve.surfaces.ringserve import message_status_json
from tests.support.helpers import rendered

SURFACE_NAMES = [surface.name for surface in SURFACES.surfaces]
IDS = {"anthropic": "msg_" + "1" * 24, "openai": "chatcmpl-" + "2" * 24, "responses": "resp_" + "3" * 24}
CALL_A, CALL_B = "a" * 24, "b" * 24
#: What each surface prefixes to a call's neutral id.
CALL_PREFIX = {"anthropic": "toolu_", "openai": "call_", "responses": "call_"}
EVENT_STREAM = {"content-type": "text/event-stream", "x-message-id": ""}

TOOL_REPLY = [
    BlockStart(0, BlockKind.TEXT), BlockDelta(0, "Let me ", 1), BlockDelta(0, "check 👋.", 1), BlockStop(0),
    BlockStart(1, BlockKind.TOOL_CALL, "get_weather", CALL_A),
    BlockDelta(1, '{"city', 1), BlockDelta(1, '": "Par', 1), BlockDelta(1, 'is"}', 1), BlockStop(1),
    BlockStart(2, BlockKind.TOOL_CALL, "get_time", CALL_B), BlockDelta(2, "{}", 1), BlockStop(2),
    Finish(StopReason.TOOL_USE, ServerUsage(7, 12, cached_tokens=3)),
]


def read(surface: str, data: bytes) -> tuple[ResumeState, list[StreamEvent]]:
    """A stream of ``surface`` opened on ``data``, all of it fed at once."""
    state = ResumeState.follow(IDS[surface], surface=surface, now=0.0, timeout=None)
    state.received(200, EVENT_STREAM)
    return state, state.feed(data)


def final_of(surface: str, events: list[Any]) -> FinalMessage:
    state, _ = read(surface, rendered(SURFACES.by_name(surface), events, message_id=IDS[surface]))
    return state.finish_or_raise()


def stop_spelling(surface: str, reason: StopReason) -> str:
    """The server's spelling of ``reason`` on ``surface``'s stream (Responses: status or incomplete reason)."""
    if surface == "responses":
        outcome = responses.finish_outcome(reason)
        return outcome.incomplete_reason or outcome.status
    return SURFACES.by_name(surface).stop_reason(reason)


@pytest.mark.parametrize("surface", SURFACE_NAMES)
def test_text_tool_calls_stop_reason_and_usage(surface: str) -> None:
    state, events = read(surface, rendered(SURFACES.by_name(surface), TOOL_REPLY, message_id=IDS[surface]))
    final = state.finish_or_raise()
    prefix = CALL_PREFIX[surface]
    calls = (ToolCall(prefix + CALL_A, "get_weather", '{"city": "Paris"}'), ToolCall(prefix + CALL_B, "get_time", "{}"))
    assert final == FinalMessage(IDS[surface], "Let me check 👋.", stop_spelling(surface, StopReason.TOOL_USE), None,
                                 Usage(7, 12), "fake", False, calls)
    # the events say it piece by piece: each call's first delta names it, the fragments rebuild its arguments
    assert "".join(e.text for e in events) == final.text
    deltas = [d for e in events for d in e.tool_deltas]
    assert [(d.index, d.call_id, d.name) for d in deltas if d.call_id] == [(0, calls[0].call_id, "get_weather"),
                                                                           (1, calls[1].call_id, "get_time")]
    for index, call in enumerate(calls):
        assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments
    assert tuple(c for e in events for c in e.tool_calls) == calls  # each completes once, in order
    assert [e.seq for e in events] == list(range(len(events)))


@pytest.mark.parametrize("surface", SURFACE_NAMES)
@pytest.mark.parametrize("reason", list(StopReason))
def test_every_stop_reason_in_the_servers_spelling(surface: str, reason: StopReason) -> None:
    """The stop reason the renderer spells is the client's; a cancel is marked (CANCELLED_KEY on two surfaces,
    status ``cancelled`` on Responses)."""
    final = final_of(surface, [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "hi", 1), BlockStop(0),
                               Finish(reason, ServerUsage(3, 1), "STOP" if reason is StopReason.STOP_SEQUENCE else None)])
    assert (final.text, final.stop_reason, final.cancelled) == ("hi", stop_spelling(surface, reason),
                                                               reason is StopReason.CANCELLED)
    if surface == "anthropic":  # only Anthropic streams the stop sequence
        assert final.stop_sequence == ("STOP" if reason is StopReason.STOP_SEQUENCE else None)


def test_the_cancelled_key_is_the_servers() -> None:
    assert _wires.CANCELLED_KEY == CANCELLED_KEY


#: Each surface's in-band error type for a failure kind (the server's tables).
ERROR_TYPE = {
    "anthropic": lambda kind: anthropic.ERROR_TYPES[kind],
    "openai": lambda kind: openai.ERROR_TYPES[kind][0],
    "responses": lambda kind: responses.FAILURE_CODES.get(kind, "server_error"),
}


@pytest.mark.parametrize("surface", SURFACE_NAMES)
@pytest.mark.parametrize("kind", [ErrorKind.API_ERROR, ErrorKind.OVERLOADED, ErrorKind.INVALID_REQUEST])
def test_an_in_band_error_raises_with_the_surfaces_type(surface: str, kind: ErrorKind) -> None:
    data = rendered(SURFACES.by_name(surface), [BlockStart(0, BlockKind.TEXT), BlockDelta(0, "so far", 1),
                                                Failure(kind, "it broke", ServerUsage(3, 1))], message_id=IDS[surface])
    state = ResumeState.follow(IDS[surface], surface=surface, now=0.0, timeout=None)
    state.received(200, EVENT_STREAM)
    with pytest.raises(StreamError) as caught:
        state.feed(data)
    assert (caught.value.type, str(caught.value)) == (ERROR_TYPE[surface](kind), f"{ERROR_TYPE[surface](kind)}: it broke")
    assert (caught.value.text, caught.value.message_id, state.text) == ("so far", IDS[surface], "so far")


@pytest.mark.parametrize("surface", SURFACE_NAMES)
def test_a_call_cut_by_a_cancel_completes_with_the_arguments_so_far(surface: str) -> None:
    final = final_of(surface, [BlockStart(0, BlockKind.TOOL_CALL, "get_weather", CALL_A), BlockDelta(0, '{"ci', 1),
                               BlockStop(0), Finish(StopReason.CANCELLED, ServerUsage(3, 2))])
    assert final.tool_calls == (ToolCall(CALL_PREFIX[surface] + CALL_A, "get_weather", '{"ci'),) and final.cancelled


def test_openai_without_include_usage_switches_to_the_stored_message() -> None:
    data = rendered(SURFACES.by_name("openai"), TOOL_REPLY, message_id=IDS["openai"], include_usage=False)
    state, events = read("openai", data)
    assert not state.done and state.leave and events[-1].data == "[DONE]"
    assert state.next_request().url == f"/v1/messages/{IDS['openai']}"


# -- reasoning, as the server's renderers write it ------------------------------------------------

SIGNER = ReasoningSigner.from_text(new_key())

#: Thinking, an answer, more thinking (gpt-oss interleaves), a call.
THINKING_REPLY = [
    BlockStart(0, BlockKind.REASONING), BlockDelta(0, "Hmm, ", 1), BlockDelta(0, "French.", 1), BlockStop(0),
    BlockStart(1, BlockKind.TEXT), BlockDelta(1, "Bonjour", 1), BlockStop(1),
    BlockStart(2, BlockKind.REASONING), BlockDelta(2, " Then the weather.", 1), BlockStop(2),
    BlockStart(3, BlockKind.TOOL_CALL, "get_weather", CALL_A), BlockDelta(3, '{"city": "Paris"}', 1), BlockStop(3),
    Finish(StopReason.TOOL_USE, ServerUsage(4, 9, reasoning_tokens=5)),
]
#: Every way a surface shows reasoning: its default, Anthropic's omitted display (no text on the
#: wire: the client reads none), Responses' summary and encrypted content.
REASONING_ECHOES = [("anthropic", ""), ("anthropic", '{"thinking_display":"omitted"}'), ("openai", ""),
                    ("responses", ""), ("responses", '{"reasoning":{"summary":"auto"},"include":["reasoning.encrypted_content"]}')]


def read_echoed(surface: str, echo: str, events: list[Any]) -> tuple[ResumeState, list[StreamEvent]]:
    return read(surface, rendered(SURFACES.by_name(surface).restored(echo, SIGNER), events, message_id=IDS[surface]))


@pytest.mark.parametrize(("surface", "echo"), REASONING_ECHOES)
def test_reasoning_is_read_apart_from_the_text(surface: str, echo: str) -> None:
    state, events = read_echoed(surface, echo, THINKING_REPLY)
    final = state.finish_or_raise()
    thought = "" if "omitted" in echo else "Hmm, French. Then the weather."
    assert (final.text, final.reasoning, final.usage) == ("Bonjour", thought, Usage(4, 9))
    assert final.tool_calls == (ToolCall(CALL_PREFIX[surface] + CALL_A, "get_weather", '{"city": "Paris"}'),)
    assert "".join(e.reasoning for e in events) == thought and "".join(e.text for e in events) == "Bonjour"


@pytest.mark.parametrize(("surface", "echo"), REASONING_ECHOES)
def test_a_reply_cut_inside_its_thinking_ends_cleanly(surface: str, echo: str) -> None:
    """Cut by max_tokens (the block stopped), by a cancel (the producer stops it) or by a failure."""
    cut = [BlockStart(0, BlockKind.REASONING), BlockDelta(0, "Hmm", 1)]
    for end in (BlockStop(0), Finish(StopReason.MAX_TOKENS, ServerUsage(4, 2, reasoning_tokens=2))), (
            Finish(StopReason.CANCELLED, ServerUsage(4, 2)),):
        final = read_echoed(surface, echo, [*cut, *end])[0].finish_or_raise()
        assert (final.text, final.reasoning) == ("", "" if "omitted" in echo else "Hmm")
        assert final.stop_reason == stop_spelling(surface, end[-1].stop_reason)
    state = ResumeState.follow(IDS[surface], surface=surface, now=0.0, timeout=None)
    state.received(200, EVENT_STREAM)
    with pytest.raises(StreamError):
        state.feed(rendered(SURFACES.by_name(surface).restored(echo, SIGNER),
                            [*cut, Failure(ErrorKind.API_ERROR, "it broke", ServerUsage(4, 2))], message_id=IDS[surface]))
    assert state.reasoning == ("" if "omitted" in echo else "Hmm")


# -- the stored message, read when the stream log is gone ------------------------------------------

BLOCKS = (ContentBlock(BlockKind.TEXT, "Let me check."), ContentBlock(BlockKind.TOOL_CALL, '{"city": "Paris"}',
                                                                       "get_weather", CALL_A))


@pytest.mark.parametrize(("surface", "echo"), [(s, e) for s, e in REASONING_ECHOES if s != "responses"])
def test_a_stored_messages_reasoning(surface: str, echo: str) -> None:
    view = MessageView(IDS[surface], surface, "fake", 0, MessageStatus.COMPLETE, (
        ContentBlock(BlockKind.REASONING, "Hmm."), *BLOCKS), StopReason.TOOL_USE, None, ServerUsage(7, 12), None)
    body = message_status_json(view, SURFACES.by_name(surface).restored(echo, SIGNER))
    assert _wires.wire(surface).stored(json.loads(json.dumps(body))).reasoning == ("" if "omitted" in echo else "Hmm.")


@pytest.mark.parametrize("echo", [e for s, e in REASONING_ECHOES if s == "responses"])
def test_a_stored_responses_reasoning(echo: str) -> None:
    view = MessageView(IDS["responses"], "responses", "fake", 0, MessageStatus.COMPLETE, (
        ContentBlock(BlockKind.REASONING, "Hmm."), *BLOCKS), StopReason.TOOL_USE, None, ServerUsage(7, 12), None)
    body = responses.RESPONSES.restored(echo, SIGNER).message_json(view)
    assert _wires.wire("responses").stored(json.loads(json.dumps(body))).reasoning == "Hmm."


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
def test_the_stored_message_status_with_its_content_in_the_surfaces_shape(surface: str) -> None:
    view = MessageView(IDS[surface], surface, "fake", 0, MessageStatus.COMPLETE, BLOCKS,
                       StopReason.TOOL_USE, None, ServerUsage(7, 12, cached_tokens=3), None)
    stored = _wires.wire(surface).stored(json.loads(json.dumps(message_status_json(view, SURFACES.by_name(surface)))))
    assert stored == _wires.Stored(
        running=False, text="Let me check.", tool_calls=(ToolCall(CALL_PREFIX[surface] + CALL_A, "get_weather",
                                                                   '{"city":"Paris"}' if surface == "anthropic"
                                                                   else '{"city": "Paris"}'),),
        stop_reason=stop_spelling(surface, StopReason.TOOL_USE), usage=Usage(7, 12), model="fake")


@pytest.mark.parametrize(("status", "running", "error"), [
    (MessageStatus.QUEUED, True, None), (MessageStatus.GENERATING, True, None),
    (MessageStatus.FAILED, False, ("api_error", "it broke")),
    (MessageStatus.INTERRUPTED, False, ("interrupted", "the server stopped before the message was finished")),
    (MessageStatus.CANCELLED, False, None),
])
def test_a_stored_status_says_running_failed_or_ended(status: MessageStatus, running: bool,
                                                      error: tuple[str, str] | None) -> None:
    view = MessageView(IDS["anthropic"], "anthropic", "fake", 0, status, BLOCKS[:1], None,
                       None, ServerUsage(7, 1), "it broke" if status is MessageStatus.FAILED else None)
    stored = _wires.wire("anthropic").stored(message_status_json(view, SURFACES.by_name("anthropic")))
    assert (stored.running, stored.error, stored.cancelled) == (running, error, status is MessageStatus.CANCELLED)


@pytest.mark.parametrize("reason", [StopReason.TOOL_USE, StopReason.MAX_TOKENS, StopReason.CANCELLED])
def test_the_stored_response_object(reason: StopReason) -> None:
    status = MessageStatus.CANCELLED if reason is StopReason.CANCELLED else MessageStatus.COMPLETE
    result = MessageView(IDS["responses"], "responses", "fake", 0, status, BLOCKS,
                         None if reason is StopReason.CANCELLED else reason, None, ServerUsage(7, 12, 3))
    stored = _wires.wire("responses").stored(responses.RESPONSES.message_json(result))
    assert stored == _wires.Stored(running=False, text="Let me check.", tool_calls=(
        ToolCall("call_" + CALL_A, "get_weather", '{"city": "Paris"}'),), stop_reason=stop_spelling("responses", reason),
        usage=Usage(7, 12), model="fake", cancelled=reason is StopReason.CANCELLED)
    assert _wires.wire("responses").stored_path(IDS["responses"]) == f"/v1/responses/{IDS['responses']}"


def test_an_unknown_surface_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="surface must be one of"):
        _wires.wire("gemini")
    assert sorted(_wires.WIRES) == sorted(SURFACE_NAMES)  # one wire per server surface, by the same names


def sse_bytes(message_id: str, *events: tuple[str | None, Any]) -> bytes:
    return b"".join(encode_event(data if isinstance(data, str) else json.dumps(data), event=name,
                                 id=f"{message_id}:{seq}") for seq, (name, data) in enumerate(events))


def test_unknown_events_and_fields_of_the_wrong_type_read_as_nothing() -> None:
    data = sse_bytes(IDS["anthropic"], ("ping", {"type": "ping"}), ("content_block_delta", {"delta": "text"}),
                     ("message_start", ["not", "an", "object"]))
    state, events = read("anthropic", data)
    assert [(e.event, e.text) for e in events] == [("ping", ""), ("content_block_delta", ""), ("message_start", "")]
    with pytest.raises(ClientError, match="does not hold JSON"):
        read("anthropic", sse_bytes(IDS["anthropic"], ("message_start", "{not json")))
