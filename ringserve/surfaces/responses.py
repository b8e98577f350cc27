"""OpenAI Responses surface (``POST /v1/responses`` and the routes in ``responses_routes.py``).

Shapes follow the official ``openai`` SDK's types (3.57): the request is
``openai.types.responses.ResponseCreateParams``, the object is
``openai.types.responses.Response``, and every stream event is one of
``openai.types.responses.ResponseStreamEvent``. A stream is ``event: <type>``
plus data JSON with the same ``type`` and a ``sequence_number`` equal to the
event's seq in the message's ring log (the hub appends every wire event a
renderer returns, in order, from seq 0, so the renderer counts them; the hub
puts ``id: <response_id>:<seq>`` on every event). No ``[DONE]``.

A text answer streams as::

    response.created (seq 0)  [response.queued, when background]  response.in_progress
    response.output_item.added  response.content_part.added  response.output_text.delta ...
    response.output_text.done  response.content_part.done  response.output_item.done
    then exactly one of response.completed | response.incomplete | response.failed

Terminal events, by how the generation ended:

- end of turn: ``response.completed`` (status ``completed``);
- ``max_output_tokens`` or a full context: ``response.incomplete`` with
  ``incomplete_details.reason = "max_output_tokens"``; the safety stage's
  refusal: ``response.incomplete`` with ``"content_filter"``;
- a cancel (``POST /v1/responses/{id}/cancel``, or a foreground reader gone
  under the ``abort`` policy): ``response.incomplete`` whose response has
  ``status: "cancelled"`` and ``incomplete_details: null``, the output so far
  with its message item ``incomplete``. Both are values of the SDK's types, so
  every reader ends on an event its SDK accepts (``response.completed`` would
  claim an end of turn);
- an error: ``response.failed`` with ``error.code`` (``server_error``,
  ``rate_limit_exceeded``, ``invalid_prompt``) and the message.

HTTP errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(the Chat Completions surface's table).
"""

from __future__ import annotations

import json
from typing import Any, assert_never

import attrs

from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    ContentBlock,
    Failure,
    Finish,
    GenerationRequest,
    StopReason,
    Usage,
)
from ringserve.core.status import MessageStatus
from ringserve.surfaces.base import (
    FieldTable,
    MessageResult,
    ParsedRequest,
    Refused,
    WireEvent,
    dumps,
    get_bool,
    get_int,
    get_str,
    require_object,
    sampling_params,
)
from ringserve.surfaces.openai import FINISH_REASONS, OpenAISurface

MAX_OUTPUT_TOKENS_LIMIT = 1_000_000
#: OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

_TOOLS = "tool use is not implemented yet on /v1/responses, issue 14"
_ZERO = (0, 0.0)

#: What ``parse_create`` does with each field of ``openai.types.responses.ResponseCreateParams``
#: (openai 3.57) and with ringserve's extensions; the README's compatibility table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
        "stream_options", "background", "store", "metadata", "previous_response_id", "text",
        # extensions, as llama.cpp's server accepts them on its other routes
        "top_k", "min_p", "seed",
    }),
    ignored=frozenset({
        # bookkeeping, caching and routing that cannot change the text
        "user", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "access_programs",
        # meaningful only with tools, which are refused
        "parallel_tool_calls", "max_tool_calls",
    }),
    refused={
        "tools": Refused(_TOOLS, neutral=([],)),
        "tool_choice": Refused(_TOOLS, neutral=("none", "auto")),
        "include": Refused("no additional output data (logprobs, encrypted reasoning) is produced", neutral=([],)),
        "top_logprobs": Refused("log probabilities are not implemented", neutral=(0,)),
        "reasoning": Refused("the model does not reason", neutral=({},)),
        "truncation": Refused("the input is never truncated: a conversation that does not fit is a 400",
                              neutral=("disabled",)),
        "conversation": Refused("the Conversations API is not implemented; use previous_response_id"),
        "context_management": Refused("context compaction is not implemented", neutral=([],)),
        "prompt": Refused("stored prompt templates are not implemented"),
        "image": Refused("image options are not implemented"),
        "moderation": Refused("moderation models are not implemented; see [safety] in the README"),
        "background_options": Refused("completion windows are not implemented",
                                      neutral=({}, {"completion_window": "soonest"})),
    },
)

