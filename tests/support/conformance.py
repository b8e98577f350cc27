"""The conformance oracle: ringserve's bytes judged by the official SDKs' own code (issue 12).

Nothing here is our reading of the API docs. A stream is decoded by each SDK's
own SSE decoder (``openai._streaming.SSEDecoder``, ``anthropic._streaming.SSEDecoder``,
copies of httpx-sse's, which dispatch a blank line once an id has been seen),
which must dispatch exactly what ringserve's spec-exact :class:`SSEParser`
dispatches, and never an empty event. Every event and every JSON answer is
then validated in pydantic strict mode against the SDKs' types:
``openai.types.chat.ChatCompletionChunk`` / ``ChatCompletion`` and
``openai.types.ErrorObject`` (the in-band ``{"error": ...}``);
``anthropic.types.RawMessageStreamEvent`` (through a ``TypeAdapter``),
``anthropic.types.Message`` and ``anthropic.types.ErrorResponse``. One reading of the
docs is admitted, where the SDK's types lag them: an error ``type`` that Anthropic documents
for a status and the SDK's ``ErrorType`` literal lacks (:data:`DOCUMENTED_ERROR_TYPES`) is
validated against ``ErrorResponse`` with the error object's ``type`` narrowed to it, and the
status must map to that error's exception class in the SDK's own table.

To add a case, capture a stream's bytes (:func:`stream_bytes`) or an answer
and call :func:`check_stream` or :func:`check_answer`; both return what they
saw (:class:`Seen`: text, stop reason, the cancel mark, the error) to assert on.
:func:`sdk_stream_text` and :func:`sdk_answer` drive the SDKs' own clients
(sync or async, a create or a resume) for end-to-end cases.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Literal

import anthropic
import attrs
import httpx
import openai
from anthropic import _streaming as anthropic_streaming
from anthropic._error_classes import ERROR_CLASSES
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from anthropic.types.shared import InvalidRequestErrorObject
from openai import _streaming as openai_streaming
from openai.types import ErrorObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, TypeAdapter, create_model

from ringserve.core.sse import SSEParser
from ringserve.surfaces.base import CANCELLED_KEY

ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
DECODERS = {"anthropic": anthropic_streaming.SSEDecoder, "openai": openai_streaming.SSEDecoder}
#: Anthropic error types by status that the docs give and the SDK's ``ErrorType`` literal lacks
#: (anthropic 2.14), with the exception class the SDK raises for that status
#: (``anthropic._error_classes.ERROR_CLASSES``). 413: "request_too_large: Request exceeds the
#: maximum allowed number of bytes" (https://docs.claude.com/en/api/errors, "HTTP errors"); the
#: API's own 413 body is ``{"error": {"type": "request_too_large", ...}}``, which the SDK raises as
#: ``ContentTooLargeError`` (``RequestTooLargeError`` is its deprecated alias).
DOCUMENTED_ERROR_TYPES: dict[int, tuple[str, type[anthropic.APIStatusError]]] = {
    413: ("request_too_large", anthropic.ContentTooLargeError),
}
#: Statuses whose answers must say when to come back (both headers; the SDKs read retry-after-ms first).
OVERLOAD_STATUSES = (429, 503, 529)


@attrs.define
class SeenCall:
    """One tool call as a stream or an answer gave it: the arguments' JSON text (joined fragments).

    In a stream that starts after a ``Last-Event-ID`` inside a call, ``call_id`` and ``name`` are
    empty: they came before the cut.
    """

    call_id: str
    name: str
    arguments: str = ""

    def value(self) -> tuple[str, str, Any]:
        """(id, name, the parsed arguments), to compare a stream's calls with an answer's."""
        return self.call_id, self.name, json.loads(self.arguments)


@attrs.define
class Seen:
    """What one stream or answer said, once validated.

    Attributes:
        text: the reply text (all its text blocks joined).
        reasoning: the reply's reasoning text (Anthropic thinking blocks, OpenAI
            ``reasoning_content``, which ``reasoning`` must repeat), all of it joined.
        signatures: the signatures of its thinking blocks, in order (Anthropic).
        tool_calls: the tool calls, in order.
        blocks: the kinds of the content blocks, in order (Anthropic ``text`` / ``tool_use``).
        stop_reason: the surface's stop/finish reason, or None.
        cancelled: the ``ringserve_cancelled`` mark was set.
        error: the error object (an in-band error or an error answer), or None.
        terminal: the stream's last event was terminal (``message_stop``,
            ``[DONE]`` or an error); always True for an answer.
        events: the validated models, in order.
        resumed: the stream started after a ``Last-Event-ID`` (it may start inside a block).
        open_block: while reading an Anthropic stream, the open block's index (-1: none open;
            None: not known yet, in a resumed stream).
        next_block: the index the next Anthropic block must have (None: not known yet, resumed).
        json_deltas: how many argument fragments came (Anthropic ``input_json_delta`` events,
            OpenAI ``tool_calls`` deltas after a call's first).
        pings: how many Anthropic ``ping`` events came (keepalives: the SDK skips them).
    """

    text: str = ""
    reasoning: str = ""
    signatures: list[str] = attrs.Factory(list)
    tool_calls: list[SeenCall] = attrs.Factory(list)
    blocks: list[str] = attrs.Factory(list)
    stop_reason: str | None = None
    cancelled: bool = False
    error: dict[str, Any] | None = None
    terminal: bool = False
    events: list[Any] = attrs.Factory(list)
    resumed: bool = False
    open_block: int | None = None
    next_block: int | None = None
    json_deltas: int = 0
    pings: int = 0


def _extra(model: Any) -> dict[str, Any]:
    return model.model_extra or {}


def _anthropic_event(data: dict[str, Any], name: str, seen: Seen, first: bool) -> None:
    assert data.get("type") == name, (name, data)
    if name == "ping":  # a keepalive, which the SDK's stream skips (anthropic._streaming.Stream)
        assert data == {"type": "ping"} and not first, data
        seen.pings += 1
        return
    if name == "error":
        seen.events.append(ErrorResponse.model_validate(data, strict=True))
        seen.error, seen.terminal = data["error"], True
        return
    event = ANTHROPIC_EVENT.validate_python(data, strict=True)
    seen.events.append(event)
    assert (event.type == "message_start") == first, f"{event.type} where message_start was due, or after it"
    match event.type:
        case "message_start":
            assert event.message.content == [], event
        case "content_block_start":
            # blocks are numbered 0, 1, 2 ... in order, text and tool_use alike
            assert seen.next_block in (event.index, None), (event, seen.next_block)
            seen.blocks.append(event.content_block.type)
            seen.open_block, seen.next_block = event.index, event.index + 1
            if event.content_block.type == "tool_use":
                assert event.content_block.input == {}, event  # the arguments come as input_json_delta
                assert event.content_block.id.startswith("toolu_"), event
                seen.tool_calls.append(SeenCall(event.content_block.id, event.content_block.name))
            elif event.content_block.type == "thinking":  # its text and its signature come as deltas
                assert event.content_block.thinking == event.content_block.signature == "", event
            else:
                assert event.content_block.text == "", event
        case "content_block_delta":
            assert seen.open_block in (event.index, None), (event, seen.open_block)
            signed = seen.blocks and seen.blocks[-1] == "thinking" and len(seen.signatures) == seen.blocks.count("thinking")
            assert not signed or seen.open_block is None, f"a delta after the thinking block's signature: {event}"
            if event.delta.type == "input_json_delta":
                if not seen.tool_calls:  # resumed inside a call
                    seen.tool_calls.append(SeenCall("", ""))
                seen.tool_calls[-1].arguments += event.delta.partial_json
                seen.json_deltas += 1
            elif event.delta.type == "thinking_delta":
                seen.reasoning += event.delta.thinking
            elif event.delta.type == "signature_delta":
                assert event.delta.signature, event
                seen.signatures.append(event.delta.signature)
            else:
                assert event.delta.type == "text_delta", event
                seen.text += event.delta.text
        case "content_block_stop":
            assert seen.open_block in (event.index, None), (event, seen.open_block)
            if seen.blocks and seen.blocks[-1] == "thinking" and seen.open_block is not None:
                assert len(seen.signatures) == seen.blocks.count("thinking"), "a thinking block stopped unsigned"
            seen.open_block = -1
        case "message_delta":
            seen.stop_reason = event.delta.stop_reason
            seen.cancelled = _extra(event.delta).get(CANCELLED_KEY) is True
        case "message_stop":
            seen.terminal = True


def _openai_event(data: Any, seen: Seen, resumed: bool) -> None:
    if data == "[DONE]":
        assert resumed or seen.stop_reason is not None, "[DONE] before a finish_reason"
        seen.terminal = True
        return
    data = json.loads(data)
    if "error" in data:
        assert set(data) == {"error"}, data
        seen.events.append(ErrorObject.model_validate(data["error"], strict=True))
        seen.error, seen.terminal = data["error"], True
        return
    chunk = ChatCompletionChunk.model_validate(data, strict=True)
    seen.events.append(chunk)
    for choice in chunk.choices:
        seen.text += choice.delta.content or ""
        seen.reasoning += _openai_reasoning(choice.delta)
        for call in choice.delta.tool_calls or ():
            _openai_call_delta(call, seen)
        if choice.finish_reason is not None:
            seen.stop_reason = choice.finish_reason
            seen.cancelled = _extra(choice).get(CANCELLED_KEY) is True


def _openai_reasoning(delta_or_message: Any) -> str:
    """The reasoning of a chunk's ``delta`` or an answer's ``message``: ``reasoning_content``, which
    ``reasoning`` repeats (both or neither; extra fields of the SDK's models)."""
    extra = _extra(delta_or_message)
    assert extra.get("reasoning_content") == extra.get("reasoning"), extra
    return extra.get("reasoning_content") or ""


def _openai_call_delta(call: Any, seen: Seen) -> None:
    """A call's first delta has its index (the next one), ``id``, ``type`` and ``function.name``
    and ``arguments: ""``; later deltas only the index and an arguments fragment."""
    assert call.function is not None, call
    while seen.resumed and call.index > len(seen.tool_calls):  # resumed after the earlier calls began
        seen.tool_calls.append(SeenCall("", ""))
    if call.id is not None:
        assert call.index == len(seen.tool_calls), (call, seen.tool_calls)
        assert call.type == "function" and call.id.startswith("call_") and call.function.name, call
        assert call.function.arguments == "", call
        seen.tool_calls.append(SeenCall(call.id, call.function.name))
        return
    assert call.type is None and call.function.name is None and call.function.arguments, call
    if seen.resumed and call.index == len(seen.tool_calls):  # resumed inside a call
        seen.tool_calls.append(SeenCall("", ""))
    assert call.index == len(seen.tool_calls) - 1, (call, seen.tool_calls)  # fragments of the latest call
    seen.tool_calls[call.index].arguments += call.function.arguments
    seen.json_deltas += 1


def check_stream(surface: str, raw: bytes, *, resumed: bool = False, complete: bool = True) -> Seen:
    """Validate one connection's whole SSE body as ``surface`` (``"anthropic"`` or ``"openai"``).

    Args:
        raw: every byte of the response body.
        resumed: the body starts after a ``Last-Event-ID`` (no ``message_start`` first).
        complete: the body must end with a terminal event (False for a connection that ended
            with the reconnect hint).

    Returns:
        What the stream said.
    """
    sdk = list(DECODERS[surface]().iter_bytes(iter([raw])))
    ours = SSEParser().feed(raw)
    assert [(e.event or "message", e.data) for e in sdk] == [(e.event, e.data) for e in ours]
    seen = Seen(resumed=resumed, open_block=None if resumed else -1, next_block=None if resumed else 0)
    for i, event in enumerate(ours):
        assert event.data, f"event {i} has no data: an SDK would parse it as an empty JSON document"
        assert event.id is not None, f"event {i} has no id: the stream could not resume after it"
        assert not seen.terminal, f"event {i} comes after the terminal event"
        if surface == "anthropic":
            _anthropic_event(json.loads(event.data), event.event, seen, first=i == 0 and not resumed)
        else:
            assert event.event == "message", event
            _openai_event(event.data, seen, resumed)
    assert seen.terminal == complete, (surface, raw[-300:])
    return seen


def _anthropic_error(status: int, body: Any) -> BaseModel:
    """An Anthropic error answer, strict: ``ErrorResponse``, or for a :data:`DOCUMENTED_ERROR_TYPES`
    status ``ErrorResponse`` whose error ``type`` is the documented one, which the SDK raises as
    that status's exception class."""
    if status not in DOCUMENTED_ERROR_TYPES:
        return ErrorResponse.model_validate(body, strict=True)
    error_type, exception = DOCUMENTED_ERROR_TYPES[status]
    assert ERROR_CLASSES[(status, None)] is exception, ERROR_CLASSES[(status, None)]
    return _documented_error_response(error_type).model_validate(body, strict=True)


@functools.cache
def _documented_error_response(error_type: str) -> type[BaseModel]:
    """``ErrorResponse`` with an error object like the SDK's (``InvalidRequestErrorObject``:
    ``type`` and ``message``) whose ``type`` is ``error_type``."""
    error = create_model(f"DocumentedErrorObject_{error_type}", __base__=InvalidRequestErrorObject,
                         type=(Literal[error_type], ...))  # type: ignore[valid-type]
    return create_model(f"DocumentedErrorResponse_{error_type}", __base__=ErrorResponse, error=(error, ...))


def check_answer(surface: str, resp: httpx.Response) -> Seen:
    """Validate one non-stream answer: a 200 message, or an error in the surface's shape.

    An overload answer (429, 503, 529) must carry ``Retry-After`` (whole seconds) and
    ``retry-after-ms``, the two headers the SDKs' retry loops read.
    """
    body = resp.json()
    seen = Seen(terminal=True)
    if resp.status_code != 200:
        if surface == "anthropic":
            seen.events.append(_anthropic_error(resp.status_code, body))
        else:
            assert set(body) == {"error"}, body
            seen.events.append(ErrorObject.model_validate(body["error"], strict=True))
        seen.error = body["error"]
        if resp.status_code in OVERLOAD_STATUSES:
            seconds, ms = int(resp.headers["retry-after"]), int(resp.headers["retry-after-ms"])
            assert seconds >= 1 and seconds * 1000 >= ms >= 0, resp.headers
        return seen
    if surface == "anthropic":
        message = Message.model_validate(body, strict=True)
        for block in message.content:
            seen.blocks.append(block.type)
            if block.type == "tool_use":
                assert block.id.startswith("toolu_"), block
                seen.tool_calls.append(SeenCall(block.id, block.name, json.dumps(block.input)))
            elif block.type == "thinking":
                seen.reasoning += block.thinking
                seen.signatures.append(block.signature)
            else:
                seen.text += block.text
        seen.stop_reason = message.stop_reason
        seen.cancelled = _extra(message).get(CANCELLED_KEY) is True
    else:
        message = ChatCompletion.model_validate(body, strict=True)
        (choice,) = message.choices
        seen.text = choice.message.content or ""
        seen.reasoning = _openai_reasoning(choice.message)
        for call in choice.message.tool_calls or ():
            assert call.type == "function" and call.id.startswith("call_"), call
            seen.tool_calls.append(SeenCall(call.id, call.function.name, call.function.arguments))
        if seen.tool_calls and not seen.text:
            assert choice.message.content is None, choice.message
        seen.stop_reason = choice.finish_reason
        seen.cancelled = _extra(choice).get(CANCELLED_KEY) is True
    seen.events.append(message)
    return seen


async def stream_bytes(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, bytes]:
    """The response and every byte of its body."""
    raw = bytearray()
    async with client.stream(method, url, **kwargs) as resp:
        async for chunk in resp.aiter_raw():
            raw += chunk
    return resp, bytes(raw)


# -- the official SDKs' own clients -----------------------------------------------------------


def _client(sdk: str, url: str, use_async: bool, **client_kwargs: Any) -> Any:
    client_kwargs.setdefault("max_retries", 0)
    if sdk == "anthropic":
        cls = anthropic.AsyncAnthropic if use_async else anthropic.Anthropic
        return cls(base_url=url, api_key="unused", **client_kwargs)
    cls = openai.AsyncOpenAI if use_async else openai.OpenAI
    return cls(base_url=url + "/v1", api_key="unused", **client_kwargs)


def _create(sdk: str, client: Any, stream: bool, request: dict[str, Any]) -> Any:
    # Current SDKs have no temperature argument on both; the server takes it as an extra field.
    request = {"model": "any", **request}
    if sdk == "anthropic":
        return client.messages.create(stream=stream, **request)
    return client.chat.completions.create(stream=stream, **request)


def _resume(sdk: str, client: Any, use_async: bool, message_id: str, last_event_id: str | None) -> Any:
    """``GET /v1/messages/{id}/stream`` through the SDK's own stream class."""
    options = {"headers": {"Last-Event-ID": last_event_id}} if last_event_id else {}
    if sdk == "anthropic":
        event, path = anthropic.types.RawMessageStreamEvent, f"/v1/messages/{message_id}/stream"
        cls = anthropic.AsyncStream if use_async else anthropic.Stream
    else:
        event, path = openai.types.chat.ChatCompletionChunk, f"/messages/{message_id}/stream"  # base URL ends in /v1
        cls = openai.AsyncStream if use_async else openai.Stream
    return client.get(path, cast_to=event, stream=True, stream_cls=cls[event], options=options)


def _text(sdk: str, items: list[Any]) -> str:
    if sdk == "anthropic":
        return "".join(e.delta.text for e in items if e.type == "content_block_delta")
    return "".join(c.choices[0].delta.content or "" for c in items if c.choices)


def sdk_stream_text(sdk: str, url: str, *, use_async: bool = False, resume: str | None = None,
                    last_event_id: str | None = None, **request: Any) -> str:
    """Stream through the official SDK's ``Stream`` (or ``AsyncStream``) and return the text.

    Blocking (run it on a thread). ``request`` is the SDK's ``create`` arguments (``model``
    defaults to ``"any"``); with ``resume`` it reads ``GET /v1/messages/{resume}/stream``
    after ``last_event_id`` with the SDK's stream class instead.
    """
    if use_async:
        async def run() -> str:
            client = _client(sdk, url, True)
            stream = await (_resume(sdk, client, True, resume, last_event_id) if resume
                            else _create(sdk, client, True, request))
            return _text(sdk, [item async for item in stream])

        return asyncio.run(run())
    client = _client(sdk, url, False)
    stream = _resume(sdk, client, False, resume, last_event_id) if resume else _create(sdk, client, True, request)
    return _text(sdk, list(stream))


def sdk_answer(sdk: str, url: str, *, max_retries: int = 0, **request: Any) -> tuple[str, str | None]:
    """One non-stream request through the official SDK's client (blocking): (text, stop reason)."""
    answer = _create(sdk, _client(sdk, url, False, max_retries=max_retries), False, request)
    if sdk == "anthropic":
        return "".join(block.text for block in answer.content), answer.stop_reason
    return answer.choices[0].message.content or "", answer.choices[0].finish_reason
