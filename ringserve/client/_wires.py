"""The read side of each surface the client speaks, looked up by surface name (h11's ``READERS``).

A :class:`Wire` knows one surface's create route and body, decodes its
events' data, reads each event into what it adds to the reply (:class:`Read`)
and what it says about the message (:class:`Reading`), and reads the stored
message that the client falls back to when the stream log is gone
(:class:`Stored`). Nothing here does I/O, and nothing imports the server's
surfaces: the shapes are the APIs' own, and ``tests/client/test_wires.py``
renders events with the server's renderers and reads them back here.

Wire formats (the server's ``surfaces/*`` write them):

* Anthropic "Streaming Messages": ``message_start``, ``content_block_start``
  (``text``, ``tool_use``, ``thinking``), ``content_block_delta``
  (``text_delta``, ``input_json_delta``, ``thinking_delta``),
  ``content_block_stop``, ``message_delta``, ``message_stop``; ``error``.
* OpenAI Chat Completions "Streaming": ``chat.completion.chunk`` data with
  ``delta.content``, ``delta.tool_calls`` (``index``, ``id`` and
  ``function.name`` on a call's first chunk, ``function.arguments``
  fragments), ``delta.reasoning_content`` (llama.cpp's spelling; ``reasoning``
  when it is absent), ``finish_reason``, a usage chunk, ``[DONE]``; an
  in-band ``{"error": ...}``.
* OpenAI Responses streaming events (``openai.types.responses.
  ResponseStreamEvent``): ``response.created``, ``response.output_item.added``
  / ``.done``, ``response.output_text.delta``,
  ``response.function_call_arguments.delta``, ``response.reasoning_text.delta``
  (``response.reasoning_summary_text.delta`` when the request asked for a summary), then
  ``response.completed``, ``response.incomplete`` or ``response.failed``; an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote

import attrs

from ringserve.client._models import ToolCall, ToolCallDelta, Usage
from ringserve.core.status import MessageStatus

#: ringserve's extension key next to the stop reason of a cancelled message (Anthropic
#: ``message_delta.delta``, OpenAI Chat the final chunk's choice); the server spells it in
#: ``surfaces/base.py``, and ``tests/client/test_wires.py`` checks that the two agree.
CANCELLED_KEY = "ringserve_cancelled"

#: OpenAI Chat's last data line.
DONE = "[DONE]"


@attrs.frozen
class Read:
    """What one event adds to the reply (the :class:`~ringserve.client.StreamEvent` fields)."""

    text: str = ""
    reasoning: str = ""
    tool_deltas: tuple[ToolCallDelta, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


NOTHING = Read()


@attrs.define(eq=False)
class _OpenCall:
    index: int
    call_id: str
    name: str
    parts: list[str] = attrs.Factory(list)


@attrs.define(eq=False)
class Calls:
    """The reply's tool calls as they stream.

    Each surface places a call by its own key (Anthropic the content block
    index, OpenAI Chat the ``tool_calls`` index, Responses the output index);
    the client numbers calls from 0 in the order they start.

    Attributes:
        done: the complete calls, in the order they completed.
    """

    done: list[ToolCall] = attrs.Factory(list)
    _open: dict[int, _OpenCall] = attrs.Factory(dict)
    _started: int = 0

    def start(self, key: int, call_id: str, name: str) -> ToolCallDelta:
        """A call begins at ``key``; its first delta."""
        call = _OpenCall(self._started, call_id, name)
        self._open[key] = call
        self._started += 1
        return ToolCallDelta(call.index, call_id, name)

    def extend(self, key: int, fragment: str) -> ToolCallDelta | None:
        """More arguments of the call at ``key``; None for no open call there or an empty fragment."""
        call = self._open.get(key)
        if call is None or not fragment:
            return None
        call.parts.append(fragment)
        return ToolCallDelta(call.index, arguments=fragment)

    def complete(self, key: int, arguments: str | None = None) -> ToolCall | None:
        """The call at ``key`` is complete (``arguments``: the whole text, when the event gives it);
        None for no open call there."""
        call = self._open.pop(key, None)
        if call is None:
            return None
        whole = ToolCall(call.call_id, call.name, "".join(call.parts) if arguments is None else arguments)
        self.done.append(whole)
        return whole

    def complete_all(self) -> tuple[ToolCall, ...]:
        """Every open call is complete (in the order they started)."""
        return tuple(call for key in sorted(self._open, key=lambda k: self._open[k].index)
                     if (call := self.complete(key)) is not None)


@attrs.define(eq=False)
class Reading:
    """What a message's stream events have said so far (one per message; a wire fills it).

    ``terminal`` is set by the stream's terminal event, ``error`` (type,
    message) by an in-band error (which is terminal too).
    """

    model: str = ""
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None
    cancelled: bool = False
    terminal: bool = False
    error: tuple[str, str] | None = None
    calls: Calls = attrs.Factory(Calls)


@attrs.frozen
class Stored:
    """A message as the server stores it, read when its stream log is gone.

    Attributes:
        running: it is still being generated (ask again later).
        text: its text so far.
        reasoning: its reasoning text so far.
        tool_calls: its complete tool calls.
        error: (type, message) when it failed or was interrupted.
    """

    running: bool
    text: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage = Usage(0, 0)
    model: str = ""
    cancelled: bool = False
    error: tuple[str, str] | None = None


#: Reads one event's data (a JSON object) into ``Reading``; what it adds to the reply.
_Reader = Callable[[dict[str, Any], Reading], Read]


class Wire(Protocol):
    """One surface's read side (and its create request)."""

    @property
    def name(self) -> str:
        """The surface's name (``surfaces/registry.py``)."""
        ...

    @property
    def path(self) -> str:
        """The create route."""
        ...

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        """The create request's JSON body, streaming, with ``params`` added last."""
        ...

    def decode(self, data: str) -> Any:
        """An event's data as a value.

        Raises:
            ValueError: it is not the JSON (or sentinel) the surface sends.
        """
        ...

    def read(self, event: str, data: Any, reading: Reading) -> Read:
        """Apply one decoded event to ``reading``; what it adds to the reply."""
        ...

    def stored_path(self, message_id: str) -> str:
        """Where the stored message is read (``GET``)."""
        ...

    def stored(self, body: Any) -> Stored:
        """The stored message from the JSON answer of :meth:`stored_path`."""
        ...