#: The fields of ``text`` (``ResponseTextConfigParam``): only plain text output.
TEXT_FIELDS = FieldTable(
    supported=frozenset(),
    ignored=frozenset(),
    refused={
        "format": Refused("structured output is not implemented yet, issue 14", neutral=({"type": "text"},)),
        "verbosity": Refused("verbosity is not implemented"),
    },
)

#: The fields of a message input item (``EasyInputMessageParam``, ``Message``,
#: ``ResponseOutputMessageParam``: an earlier answer sent back).
ITEM_FIELDS = FieldTable(
    supported=frozenset({"type", "role", "content"}),
    ignored=frozenset({"id", "status", "phase"}),
    refused={},
)

#: The fields of an ``input_text`` part (``ResponseInputTextParam``) and of an ``output_text``
#: part (``ResponseOutputTextParam``), which an earlier answer sent back as input carries.
PART_FIELDS = {
    "input_text": FieldTable(frozenset({"type", "text"}), frozenset({"prompt_cache_breakpoint"}), {}),
    "output_text": FieldTable(frozenset({"type", "text"}), frozenset({"annotations", "logprobs"}), {}),
}

#: The fields of ``stream_options`` (``StreamOptions``).
STREAM_OPTIONS_FIELDS = FieldTable(
    supported=frozenset(),
    # a side-channel padding of OpenAI's events; ringserve sends none, which cannot change the text
    ignored=frozenset({"include_obfuscation"}),
    refused={},
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

#: Input item types that are tool-use items (refused until issue 14) and others ringserve has no
#: equivalent for; any other type is unknown. Both are 400s naming the type.
TOOL_ITEM_TYPES = frozenset({
    "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
    "computer_call", "computer_call_output", "file_search_call", "web_search_call", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output", "additional_tools",
    "program", "program_output",
})
OTHER_ITEM_TYPES = frozenset({"reasoning", "compaction", "compaction_trigger", "item_reference",
                              "configuration_update"})

#: ErrorKind → ``ResponseError.code`` (a literal of the SDK's type) of a failed response.
FAILURE_CODES = {ErrorKind.RATE_LIMIT: "rate_limit_exceeded", ErrorKind.OVERLOADED: "rate_limit_exceeded",
                 ErrorKind.INVALID_REQUEST: "invalid_prompt"}

#: StopReason → ``incomplete_details.reason`` of a response that ended ``incomplete``
#: (a reason not listed ends ``completed``; a cancel is status ``cancelled``).
INCOMPLETE_REASONS = {
    StopReason.MAX_TOKENS: "max_output_tokens",
    StopReason.CONTEXT_FULL: "max_output_tokens",
    StopReason.REFUSAL: "content_filter",
}

_OPENAI = OpenAISurface()


@attrs.frozen
class ResponseOptions:
    """What a Response object echoes of its request (``openai.types.responses.Response``)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    metadata: dict[str, str] = attrs.Factory(dict)
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True


@attrs.frozen
class ResponseCreate:
    """A parsed ``POST /v1/responses`` body.

    ``input`` is this request's own turns (``instructions`` not among them);
    :meth:`generation` prepends the system turn and a previous response's
    conversation.
    """

    options: ResponseOptions
    input: tuple[ChatMessage, ...]
    parsed: ParsedRequest

    def generation(self, history: tuple[ChatMessage, ...] = ()) -> ParsedRequest:
        """The request to generate: ``instructions`` (a system turn), ``history``, then ``input``."""
        system = () if self.options.instructions is None else (ChatMessage("system", self.options.instructions),)
        messages = system + history + self.input
        return attrs.evolve(self.parsed, request=attrs.evolve(self.parsed.request, messages=messages))


def _input_items(value: Any) -> tuple[ChatMessage, ...]:
    """``input``: a string (one user turn) or a list of message items with text parts."""
    if isinstance(value, str):
        return (ChatMessage("user", value),)
    if not isinstance(value, list) or not value:
        raise invalid("input: must be a string or a non-empty list of items", param="input")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: must be an object", param="input")
        kind = item.get("type", "message")
        if kind != "message":
            if kind in TOOL_ITEM_TYPES:
                raise invalid(f"{where}: items of type {kind!r} are not supported by ringserve ({_TOOLS})", param="input")
            if kind in OTHER_ITEM_TYPES:
                raise invalid(f"{where}: items of type {kind!r} are not supported by ringserve", param="input")
            raise invalid(f"{where}.type: unknown input item type {str(kind)[:60]!r}", param="input")
        ITEM_FIELDS.check(item, where, param="input")
        role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise invalid(f"{where}.role: must be one of {', '.join(ROLES)}", param="input")
        messages.append(ChatMessage(role, _item_text(item.get("content"), f"{where}.content")))
    return tuple(messages)


def _item_text(content: Any, where: str) -> str:
    """A message item's content: a string, or ``input_text`` / ``output_text`` parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: must be a string or a list of input_text parts", param="input")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}[{j}]: must be an object", param="input")
        table = PART_FIELDS.get(part.get("type"))  # type: ignore[arg-type]  # a non-str is no key
        if table is None:
            raise invalid(f"{where}[{j}]: content parts of type {str(part.get('type'))[:60]!r} are not supported"
                          " by ringserve (only input_text and output_text)", param="input")
        table.check(part, f"{where}[{j}]", param="input")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text: must be a string", param="input")
        parts.append(text)
    return "".join(parts)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid("metadata: must be an object of string values", param="metadata")
    if len(value) > METADATA_PAIRS:
        raise invalid(f"metadata: at most {METADATA_PAIRS} pairs", param="metadata")
    if any(len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS for k, v in value.items()):
        raise invalid(f"metadata: keys have at most {METADATA_KEY_CHARS} characters and values at most"
                      f" {METADATA_VALUE_CHARS}", param="metadata")
    return value


def parse_create(body: Any) -> ResponseCreate:
    """Validate a ``POST /v1/responses`` body (also the body of ``POST /v1/responses/input_tokens``).

    Fields as :data:`REQUEST_FIELDS` lists them: ``model``, ``input`` (a
    string, or message items of role user/system/developer/assistant with
    ``input_text``/``output_text`` parts; :data:`ITEM_FIELDS`,
    :data:`PART_FIELDS`), ``instructions`` (a system turn first; not carried
    over by ``previous_response_id``, as OpenAI documents), ``max_output_tokens``
    (1 to 1,000,000; more than the context leaves: until the context is full),
    ``temperature`` (0–2), ``top_p``, ``stream``, ``stream_options``
    (only with ``stream``), ``background``, ``store`` (``background`` needs
    it, as OpenAI's API requires), ``metadata`` (16 string pairs),
    ``previous_response_id``, ``text`` (only ``{"format": {"type": "text"}}``);
    and ``top_k``, ``min_p``, ``seed`` as extensions. Tools, structured output
    and unknown fields are refused.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the offending field.
    """
    body = require_object(body)
    REQUEST_FIELDS.check(body)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise invalid("text: must be an object", param="text")
    TEXT_FIELDS.check(text or {}, "text", param="text")
    if "input" not in body or body["input"] is None:
        raise invalid("input: field required", param="input")
    messages = _input_items(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions: must be a string (a list of items is not supported)", param="instructions")
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options: must be an object", param="stream_options")
    if options is not None and not stream:
        raise invalid("stream_options: only allowed when stream is true", param="stream_options")
    STREAM_OPTIONS_FIELDS.check(options or {}, "stream_options", param="stream_options")
    background, store = get_bool(body, "background"), get_bool(body, "store", default=True)
    if background and not store:
        raise invalid("background: a background response must be stored (store: true)", param="background")
    previous = get_str(body, "previous_response_id") or None
    max_tokens = get_int(body, "max_output_tokens", lo=1, hi=MAX_OUTPUT_TOKENS_LIMIT)
    sampling = sampling_params(body, max_temperature=2.0)
    request = GenerationRequest(messages=messages, max_tokens=max_tokens, sampling=sampling)
    return ResponseCreate(
        options=ResponseOptions(
            instructions=instructions,
            max_output_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            metadata=_metadata(body.get("metadata")),
            previous_response_id=previous,
            background=background,
            store=store,
        ),
        input=messages,
        parsed=ParsedRequest(request=request, stream=stream, model=get_str(body, "model")),
    )


#: The fields of ``openai.types.responses.InputTokenCountParams`` (``POST /v1/responses/input_tokens``):
#: each is decided by :data:`REQUEST_FIELDS`, but for ``personality``.
COUNT_FIELDS = frozenset({"conversation", "input", "instructions", "model", "parallel_tool_calls", "personality",
                          "previous_response_id", "reasoning", "text", "tool_choice", "tools", "truncation"})


def parse_count(body: Any) -> ResponseCreate:
    """Validate a ``POST /v1/responses/input_tokens`` body: the fields of :data:`COUNT_FIELDS`, as
    :func:`parse_create` reads them (``personality``, a style preset, is refused).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the offending field.
    """
    body = require_object(body)
    for key in body:
        if key not in COUNT_FIELDS:
            raise invalid(f"{key}: unknown field", param=key)
    if body.get("personality") is not None:
        raise invalid("personality: not supported by ringserve (style presets are not implemented)", param="personality")
    return parse_create({k: v for k, v in body.items() if k != "personality"})


def stored_create(request_json: str) -> ResponseCreate | None:
    """The parsed request of a stored response, or None when the store kept no prompt
    (``[store] keep_prompts = false``) or its body no longer parses."""
    if not request_json:
        return None
    try:
        return parse_create(json.loads(request_json))
    except (ValueError, RingserveError):
        return None


# -- the Response object ---------------------------------------------------------------------


def item_id(response_id: str, index: int = 0) -> str:
    """The id of output item ``index`` (the message's content block ``index``): ``msg_`` and the
    response id's own part, with ``_<index>`` after the first."""
    return "msg_" + response_id.removeprefix("resp_") + (f"_{index}" if index else "")


def usage_json(usage: Usage) -> dict[str, Any]:
    """``ResponseUsage``: ``input_tokens`` counts the whole prompt, of which ``cached_tokens``
    came from the prompt-prefix cache; ringserve writes no billed cache (``cache_write_tokens`` 0)
    and the model does not reason (``reasoning_tokens`` 0)."""
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_only(kind: BlockKind) -> None:
    """Text is the only block kind rendered until tool use lands (issue 14; tools are refused)."""
    if kind is not BlockKind.TEXT:
        raise NotImplementedError(f"Responses rendering of {kind.value} blocks")


def _message_item(response_id: str, index: int, text: str | None, status: str) -> dict[str, Any]:
    """The assistant message output item (``ResponseOutputMessage``); ``text`` None: no part yet."""
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id(response_id, index), "type": "message", "role": "assistant", "status": status,
            "content": content}


def output_json(response_id: str, blocks: tuple[ContentBlock, ...], last_status: str) -> list[dict[str, Any]]:
    """``Response.output``: one message item per text block; every item but the last is
    ``completed``, the last one has ``last_status`` (the response's outcome)."""
    items = []
    for i, block in enumerate(blocks):
        _text_only(block.kind)
        items.append(_message_item(response_id, i, block.text, "completed" if i < len(blocks) - 1 else last_status))
    return items


@attrs.frozen
class Outcome:
    """How a response stands: its wire ``status``, ``incomplete_details.reason``, ``error``."""

    status: str
    incomplete_reason: str | None = None
    error: dict[str, Any] | None = None

    @property
    def item_status(self) -> str:
        """The status of its message item: ``completed`` only for a completed response."""
        if self.status == "completed":
            return "completed"
        return "in_progress" if self.status in ("queued", "in_progress") else "incomplete"


def failure_error(kind: ErrorKind, message: str) -> dict[str, Any]:
    """``ResponseError`` of a failed response (``code`` per :data:`FAILURE_CODES`)."""
    return {"code": FAILURE_CODES.get(kind, "server_error"), "message": message}


def finish_outcome(reason: StopReason) -> Outcome:
    """The outcome of a generation that ended with ``reason`` (see the module docstring)."""
    if reason is StopReason.CANCELLED:
        return Outcome("cancelled")
    incomplete = INCOMPLETE_REASONS.get(reason)
    return Outcome("completed") if incomplete is None else Outcome("incomplete", incomplete)


def status_outcome(status: MessageStatus, stop_reason: StopReason | None, error: str | None,
                   background: bool) -> Outcome:
    """A message's outcome from its stored or live status.

    ``queued`` is ``queued`` for a background response and ``in_progress`` otherwise (as its
    ``response.created`` said); ``interrupted`` (a drain, or a crash found at the next start) is
    ``failed`` with ``server_error``: the output keeps the text it had.
    """
    match status:
        case MessageStatus.QUEUED:
            return Outcome("queued" if background else "in_progress")
        case MessageStatus.GENERATING:
            return Outcome("in_progress")
        case MessageStatus.COMPLETE | MessageStatus.CANCELLED:
            return finish_outcome(StopReason.CANCELLED if status is MessageStatus.CANCELLED
                                  else stop_reason or StopReason.END)
        case MessageStatus.FAILED:
            return Outcome("failed", error=failure_error(ErrorKind.API_ERROR, error or "generation failed"))
        case MessageStatus.INTERRUPTED:
            message = error or "the server stopped (a restart or a crash) while generating; the output is the text so far"
            return Outcome("failed", error=failure_error(ErrorKind.API_ERROR, message))
        case _:
            assert_never(status)


def response_json(
    response_id: str,
    *,
    model: str,
    created: int,
    options: ResponseOptions,
    outcome: Outcome,
    blocks: tuple[ContentBlock, ...],
    usage: Usage | None,
) -> dict[str, Any]:
    """The ``Response`` object (``openai.types.responses.Response``).

    Args:
        blocks: the content blocks so far (:func:`output_json`).
        usage: None until the response has ended.
    """
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": outcome.status,
        "background": options.background,
        "error": outcome.error,
        "incomplete_details": None if outcome.incomplete_reason is None else {"reason": outcome.incomplete_reason},
        "instructions": options.instructions,
        "max_output_tokens": options.max_output_tokens,
        "metadata": options.metadata,
        "model": model,
        "output": output_json(response_id, blocks, outcome.item_status),
        "parallel_tool_calls": True,
        "previous_response_id": options.previous_response_id,
        "temperature": options.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": options.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else usage_json(usage),
    }


