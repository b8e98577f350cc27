"""The POST decision (http/decide.py), driven by plain values: no server, no clock."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import pytest

from ringserve.config import Config, LimitsConfig, PolicyConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import BlockDelta, BlockKind, BlockStart, BlockStop, ContentBlock, Failure, Finish, StopReason, Usage
from ringserve.core.producer import Producer
from ringserve.core.status import CancelReason, MessageStatus, Policy
from ringserve.core.view import MessageView
from ringserve.store.sqlite import StoredMessage
from ringserve.live.message import StreamTimer
from ringserve.http.decide import (
    Accepted,
    Answer,
    Refuse,
    ReplayStored,
    RequestHeaders,
    Start,
    StreamLive,
    WaitLive,
    WaitStored,
    admit,
    answer,
    disconnect_policy,
    finished,
)
from ringserve.live.message import LiveMessage
from ringserve.surfaces.registry import ANTHROPIC, OPENAI
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY

SERVED = "served-model"


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def admitted(body: Any = ANTHROPIC_BODY, headers: RequestHeaders = RequestHeaders(), config: Config = Config(),
             surface: Any = ANTHROPIC) -> Start:
    decision = admit(surface, raw(body), headers, config)
    assert isinstance(decision, Start), decision
    return decision


def refused(body: Any = ANTHROPIC_BODY, headers: RequestHeaders = RequestHeaders(), config: Config = Config(),
            surface: Any = ANTHROPIC, *, raw_body: bytes | None = None) -> RingserveError:
    decision = admit(surface, raw(body) if raw_body is None else raw_body, headers, config)
    assert isinstance(decision, Refuse), decision
    return decision.error


def live(*events: Any, **fields: Any) -> MessageView:
    """The view of a live message whose producer has taken ``events`` (a ``CancelReason`` stands
    for a cancel from outside)."""
    msg = LiveMessage(id="msg_1", surface=ANTHROPIC, model=SERVED, created=1700000000, include_usage=False,
                      policy=Policy.ABORT, request_hash="h", timer=StreamTimer(0.0), **fields)
    producer = msg.producer = Producer("msg_1", ANTHROPIC.renderer("msg_1", SERVED, 1700000000, False), Usage(3, 0),
                                       flush_seconds=0.0, flush_tokens=1, persist_seconds=1.0)
    producer.start(0.0)
    for event in events:
        if isinstance(event, CancelReason):
            producer.interrupted(event, Usage(3, 1), 0.0)
        else:
            producer.event(event, Usage(3, 1), 0.0)
    return msg.view()


TEXT = (BlockStart(0, BlockKind.TEXT), BlockDelta(0, "he", 1), BlockDelta(0, "llo", 1), BlockStop(0))


def stored(status: MessageStatus, **fields: Any) -> MessageView:
    return StoredMessage(id="msg_2", surface="anthropic", model=SERVED, created=1700000001, status=status,
                         request="{}", request_hash="h", **fields).view()


# -- admit ------------------------------------------------------------------------------------


def test_a_valid_request_starts_with_its_hash_text_and_key() -> None:
    body = raw(ANTHROPIC_BODY)
    start = admitted(headers=RequestHeaders(idempotency_key="k-1"))
    assert start.parsed.request.messages[0].content == "hello"
    assert start.body_hash == hashlib.sha256(body).hexdigest()
    assert start.request_json == body.decode()
    assert start.idempotency_key == "k-1"
    assert (start.respond_async, start.policy) == (False, Policy.ABORT)


def test_a_body_that_is_not_json_is_refused() -> None:
    for body in (b"{", b"\xff\xfe", b"[" * 100_000):
        error = refused(raw_body=body)
        assert error.kind is ErrorKind.INVALID_REQUEST and "not valid JSON" in error.message


def test_an_invalid_request_is_refused_by_its_surface() -> None:
    error = refused({k: v for k, v in ANTHROPIC_BODY.items() if k != "max_tokens"})
    assert error.kind is ErrorKind.INVALID_REQUEST and error.param == "max_tokens"


def test_the_limits_refuse_too_many_messages_and_too_much_text() -> None:
    config = Config(limits=LimitsConfig(max_messages=2, max_message_chars=10))
    three = {**ANTHROPIC_BODY, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                            {"role": "user", "content": "c"}]}
    error = refused(three, config=config)
    assert (error.kind, error.param) == (ErrorKind.INVALID_REQUEST, "messages") and "at most 2 messages" in error.message
    long = {**ANTHROPIC_BODY, "messages": [{"role": "user", "content": "x" * 11}]}
    error = refused(long, config=config)
    assert "at most 10 characters" in error.message
    admitted({**ANTHROPIC_BODY, "messages": [{"role": "user", "content": "x" * 10}]}, config=config)


def test_the_text_limit_counts_tool_definitions_and_tool_calls_in_the_history() -> None:
    config = Config(limits=LimitsConfig(max_message_chars=200))
    tool = {"name": "t", "description": "d" * 150, "input_schema": {"type": "object"}}
    admitted({**ANTHROPIC_BODY, "tools": [tool]}, config=config)
    error = refused({**ANTHROPIC_BODY, "tools": [tool, {**tool, "name": "u"}]}, config=config)
    assert (error.kind, error.param) == (ErrorKind.INVALID_REQUEST, "tools")
    assert "at most 200 characters of text (messages and tool definitions)" in error.message
    call = {"type": "tool_use", "id": "toolu_1", "name": "t", "input": {"x": "y" * 200}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
    ]
    error = refused({**ANTHROPIC_BODY, "messages": history, "tools": [{**tool, "description": ""}]}, config=config)
    assert error.param == "messages" and "at most 200 characters of message text" in error.message


def test_prefer_respond_async_in_any_header_line_means_continue() -> None:
    for prefer in (("respond-async",), ("wait=5", "Respond-Async; x=1"), ("wait=5, respond-async",)):
        start = admitted(headers=RequestHeaders(prefer=prefer))
        assert (start.respond_async, start.policy) == (True, Policy.CONTINUE), prefer
    start = admitted(headers=RequestHeaders(prefer=("wait=5", "respond-asyncx")))
    assert (start.respond_async, start.policy) == (False, Policy.ABORT)


def test_the_disconnect_policy_header_wins_else_the_surfaces_setting() -> None:
    both = RequestHeaders(prefer=("respond-async",), disconnect_policy="abort")
    assert admitted(headers=both).policy is Policy.ABORT
    assert admitted(headers=RequestHeaders(disconnect_policy="continue")).policy is Policy.CONTINUE
    config = Config(policy=PolicyConfig({"anthropic": "abort", "openai": "continue"}))
    assert admitted(config=config).policy is Policy.ABORT
    assert admitted(OPENAI_BODY, config=config, surface=OPENAI).policy is Policy.CONTINUE
    error = refused(headers=RequestHeaders(disconnect_policy="ABORT"))
    assert error.kind is ErrorKind.INVALID_REQUEST and "Ringserve-Disconnect-Policy" in error.message
    with pytest.raises(RingserveError):
        disconnect_policy(PolicyConfig(), OPENAI, respond_async=False, override="later")


def test_the_first_failed_check_is_the_answer() -> None:
    config = Config(limits=LimitsConfig(max_messages=1))
    bad_policy = RequestHeaders(disconnect_policy="never")
    assert "not valid JSON" in refused(headers=bad_policy, config=config, raw_body=b"nope").message
    two = {**ANTHROPIC_BODY, "messages": [{"role": "user", "content": "a"}] * 2}
    assert refused(two, bad_policy, config).param == "messages"  # limits before the policy
    assert "Ringserve-Disconnect-Policy" in refused(ANTHROPIC_BODY, bad_policy, config).message


# -- answer -----------------------------------------------------------------------------------


def started(*, stream: bool, respond_async: bool = False) -> Start:
    start = admitted({**ANTHROPIC_BODY, "stream": stream})
    return attrs.evolve(start, respond_async=respond_async)


def test_respond_async_is_accepted_whatever_the_message() -> None:
    for message in (live(*TEXT), stored(MessageStatus.COMPLETE), stored(MessageStatus.GENERATING)):
        for stream in (False, True):
            assert answer(started(stream=stream, respond_async=True), message) == Accepted(message)


def test_a_live_message_is_streamed_or_waited_for() -> None:
    message = live(*TEXT)
    assert answer(started(stream=True), message) == StreamLive(message)
    assert answer(started(stream=False), message) == WaitLive(message)


def test_a_streaming_retry_of_a_stored_message_replays_its_log() -> None:
    for status in (MessageStatus.COMPLETE, MessageStatus.CANCELLED, MessageStatus.GENERATING):
        message = stored(status)
        assert answer(started(stream=True), message) == ReplayStored(message)


def test_a_retry_of_a_finished_message_gets_the_stored_answer() -> None:
    message = stored(MessageStatus.COMPLETE, text="hi", stop_reason=StopReason.STOP_SEQUENCE, stop_sequence="\n",
                     input_tokens=5, output_tokens=2)
    decision = answer(started(stream=False), message)
    assert isinstance(decision, Answer)
    result = decision.message
    assert (result.id, result.model, result.created) == ("msg_2", SERVED, 1700000001)
    assert result.content == (ContentBlock(BlockKind.TEXT, "hi"),)  # a row from before schema 4: its text
    assert (result.stop_reason, result.stop_sequence, result.usage) == (StopReason.STOP_SEQUENCE, "\n", Usage(5, 2))
    assert not result.cancelled
    assert stored(MessageStatus.CANCELLED).cancelled


def test_a_json_retry_of_a_message_still_generating_elsewhere_waits_for_its_end() -> None:
    for status in (MessageStatus.QUEUED, MessageStatus.GENERATING):
        message = stored(status)
        assert answer(started(stream=False), message) == WaitStored(message)
        assert answer(started(stream=True), message) == ReplayStored(message)


def test_a_stored_message_that_ended_failed_or_interrupted_elsewhere_is_the_error_its_first_client_got() -> None:
    """A JSON retry that waited on another replica gets what the owner's own client got (it was a 409)."""
    cases = [
        (MessageStatus.FAILED, live(*TEXT, Failure(ErrorKind.API_ERROR, "boom", Usage(3, 1), True))),
        (MessageStatus.INTERRUPTED, live(*TEXT, CancelReason.DRAIN, cancel_reason=CancelReason.DRAIN)),
    ]
    for status, first in cases:
        owner = finished(first)
        decision = finished(stored(status, error=first.error))
        assert isinstance(owner, Refuse) and isinstance(decision, Refuse)
        seen = [(d.error.kind, d.error.status, d.error.message, d.error.retryable) for d in (decision, owner)]
        assert seen[0] == seen[1] and seen[0][1] in (500, 503), seen
    for status in (MessageStatus.QUEUED, MessageStatus.GENERATING):  # its end was never seen
        decision = finished(stored(status))
        assert isinstance(decision, Refuse)
        assert decision.error.kind is ErrorKind.CONFLICT and decision.error.status == 409
        assert decision.error.message == f"message msg_2 is {status.value}"
    assert finished(stored(MessageStatus.COMPLETE)) == Answer(stored(MessageStatus.COMPLETE))


