"""Anthropic Messages API surface (``POST /v1/messages``).

Request and event shapes follow Anthropic's "Messages" and "Streaming
Messages" documentation: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``, or ``input_json_delta`` in a ``tool_use``
block)..., ``content_block_stop`` for each block, then
``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``),
``message_stop``; errors are ``{"type": "error", "error": {"type", "message"}}``
both as HTTP bodies and as the in-band ``event: error``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
    OutputFormat,
    OutputKind,
    StopReason,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    Usage,
)
from ringserve.core.render import WireEvent
from ringserve.core.view import MessageView
from ringserve.surfaces.base import (
    check_enforced,
    CallIds,
    FieldTable,
    ParsedRequest,
    Refused,
    cancelled_fields,
    dumps,
    json_template,
    get_bool,
    get_int,
    get_str,
    sampling_params,
    require_object,
    stop_list,
    text_block,
    text_content,
    json_schema,
    optional,
    tool_choice,
    tool_list,
    tool_name,
)

MAX_TOKENS_LIMIT = 1_000_000

#: ErrorKind → Anthropic error ``type`` (docs: "Errors").
ERROR_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.CONFLICT: "invalid_request_error",
    ErrorKind.GONE: "not_found_error",
    # 413 as the docs give it ("HTTP errors", https://docs.claude.com/en/api/errors) and the API sends
    # it; the SDK's ErrorType literal lacks it (anthropic 2.14) and raises it as ContentTooLargeError.
    ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
    ErrorKind.UNPROCESSABLE: "invalid_request_error",
    ErrorKind.RATE_LIMIT: "rate_limit_error",
    ErrorKind.API_ERROR: "api_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.UNAVAILABLE: "overloaded_error",
}

#: StopReason → Anthropic ``stop_reason``, each a value of the SDK's ``StopReason`` literal. A
#: cancelled generation ends its turn where it was cut, with ``"ringserve_cancelled": true``
#: next to the stop reason (``surfaces/base.py`` ``CANCELLED_KEY``).
STOP_REASONS = {
    StopReason.END: "end_turn",
    StopReason.MAX_TOKENS: "max_tokens",
    StopReason.CONTEXT_FULL: "model_context_window_exceeded",
    StopReason.STOP_SEQUENCE: "stop_sequence",
    StopReason.CANCELLED: "end_turn",
    StopReason.REFUSAL: "refusal",
    StopReason.TOOL_USE: "tool_use",
}


#: What ``parse_request`` does with each field of ``anthropic.types.MessageCreateParams``
#: and ``anthropic.types.beta.MessageCreateParams`` (anthropic 2.14; the beta one is
#: what ``client.beta.messages.create`` and pydantic-ai send), and with ringserve's
#: extensions; docs/compatibility.md's table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
        "tools", "tool_choice", "output_config",
        # extensions, as llama.cpp's server accepts them
        "min_p", "seed",
    }),
    ignored=frozenset({
        # request bookkeeping and routing that cannot change the text
        "metadata", "service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id",
        "cache_control", "diagnostics", "container",
        # beta: billing, and retries on other models after a refusal (there is one model)
        "billing_policy", "fallback_credit_token", "fallbacks",
    }),
    refused={
        "thinking": Refused("extended thinking is not implemented", neutral=({"type": "disabled"},)),
        # beta
        "output_format": Refused("deprecated: send output_config.format, as the current SDKs do"),
        "mcp_servers": Refused("MCP servers are not implemented", neutral=([],)),
        "context_management": Refused("context management is not implemented"),
        "compaction": Refused("compaction is not implemented"),
        "thread": Refused("server-held threads are not implemented; send the whole conversation"),
    },
)

#: The fields of ``POST /v1/messages/count_tokens`` (``anthropic.types.MessageCountTokensParams``):
#: those of a request that it shares, decided the same way.
COUNT_TOKENS_FIELDS = FieldTable(
    supported=frozenset({"model", "messages", "system", "tools", "tool_choice", "output_config"}),
    ignored=frozenset({"cache_control", "speed", "user_profile_id", "workspace_id"}),
    refused={"thinking": REQUEST_FIELDS.refused["thinking"]},
)

#: The fields of one message (``MessageParam``: user, assistant and system messages).
MESSAGE_FIELDS = FieldTable(supported=frozenset({"role", "content"}), ignored=frozenset(), refused={})

#: The fields of one text block of a message's or the system prompt's content (``TextBlockParam``).
TEXT_BLOCK_FIELDS = FieldTable(
    supported=frozenset({"type", "text"}),
    # a caching hint: the prefix cache is automatic
    ignored=frozenset({"cache_control"}),
    refused={"citations": Refused("citations are not implemented", neutral=([],))},
)

_TOOLSETS = Refused("toolsets are not implemented")

#: The fields of one custom tool (``ToolParam``, ``BetaToolParam``). The other tool types
#: (Anthropic's server and client tools: ``bash_20250124``, ``web_search_20250305``, ...) are
#: refused by their ``type``.
TOOL_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "description", "input_schema", "strict"}),
    ignored=frozenset({
        "cache_control",  # a caching hint: the prefix cache is automatic
        "eager_input_streaming",  # arguments are always streamed as they are decoded
    }),
    refused={
        "input_examples": Refused("tool input examples are not implemented", neutral=([],)),
        "defer_loading": Refused("tool search is not implemented", neutral=(False,)),
        "allowed_callers": Refused("code execution is not implemented", neutral=(["direct"],)),
    },
)

#: The fields of ``tool_choice`` (``ToolChoiceParam``: auto, any, tool, none).
TOOL_CHOICE_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "disable_parallel_tool_use"}), ignored=frozenset(), refused={}
)

#: The fields of an assistant message's ``tool_use`` block (``ToolUseBlockParam``).
TOOL_USE_FIELDS = FieldTable(
    supported=frozenset({"type", "id", "name", "input"}),
    ignored=frozenset({"cache_control"}),
    refused={
        "caller": Refused("server tool callers are not implemented", neutral=({"type": "direct"},)),
        "toolset_name": _TOOLSETS,
    },
)

#: The fields of a user message's ``tool_result`` block (``ToolResultBlockParam``).
TOOL_RESULT_FIELDS = FieldTable(
    supported=frozenset({"type", "tool_use_id", "content", "is_error"}),
    ignored=frozenset({"cache_control"}),
    refused={"toolset_name": _TOOLSETS},
)

#: The fields of ``output_config`` (``OutputConfigParam``, ``BetaOutputConfigParam``).
OUTPUT_CONFIG_FIELDS = FieldTable(
    supported=frozenset({"format"}),
    ignored=frozenset(),
    refused={
        "effort": Refused("effort levels are not implemented"),
        "task_budget": Refused("task budgets are not implemented"),
    },
)

#: The fields of ``output_config.format`` (``JSONOutputFormatParam``), what ``messages.parse(output_format=...)``
#: sends (anthropic 2.14, beta or not: ``{"type": "json_schema", "schema": ...}``).
OUTPUT_FORMAT_FIELDS = FieldTable(supported=frozenset({"type", "schema"}), ignored=frozenset(), refused={})

#: tool_choice ``type`` → mode (Anthropic's ``any`` is "some tool must be called").
TOOL_CHOICE_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "any": ToolChoiceMode.REQUIRED,
    "tool": ToolChoiceMode.NAMED,
    "none": ToolChoiceMode.NONE,
}

#: The prefix of a tool call id on this surface (``toolu_`` + the neutral 24 hex digits).
TOOL_ID_PREFIX = "toolu_"

ROLES = ("user", "assistant", "system")


def _error_object(kind_name: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind_name, "message": message}}


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic ``usage``: ``input_tokens`` is the uncached part of the prompt and
    ``cache_read_input_tokens`` the part read from the prefix cache (their sum is the prompt)."""
    return {
        "input_tokens": usage.input_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


def tool_use_id(call_id: str) -> str:
    """A tool call's id on this surface: ``toolu_`` and the neutral 24 hex digits."""
    return TOOL_ID_PREFIX + call_id


def _input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input``: the call's arguments, a JSON object; ``{}`` when they were
    cut before they formed one (``max_tokens``, a cancel: the stream has every fragment)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _block_json(block: ContentBlock) -> dict[str, Any]:
    """One block of a non-stream ``Message``'s ``content`` (``TextBlock``, ``ToolUseBlock``)."""
    match block.kind:
        case BlockKind.TEXT:
            return {"type": "text", "text": block.text}
        case BlockKind.TOOL_CALL:
            return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                    "input": _input(block.text)}
        case BlockKind.REASONING:
            raise NotImplementedError("Anthropic rendering of reasoning blocks (nothing emits them)")
        case _:
            assert_never(block.kind)