# -- rendering --------------------------------------------------------------------------------


class ResponsesRenderer:
    """Renders one response's events as typed Responses stream events, counting their seqs.

    Each content block is an output item (``output_index`` = the block's index). A stopped block's
    done events wait for what follows: the next block (the item is ``completed``) or the terminal
    event (the item has the response's outcome: ``incomplete`` after a cut or a cancel).
    """

    def __init__(self, response_id: str, model: str, created: int, options: ResponseOptions) -> None:
        self._id, self._model, self._created, self._options = response_id, model, created, options
        self._seq = 0
        self._items: list[list[str]] = []  # the text parts of each block's item
        self._open: int | None = None  # a block started and not stopped
        self._stopped: int | None = None  # a stopped block whose done events are due

    def _event(self, type_: str, **fields: Any) -> WireEvent:
        seq, self._seq = self._seq, self._seq + 1
        return WireEvent(dumps({"type": type_, "sequence_number": seq, **fields}), event=type_)

    def _response(self, outcome: Outcome, usage: Usage | None) -> dict[str, Any]:
        blocks = tuple(ContentBlock(BlockKind.TEXT, "".join(parts)) for parts in self._items)
        return response_json(self._id, model=self._model, created=self._created, options=self._options,
                             outcome=outcome, blocks=blocks, usage=usage)

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": item_id(self._id, index), "output_index": index, "content_index": 0}

    def start(self, usage: Usage) -> list[WireEvent]:
        first = Outcome("queued" if self._options.background else "in_progress")
        events = [self._event("response.created", response=self._response(first, None))]
        if self._options.background:
            events.append(self._event("response.queued", response=self._response(first, None)))
        events.append(self._event("response.in_progress", response=self._response(Outcome("in_progress"), None)))
        return events

    def block_start(self, start: BlockStart) -> list[WireEvent]:
        _text_only(start.kind)
        events = self._close("completed")
        self._items.append([])
        self._open = start.index
        return [
            *events,
            self._event("response.output_item.added", output_index=start.index,
                        item=_message_item(self._id, start.index, None, "in_progress")),
            self._event("response.content_part.added", part=_text_part(""), **self._where(start.index)),
        ]

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        self._items[delta.index].append(delta.text)
        return [self._event("response.output_text.delta", delta=delta.text, logprobs=[], **self._where(delta.index))]

    def block_stop(self, stop: BlockStop) -> list[WireEvent]:
        self._open, self._stopped = None, stop.index
        return []

    def _close(self, item_status: str) -> list[WireEvent]:
        """The done events of the block that is stopped (or, after a failure, still open)."""
        index = self._stopped if self._stopped is not None else self._open
        if index is None:
            return []
        self._open = self._stopped = None
        text = "".join(self._items[index])
        return [
            self._event("response.output_text.done", text=text, logprobs=[], **self._where(index)),
            self._event("response.content_part.done", part=_text_part(text), **self._where(index)),
            self._event("response.output_item.done", output_index=index,
                        item=_message_item(self._id, index, text, item_status)),
        ]

    def _end(self, type_: str, outcome: Outcome, usage: Usage) -> list[WireEvent]:
        return [*self._close(outcome.item_status), self._event(type_, response=self._response(outcome, usage))]

    def finish(self, finish: Finish) -> list[WireEvent]:
        outcome = finish_outcome(finish.stop_reason)
        return self._end("response.completed" if outcome.status == "completed" else "response.incomplete",
                         outcome, finish.usage)

    def fail(self, failure: Failure) -> list[WireEvent]:
        outcome = Outcome("failed", error=failure_error(failure.kind, failure.message))
        return self._end("response.failed", outcome, failure.usage)