def message_path(message_id: str, tail: str = "") -> str:
    """``/v1/messages/{id}`` plus ``tail`` (``"/stream"``, ``"/cancel"``), the id percent-escaped as one
    path segment (RFC 3986 §3.3), so that an id with ``/``, ``..`` or spaces cannot name another route."""
    return f"/v1/messages/{quote(message_id, safe='')}{tail}"


def user_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A prompt string as one user turn; a list of ``{"role", "content"}`` turns as is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _obj(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (a field of an unexpected type reads as absent)."""
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _error(error: Any, default: str = "error") -> tuple[str, str]:
    """(type, message) of an error object: ``type`` (Anthropic, OpenAI Chat) or ``code`` (Responses)."""
    error = _obj(error)
    return _str(error.get("type")) or _str(error.get("code")) or default, _str(error.get("message"))


def _arguments(value: Any) -> str:
    """A stored call's arguments as JSON text: as sent when text, else the object encoded."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- ringserve's own message status (GET /v1/messages/{id}), read for two surfaces ---------------

def _status_error(status: MessageStatus | None, body: dict[str, Any]) -> tuple[str, str] | None:
    """(type, message) of a message that failed or was interrupted; None otherwise."""
    match status:
        case MessageStatus.FAILED:
            return "api_error", _str(body.get("error")) or "generation failed"
        case MessageStatus.INTERRUPTED:
            return "interrupted", "the server stopped before the message was finished"
        case _:
            return None


def _message_status(body: Any, content: Callable[[Any], tuple[str, tuple[ToolCall, ...]]]) -> Stored:
    """A ``GET /v1/messages/{id}`` answer (``surfaces/ringserve.py``): its ``content`` is in the
    surface's shape, read by ``content`` into (reasoning, tool calls). A status this client does
    not know reads as ended."""
    body = _obj(body)
    spelled, usage = body.get("status"), _obj(body.get("usage"))
    status = MessageStatus(spelled) if spelled in tuple(MessageStatus) else None
    reasoning, calls = content(body.get("content"))
    return Stored(running=status in (MessageStatus.QUEUED, MessageStatus.GENERATING), text=_str(body.get("text")),
                  reasoning=reasoning, tool_calls=calls, stop_reason=body.get("stop_reason"),
                  stop_sequence=body.get("stop_sequence"),
                  usage=Usage(_int(usage.get("input_tokens")), _int(usage.get("output_tokens"))),
                  model=_str(body.get("model")), cancelled=status is MessageStatus.CANCELLED,
                  error=_status_error(status, body))


@attrs.frozen
class EventWire:
    """A surface whose events are named (``event:``) and carry JSON: one reader per event type
    (the types it does not list, ``ping`` among them, read as nothing).

    Attributes:
        keys: the create body's keys for the token budget, the turns and the system prompt.
        stored_path: where the stored message is read.
        stored: reads the stored message's JSON.
    """

    name: str
    path: str
    readers: Mapping[str, _Reader]
    keys: tuple[str, str, str]
    stored_path: Callable[[str], str]
    stored: Callable[[Any], Stored]

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        budget, turns, instructions = self.keys
        body: dict[str, Any] = {"model": model, budget: max_tokens, turns: messages, "stream": True}
        if system is not None:
            body[instructions] = system
        return {**body, **params}

    def decode(self, data: str) -> Any:
        return json.loads(data)

    def read(self, event: str, data: Any, reading: Reading) -> Read:
        reader = self.readers.get(event)
        return NOTHING if reader is None else reader(_obj(data), reading)


# -- Anthropic Messages ---------------------------------------------------------------------------


def _anthropic_usage(usage: Any) -> Usage:
    # input_tokens is the uncached part of the prompt, cache_read_input_tokens the rest
    usage = _obj(usage)
    return Usage(_int(usage.get("input_tokens")) + _int(usage.get("cache_read_input_tokens")),
                 _int(usage.get("output_tokens")))


def _a_message_start(data: dict[str, Any], reading: Reading) -> Read:
    reading.model = _str(_obj(data.get("message")).get("model")) or reading.model
    return NOTHING


def _a_block_start(data: dict[str, Any], reading: Reading) -> Read:
    block = _obj(data.get("content_block"))
    if block.get("type") != "tool_use":
        return NOTHING
    return Read(tool_deltas=(reading.calls.start(_int(data.get("index")), _str(block.get("id")),
                                                 _str(block.get("name"))),))


def _a_block_delta(data: dict[str, Any], reading: Reading) -> Read:
    delta = _obj(data.get("delta"))
    match delta.get("type"):
        case "text_delta":
            return Read(text=_str(delta.get("text")))
        case "thinking_delta":
            return Read(reasoning=_str(delta.get("thinking")))
        case "input_json_delta":
            piece = reading.calls.extend(_int(data.get("index")), _str(delta.get("partial_json")))
            return NOTHING if piece is None else Read(tool_deltas=(piece,))
    return NOTHING  # signature_delta, and types this client does not know


def _a_block_stop(data: dict[str, Any], reading: Reading) -> Read:
    call = reading.calls.complete(_int(data.get("index")))
    return NOTHING if call is None else Read(tool_calls=(call,))


def _a_message_delta(data: dict[str, Any], reading: Reading) -> Read:
    delta = _obj(data.get("delta"))
    reading.stop_reason = delta.get("stop_reason")
    reading.stop_sequence = delta.get("stop_sequence")
    reading.cancelled = delta.get(CANCELLED_KEY) is True
    reading.usage = _anthropic_usage(data.get("usage"))
    return NOTHING


def _a_message_stop(data: dict[str, Any], reading: Reading) -> Read:
    reading.terminal = True
    return NOTHING


def _a_error(data: dict[str, Any], reading: Reading) -> Read:
    reading.error, reading.terminal = _error(data.get("error")), True
    return NOTHING


def _anthropic_content(content: Any) -> tuple[str, tuple[ToolCall, ...]]:
    """A ``Message``'s content blocks: (thinking text, ``tool_use`` calls)."""
    blocks = [_obj(b) for b in content] if isinstance(content, list) else []
    reasoning = "".join(_str(b.get("thinking")) for b in blocks if b.get("type") == "thinking")
    calls = tuple(ToolCall(_str(b.get("id")), _str(b.get("name")), _arguments(b.get("input", {})))
                  for b in blocks if b.get("type") == "tool_use")
    return reasoning, calls


#: Anthropic Messages (``POST /v1/messages``); the stored message is ringserve's status.
ANTHROPIC = EventWire("anthropic", "/v1/messages", {
    "message_start": _a_message_start,
    "content_block_start": _a_block_start,
    "content_block_delta": _a_block_delta,
    "content_block_stop": _a_block_stop,
    "message_delta": _a_message_delta,
    "message_stop": _a_message_stop,
    "error": _a_error,
}, ("max_tokens", "messages", "system"), message_path, lambda body: _message_status(body, _anthropic_content))


# -- OpenAI Chat Completions ----------------------------------------------------------------------


def _chat_delta(delta: dict[str, Any], reading: Reading) -> Read:
    """One choice's ``delta``: content, reasoning, tool-call pieces (a call that starts completes the
    calls before it)."""
    reasoning = delta.get("reasoning_content")
    pieces: list[ToolCallDelta] = []
    done: list[ToolCall] = []
    for raw in delta.get("tool_calls") or ():
        call, function = _obj(raw), _obj(_obj(raw).get("function"))
        key = _int(call.get("index"))
        if "id" in call:
            done += reading.calls.complete_all()
            pieces.append(reading.calls.start(key, _str(call.get("id")), _str(function.get("name"))))
        if (piece := reading.calls.extend(key, _str(function.get("arguments")))) is not None:
            pieces.append(piece)
    return Read(text=_str(delta.get("content")),
                reasoning=_str(delta.get("reasoning") if reasoning is None else reasoning),
                tool_deltas=tuple(pieces), tool_calls=tuple(done))


def _joined(reads: list[Read]) -> Read:
    """What several choices of one chunk add, in order (ringserve sends one choice, or none)."""
    return Read("".join(r.text for r in reads), "".join(r.reasoning for r in reads),
                tuple(d for r in reads for d in r.tool_deltas), tuple(c for r in reads for c in r.tool_calls))


def _chat_content(message: Any) -> tuple[str, tuple[ToolCall, ...]]:
    """A ``chat.completion`` choice's ``message``: (reasoning text, tool calls)."""
    message = _obj(message)
    reasoning = message.get("reasoning_content")
    calls = tuple(ToolCall(_str(_obj(c).get("id")), _str(_obj(_obj(c).get("function")).get("name")),
                           _arguments(_obj(_obj(c).get("function")).get("arguments", "")))
                  for c in message.get("tool_calls") or ())
    return _str(message.get("reasoning") if reasoning is None else reasoning), calls


class OpenAIWire:
    """OpenAI Chat Completions (``POST /v1/chat/completions``)."""

    name = "openai"
    path = "/v1/chat/completions"

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        body = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        return {**body, **params}

    def decode(self, data: str) -> Any:
        return data if data == DONE else json.loads(data)

    def read(self, event: str, data: Any, reading: Reading) -> Read:
        if data == DONE:
            reading.terminal = True
            return NOTHING
        chunk = _obj(data)
        if "error" in chunk:
            reading.error, reading.terminal = _error(chunk["error"]), True
            return NOTHING
        reading.model = _str(chunk.get("model")) or reading.model
        if usage := _obj(chunk.get("usage")):
            reading.usage = Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))
        reads = [self._choice(_obj(choice), reading) for choice in chunk.get("choices") or ()]
        return reads[0] if len(reads) == 1 else _joined(reads)

    @staticmethod
    def _choice(choice: dict[str, Any], reading: Reading) -> Read:
        read = _chat_delta(_obj(choice.get("delta")), reading)
        if choice.get("finish_reason") is None:
            return read
        reading.stop_reason = choice["finish_reason"]
        reading.cancelled = choice.get(CANCELLED_KEY) is True
        return attrs.evolve(read, tool_calls=read.tool_calls + reading.calls.complete_all())

    def stored_path(self, message_id: str) -> str:
        return message_path(message_id)

    def stored(self, body: Any) -> Stored:
        return _message_status(body, _chat_content)