class AnthropicRenderer:
    """Renders one message's events in Anthropic's streaming order (see module doc).

    Each block is ``content_block_start`` (``{"type": "text", "text": ""}`` or ``{"type":
    "tool_use", "id": "toolu_...", "name": ..., "input": {}}``), its deltas (``text_delta``, or
    ``input_json_delta`` with the arguments' next ``partial_json`` fragment) and
    ``content_block_stop``, with the index the block has in the message (text and tool-use
    blocks are numbered together).
    """

    def __init__(self, message_id: str, model: str) -> None:
        self._message_id = message_id
        self._model = model
        self._open = BlockKind.TEXT  # the kind of the block that deltas belong to
        self._text_delta: tuple[int, Callable[[str], str]] | None = None  # the open text block's template

    def start(self, usage: Usage) -> list[WireEvent]:
        message: dict[str, Any] = {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(usage),
        }
        return [WireEvent(dumps({"type": "message_start", "message": message}), "message_start")]

    def block_start(self, start: BlockStart) -> list[WireEvent]:
        self._open = start.kind
        # an empty block: "text": "", or "input": {} (the arguments follow as input_json_delta)
        block = _block_json(ContentBlock(start.kind, name=start.name, call_id=start.call_id))
        data = {"type": "content_block_start", "index": start.index, "content_block": block}
        return [WireEvent(dumps(data), "content_block_start")]

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        if self._open is BlockKind.TOOL_CALL:
            body = {"type": "input_json_delta", "partial_json": delta.text}
            data = {"type": "content_block_delta", "index": delta.index, "delta": body}
            return [WireEvent(dumps(data), "content_block_delta")]
        if self._text_delta is None or self._text_delta[0] != delta.index:
            index = delta.index
            self._text_delta = index, json_template(lambda text: {
                "type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}})
        return [WireEvent(self._text_delta[1](delta.text), "content_block_delta")]

    def block_stop(self, stop: BlockStop) -> list[WireEvent]:
        return [WireEvent(dumps({"type": "content_block_stop", "index": stop.index}), "content_block_stop")]

    def finish(self, finish: Finish) -> list[WireEvent]:
        delta = {
            "stop_reason": STOP_REASONS[finish.stop_reason],
            "stop_sequence": finish.stop_sequence,
            **cancelled_fields(finish.stop_reason is StopReason.CANCELLED),
        }
        return [
            WireEvent(dumps({"type": "message_delta", "delta": delta, "usage": _usage(finish.usage)}), "message_delta"),
            WireEvent(dumps({"type": "message_stop"}), "message_stop"),
        ]

    def fail(self, failure: Failure) -> list[WireEvent]:
        return [WireEvent(dumps(_error_object(ERROR_TYPES[failure.kind], failure.message)), "error")]


def conversation(body: dict[str, Any]) -> GenerationRequest:
    """The prompt part of a request body: ``system``, ``messages``, ``tools``, ``tool_choice``
    and ``output_config``, as a request with no ``max_tokens``.

    * ``tools``: at most :data:`~ringserve.surfaces.base.MAX_TOOLS` custom tools
      (:data:`TOOL_FIELDS`) with distinct names and an object ``input_schema``.
    * ``tool_choice``: ``auto``, ``any``, ``{"type": "tool", "name": ...}`` (a tool of
      ``tools``) or ``none``; ``disable_parallel_tool_use``.
    * An assistant turn's ``tool_use`` blocks (``id``, ``name``, ``input`` an object) become its
      tool calls, after its text; a user turn's ``tool_result`` blocks (``tool_use_id`` of an
      earlier ``tool_use``, ``content`` a string or text blocks, ``is_error``) become ``tool``
      turns, in block order with the user's text between them. Either needs ``tools``, as
      the Messages API requires.
    * ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the offending field.
    """
    messages: list[ChatMessage] = []
    if "system" in body and body["system"] is not None:
        messages.append(ChatMessage("system", text_content(body["system"], "system", TEXT_BLOCK_FIELDS)))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: must be a non-empty list", param="messages")
    ids = CallIds()
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]: must be an object", param="messages")
        MESSAGE_FIELDS.check(m, f"messages[{i}]", param="messages")
        messages += _turns(m, f"messages[{i}]", ids)
    tools = tool_list(body.get("tools"), "tools", _tool)
    if not tools and any(m.tool_calls or m.role == "tool" for m in messages):
        # The Messages API's own refusal (anthropic-sdk-python issue 494 quotes it).
        raise invalid("tools: requests which include tool_use or tool_result blocks must define tools", param="tools")
    request = GenerationRequest(
        messages=tuple(messages),
        max_tokens=None,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        output=_output(body.get("output_config")),
    )
    return check_enforced(request, "tools[{i}].input_schema", "output_config.format.schema")


#: Block types a message of the other role may not hold: (type, the role it belongs to).
_ROLE_OF_BLOCK = {"tool_use": "assistant", "tool_result": "user"}


def _turns(m: dict[str, Any], where: str, ids: CallIds) -> list[ChatMessage]:
    """The neutral turns of one message: one, or a user message's tool results and texts in order."""
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role: must be one of {', '.join(ROLES)}", param="messages")
    content, where = m.get("content"), f"{where}.content"
    if role == "system" or not isinstance(content, list) or not content:
        return [ChatMessage(role, text_content(content, where, TEXT_BLOCK_FIELDS, allow_empty=False))]
    turns: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in _ROLE_OF_BLOCK and _ROLE_OF_BLOCK[kind] != role:
            raise invalid(f"{at}: {kind} blocks belong in {_ROLE_OF_BLOCK[kind]} messages", param="messages")
        if kind == "tool_use":
            calls.append(_tool_use(block, at, ids))
        elif kind == "tool_result":
            if texts:
                turns.append(ChatMessage("user", "".join(texts)))
                texts = []
            turns.append(_tool_result(block, at, ids))
        else:
            texts.append(text_block(block, at, where, TEXT_BLOCK_FIELDS))
    if role == "assistant":
        return [ChatMessage("assistant", "".join(texts), tool_calls=tuple(calls))]
    if texts:
        turns.append(ChatMessage("user", "".join(texts)))
    return turns


def _tool_use(block: dict[str, Any], where: str, ids: CallIds) -> ToolCall:
    TOOL_USE_FIELDS.check(block, where, param="messages")
    call_id = ids.call(block.get("id"), f"{where}.id", "messages")
    name = tool_name(block.get("name"), f"{where}.name", "messages")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input: must be an object", param="messages")
    return ToolCall(call_id, name, dumps(arguments))


def _tool_result(block: dict[str, Any], where: str, ids: CallIds) -> ChatMessage:
    TOOL_RESULT_FIELDS.check(block, where, param="messages")
    call_id = ids.result(block.get("tool_use_id"), f"{where}.tool_use_id", "messages")
    content = block.get("content")
    text = "" if content is None else text_content(content, f"{where}.content", TEXT_BLOCK_FIELDS, param="messages")
    is_error = optional(block.get("is_error"), bool, f"{where}.is_error", "messages")
    return ChatMessage("tool", text, tool_call_id=call_id, is_error=bool(is_error))


def _tool(raw: dict[str, Any], where: str) -> ToolSpec:
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise invalid(
            f"{where}.type: tools of type {kind!r:.80} (Anthropic's server and client tools) are not supported"
            " by ringserve (only custom tools: name, description, input_schema)",
            param="tools",
        )
    TOOL_FIELDS.check(raw, where, param="tools")
    return ToolSpec(
        name=tool_name(raw.get("name"), f"{where}.name", "tools"),
        description=optional(raw.get("description"), str, f"{where}.description", "tools") or "",
        parameters=json_schema(raw.get("input_schema"), f"{where}.input_schema", "tools", arguments=True),
        strict=bool(optional(raw.get("strict"), bool, f"{where}.strict", "tools")),
    )


def _tool_choice(value: Any, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice()
    value = TOOL_CHOICE_FIELDS.object(value, "tool_choice", "tool_choice")
    kind = value.get("type")
    mode = TOOL_CHOICE_MODES.get(kind) if isinstance(kind, str) else None
    if mode is None:
        raise invalid(f"tool_choice.type: must be one of {', '.join(TOOL_CHOICE_MODES)}", param="tool_choice")
    name = ""
    if mode is ToolChoiceMode.NAMED:
        name = tool_name(value.get("name"), "tool_choice.name", "tool_choice")
    serial = optional(value.get("disable_parallel_tool_use"), bool, "tool_choice.disable_parallel_tool_use",
                      "tool_choice")
    return tool_choice(ToolChoice(mode, name, parallel=not serial), tools, "tool_choice")


def _output(value: Any) -> OutputFormat:
    if value is None:
        return OutputFormat()
    fmt = OUTPUT_CONFIG_FIELDS.object(value, "output_config", "output_config").get("format")
    if fmt is None:
        return OutputFormat()
    fmt = OUTPUT_FORMAT_FIELDS.object(fmt, "output_config.format", "output_config")
    if fmt.get("type") != "json_schema":
        raise invalid('output_config.format.type: must be "json_schema"', param="output_config")
    schema = json_schema(fmt.get("schema"), "output_config.format.schema", "output_config", arguments=False)
    return OutputFormat(OutputKind.JSON_SCHEMA, schema)


class AnthropicSurface:
    """Anthropic Messages: parsing, rendering and error shapes."""

    name = "anthropic"
    id_prefix = "msg_"
    prefer_respond_async = True
    refuses_lone_surrogates = False

    def restored(self, echo: str) -> AnthropicSurface:
        """Itself: it keeps no state of its own (``echo`` is "")."""
        return self

    def parse_request(self, body: Any) -> ParsedRequest:
        """Validate a Messages request body.

        Fields as :data:`REQUEST_FIELDS` lists them: ``model``,
        ``max_tokens`` (required, 1 to 1,000,000; more than the context leaves
        is served until the context is full), ``messages`` (user, assistant
        and system turns; string content or a non-empty list of text blocks,
        checked against :data:`TEXT_BLOCK_FIELDS`; assistant turns may hold
        ``tool_use`` blocks and user turns ``tool_result`` blocks, see
        :func:`conversation`), ``system`` (string or text
        blocks), ``tools``, ``tool_choice`` and ``output_config`` (see
        :func:`conversation`), ``temperature`` (0–1), ``top_p``, ``top_k``,
        ``stop_sequences`` (a list of non-empty strings), ``stream``; and, as llama.cpp's server does,
        ``min_p`` and ``seed``. Bookkeeping fields (``metadata``, ...) are
        accepted and ignored; fields that would change the answer and are
        not implemented (``thinking``, image or document blocks, server
        tools, ...) and unknown fields are refused. Headers such as
        ``anthropic-beta`` are not read.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming the offending field.
        """
        body = require_object(body)
        REQUEST_FIELDS.check(body)
        model = get_str(body, "model", required=True)
        max_tokens = get_int(body, "max_tokens", lo=1, hi=MAX_TOKENS_LIMIT)
        if max_tokens is None:
            raise invalid("max_tokens: field required", param="max_tokens")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise invalid("metadata: must be an object", param="metadata")
        request = attrs.evolve(
            conversation(body),
            max_tokens=max_tokens,
            sampling=sampling_params(body, max_temperature=1.0),
            stop=stop_list(body.get("stop_sequences"), "stop_sequences", allow_string=False),
        )
        return ParsedRequest(request=request, stream=get_bool(body, "stream"), model=model)

    def parse_count(self, body: Any) -> ParsedRequest:
        """Validate a ``POST /v1/messages/count_tokens`` body (:data:`COUNT_TOKENS_FIELDS`).

        The conversation is read as :meth:`parse_request` reads it (system
        prompt, tools, tool choice, output format), so its prompt is the one
        that request would be given; the request has no ``max_tokens``.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming the offending field.
        """
        body = require_object(body)
        COUNT_TOKENS_FIELDS.check(body)
        return ParsedRequest(request=conversation(body), stream=False, model=get_str(body, "model", required=True))

    def count_json(self, input_tokens: int) -> dict[str, Any]:
        """The ``POST /v1/messages/count_tokens`` answer (``anthropic.types.MessageTokensCount``)."""
        return {"input_tokens": input_tokens}

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> AnthropicRenderer:
        return AnthropicRenderer(message_id, model)

    def message_json(self, view: MessageView) -> dict[str, Any]:
        """The non-stream ``Message`` object."""
        return {
            "id": view.id,
            "type": "message",
            "role": "assistant",
            "content": self.content_json(view.content),
            "model": view.model,
            "stop_reason": None if view.stop_reason is None else STOP_REASONS[view.stop_reason],
            "stop_sequence": view.stop_sequence,
            **cancelled_fields(view.cancelled),
            "usage": _usage(view.usage),
        }

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> list[dict[str, Any]]:
        """The ``content`` list of a ``Message``: text and ``tool_use`` blocks (``input`` an object)."""
        return [_block_json(b) for b in blocks]

    def stop_reason(self, reason: StopReason) -> str:
        return STOP_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return error.status

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _error_object(ERROR_TYPES[error.kind], error.message)