class ResponsesSurface:
    """The OpenAI Responses API: one instance per request carries what its objects echo.

    The module's :data:`RESPONSES` (default options) answers errors and stored responses;
    ``responses_routes.py`` makes one with a request's :class:`ResponseOptions` for ``Hub.create``,
    so the hub's producer renders with them.
    """

    name = "responses"
    id_prefix = "resp_"

    def __init__(self, options: ResponseOptions = ResponseOptions()) -> None:
        self.options = options

    def parse_request(self, body: Any) -> ParsedRequest:
        """:func:`parse_create` without a previous response's conversation."""
        return parse_create(body).generation()

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> ResponsesRenderer:
        return ResponsesRenderer(message_id, model, created, self.options)

    def message_json(self, result: MessageResult) -> dict[str, Any]:
        """The Response object of a message that ended."""
        outcome = finish_outcome(StopReason.CANCELLED if result.cancelled else result.stop_reason or StopReason.END)
        return response_json(result.message_id, model=result.model, created=result.created, options=self.options,
                             outcome=outcome, blocks=result.content, usage=result.usage)

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> list[dict[str, Any]]:
        """The content parts of the message's output items (``GET /v1/messages/{id}``)."""
        for block in blocks:
            _text_only(block.kind)
        return [_text_part(block.text) for block in blocks]

    def stop_reason(self, reason: StopReason) -> str:
        """The Chat Completions spelling (``GET /v1/messages/{id}`` shows it for every surface)."""
        return FINISH_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return _OPENAI.error_status(error)

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _OPENAI.error_json(error)


RESPONSES = ResponsesSurface()