# -- finished ---------------------------------------------------------------------------------


def test_a_finished_live_message_is_answered() -> None:
    decision = finished(live(*TEXT, Finish(StopReason.END, Usage(3, 4))))
    assert isinstance(decision, Answer)
    result = decision.message
    assert (result.text, result.stop_reason, result.usage, result.cancelled) == ("hello", StopReason.END, Usage(3, 4), False)
    cancelled = finished(live(*TEXT, CancelReason.REQUESTED))
    assert isinstance(cancelled, Answer) and cancelled.message.cancelled and cancelled.message.text == "hello"


def test_a_failed_or_interrupted_live_message_is_a_retryable_error() -> None:
    cases = [
        (live(*TEXT, Failure(ErrorKind.API_ERROR, "boom", Usage(3, 1), True)), ErrorKind.API_ERROR, "boom"),
        (live(Failure(ErrorKind.OVERLOADED, "", Usage(3, 0), True)), ErrorKind.API_ERROR, "generation failed"),
        (live(*TEXT, CancelReason.DRAIN, cancel_reason=CancelReason.DRAIN), ErrorKind.UNAVAILABLE,
         "the server is shutting down; retry the request"),
    ]
    for message, kind, text in cases:
        decision = finished(message)
        assert isinstance(decision, Refuse)
        assert (decision.error.kind, decision.error.message, decision.error.retryable) == (kind, text, True)