# -- OpenAI Responses -----------------------------------------------------------------------------


def _responses_stop(response: dict[str, Any]) -> str | None:
    """A Response's stop reason as :class:`~ringserve.client.FinalMessage` spells it: the
    ``incomplete_details.reason`` of an incomplete one, else its ``status``."""
    reason = _obj(response.get("incomplete_details")).get("reason")
    status = response.get("status")
    return reason if status == "incomplete" and isinstance(reason, str) else status


def _responses_usage(usage: Any) -> Usage:
    usage = _obj(usage)
    return Usage(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")))


def _r_created(data: dict[str, Any], reading: Reading) -> Read:
    reading.model = _str(_obj(data.get("response")).get("model")) or reading.model
    return NOTHING


def _r_item_added(data: dict[str, Any], reading: Reading) -> Read:
    item = _obj(data.get("item"))
    if item.get("type") != "function_call":
        return NOTHING
    key = _int(data.get("output_index"))
    first = reading.calls.start(key, _str(item.get("call_id")), _str(item.get("name")))
    more = reading.calls.extend(key, _str(item.get("arguments")))
    return Read(tool_deltas=(first,) if more is None else (first, more))


def _r_text(data: dict[str, Any], reading: Reading) -> Read:
    return Read(text=_str(data.get("delta")))


def _r_reasoning(data: dict[str, Any], reading: Reading) -> Read:
    return Read(reasoning=_str(data.get("delta")))


def _r_arguments(data: dict[str, Any], reading: Reading) -> Read:
    piece = reading.calls.extend(_int(data.get("output_index")), _str(data.get("delta")))
    return NOTHING if piece is None else Read(tool_deltas=(piece,))


def _r_item_done(data: dict[str, Any], reading: Reading) -> Read:
    item = _obj(data.get("item"))
    if item.get("type") != "function_call":
        return NOTHING
    arguments = item.get("arguments")
    call = reading.calls.complete(_int(data.get("output_index")), arguments if isinstance(arguments, str) else None)
    return NOTHING if call is None else Read(tool_calls=(call,))


def _r_ended(data: dict[str, Any], reading: Reading) -> Read:
    """``response.completed`` / ``.incomplete`` / ``.failed``: the Response as it ended."""
    response = _obj(data.get("response"))
    reading.model = _str(response.get("model")) or reading.model
    reading.stop_reason = _responses_stop(response)
    reading.cancelled = response.get("status") == "cancelled"
    reading.usage = _responses_usage(response.get("usage")) if response.get("usage") else None
    if response.get("status") == "failed":
        reading.error = _error(response.get("error"), "server_error")
    reading.terminal = True
    return NOTHING


def _r_error(data: dict[str, Any], reading: Reading) -> Read:
    reading.error, reading.terminal = _error(data), True
    return NOTHING


def _stored_response(body: Any) -> Stored:
    """A Response object: running while ``queued`` or ``in_progress``, failed with its ``error``."""
    response = _obj(body)
    status = response.get("status")
    text, reasoning, calls = _responses_output(response.get("output"))
    error = _error(response.get("error"), "server_error") if status == "failed" else None
    return Stored(running=status in ("queued", "in_progress"), text=text, reasoning=reasoning, tool_calls=calls,
                  stop_reason=_responses_stop(response), usage=_responses_usage(response.get("usage")),
                  model=_str(response.get("model")), cancelled=status == "cancelled", error=error)


def _responses_output(output: Any) -> tuple[str, str, tuple[ToolCall, ...]]:
    """A Response's ``output`` items: (text, reasoning text: its items' content, else their
    summaries, function calls)."""
    items = [_obj(item) for item in output] if isinstance(output, list) else []

    def texts(kind: str, part: str) -> str:
        return "".join(_str(_obj(p).get("text")) for item in items if item.get("type") == kind
                       for p in item.get("content") or () if _obj(p).get("type") == part)

    calls = tuple(ToolCall(_str(item.get("call_id")), _str(item.get("name")), _arguments(item.get("arguments", "")))
                  for item in items if item.get("type") == "function_call")
    summaries = "".join(_str(_obj(p).get("text")) for item in items if item.get("type") == "reasoning"
                        for p in item.get("summary") or () if _obj(p).get("type") == "summary_text")
    return texts("message", "output_text"), texts("reasoning", "reasoning_text") or summaries, calls


#: OpenAI Responses (``POST /v1/responses``); the stored message is the Response object
#: (``GET /v1/responses/{id}``), read as its terminal event's ``response`` is.
RESPONSES = EventWire("responses", "/v1/responses", {
    "response.created": _r_created,
    "response.output_item.added": _r_item_added,
    "response.output_text.delta": _r_text,
    "response.reasoning_text.delta": _r_reasoning,
    "response.reasoning_summary_text.delta": _r_reasoning,
    "response.function_call_arguments.delta": _r_arguments,
    "response.output_item.done": _r_item_done,
    "response.completed": _r_ended,
    "response.incomplete": _r_ended,
    "response.failed": _r_ended,
    "error": _r_error,
}, ("max_output_tokens", "input", "instructions"), lambda message_id: f"/v1/responses/{quote(message_id, safe='')}",
    _stored_response)


#: The wires by surface name (the server's ``surfaces/registry.py`` names).
WIRES: Mapping[str, Wire] = {wire.name: wire for wire in (ANTHROPIC, OpenAIWire(), RESPONSES)}


def wire(surface: str) -> Wire:
    """The read side of the surface called ``surface``.

    Raises:
        ValueError: no surface of that name.
    """
    if surface not in WIRES:
        raise ValueError(f"surface must be one of {sorted(WIRES)}, got {surface!r}")
    return WIRES[surface]
