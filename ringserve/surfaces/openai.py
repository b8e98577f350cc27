"""OpenAI Chat Completions surface (``POST /v1/chat/completions``).

Shapes follow OpenAI's "Chat Completions" API reference and its "Streaming"
guide: ``chat.completion.chunk`` objects (tool calls as ``delta.tool_calls``
fragments, see :class:`OpenAIRenderer`), a usage chunk with empty
``choices`` only when ``stream_options.include_usage`` is set, and a final
``data: [DONE]``. A mid-stream error is ``data: {"error": {...}}`` with no
``[DONE]`` after it (the official SDK raises on it). HTTP errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, assert_never

from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import (
    AppliedEdit,
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    ContentBlock,
    Failure,
    Finish,
    GenerationRequest,
    MAX_TOP_LOGPROBS,
    OutputFormat,
    OutputKind,
    StopReason,
    TokenLogprob,
    ToolCall,
    ToolSpec,
    Usage,
)
from ringserve.core.render import WireEvent
from ringserve.core.signing import ReasoningSigner
from ringserve.core.view import MessageView
from ringserve.surfaces.base import (
    check_enforced,
    CallIds,
    SAMPLER_FIELDS,
    FieldTable,
    ParsedRequest,
    Refused,
    cancelled_fields,
    dumps,
    json_template,
    logprob_json,
    get_bool,
    get_int,
    get_str,
    sampling_params,
    require_object,
    stop_list,
    template_kwargs,
    text_content,
    arguments_json,
    function_spec,
    schema_format,
    openai_tool_choice,
    reasoning_effort,
    report_ignored,
    require_function,
    tool_list,
    tool_name,
)

MAX_TOKENS_LIMIT = 1_000_000
DONE = "[DONE]"

#: ErrorKind → (OpenAI error ``type``, ``code``).
ERROR_TYPES = {
    ErrorKind.INVALID_REQUEST: ("invalid_request_error", None),
    ErrorKind.AUTHENTICATION: ("invalid_request_error", "invalid_api_key"),
    ErrorKind.PERMISSION: ("invalid_request_error", "permission_denied"),
    ErrorKind.NOT_FOUND: ("invalid_request_error", "not_found"),
    ErrorKind.CONFLICT: ("invalid_request_error", "conflict"),
    ErrorKind.GONE: ("invalid_request_error", "expired"),
    ErrorKind.REQUEST_TOO_LARGE: ("invalid_request_error", "request_too_large"),
    ErrorKind.UNPROCESSABLE: ("invalid_request_error", "idempotency_key_reused"),
    ErrorKind.RATE_LIMIT: ("rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.API_ERROR: ("server_error", None),
    ErrorKind.OVERLOADED: ("server_error", "overloaded"),
    ErrorKind.UNAVAILABLE: ("server_error", "unavailable"),
}

#: HTTP status per kind where OpenAI differs from the kind's default (overload is 503).
STATUS = {ErrorKind.OVERLOADED: 503}

#: StopReason → OpenAI ``finish_reason``, each a value of the SDK's literal. A cancelled
#: generation stops where it was cut, with ``"ringserve_cancelled": true`` in the choice
#: (``surfaces/base.py`` ``CANCELLED_KEY``).
FINISH_REASONS = {
    StopReason.END: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.CONTEXT_FULL: "length",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.CANCELLED: "stop",
    StopReason.REFUSAL: "content_filter",
    StopReason.TOOL_USE: "tool_calls",
}

#: The keys of a reply's reasoning in a ``delta`` and a ``message``: llama-server's and
#: DeepSeek's ``reasoning_content`` (LiteLLM, the Vercel AI SDK, Dify read it), and
#: ``reasoning``, which vLLM (since vllm-project/vllm#27752) and OpenRouter send and their
#: clients read. Both carry the same text; neither is in the SDK's types, whose models keep them
#: as extra fields.
REASONING_KEYS = ("reasoning_content", "reasoning")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

_FUNCTIONS = "the deprecated functions API: send tools and tool_choice"

#: What ``parse_request`` does with each field of
#: ``openai.types.chat.CompletionCreateParams`` (openai 3.57), and with ringserve's
#: extensions; docs/compatibility.md's table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "messages", "max_completion_tokens", "max_tokens", "stop", "stream", "stream_options", "tools",
        "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort", "logprobs", "top_logprobs",
        # the samplers: OpenAI's, and the extensions llama.cpp's server accepts
        *SAMPLER_FIELDS,
        # an extension, as llama.cpp's server accepts it
        "chat_template_kwargs",
    }),
    ignored=frozenset({
        # bookkeeping, caching and routing that cannot change the text
        "metadata", "user", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention",
        # a latency hint: the answer stays the model's own
        "prediction",
        # a style hint to the model, a hosted tool it cannot call here, a check of OpenAI's own
        "verbosity", "web_search_options", "moderation",
    }),
    refused={
        "functions": Refused(_FUNCTIONS, neutral=([],)),
        "function_call": Refused(_FUNCTIONS, neutral=("none", "auto")),
        "n": Refused("one choice per request", neutral=(1,)),
        "audio": Refused("audio output is not implemented"),
        "modalities": Refused("only text output", neutral=(["text"],)),
    },
)

#: The fields of one message (system, developer, user and assistant messages; ``tool``
#: messages have :data:`TOOL_MESSAGE_FIELDS`, ``function`` messages are refused by role).
MESSAGE_FIELDS = FieldTable(
    # an assistant's reasoning_content / reasoning: its reasoning, sent back (:data:`REASONING_KEYS`)
    supported=frozenset({"role", "content", "tool_calls", *REASONING_KEYS}),
    ignored=frozenset({"name", "refusal"}),
    refused={
        "function_call": Refused(_FUNCTIONS),
        "audio": Refused("audio is not implemented"),
    },
)

#: The fields of a ``tool`` message (``ChatCompletionToolMessageParam``): the result of an
#: earlier assistant message's tool call.
TOOL_MESSAGE_FIELDS = FieldTable(
    supported=frozenset({"role", "content", "tool_call_id"}), ignored=frozenset(), refused={}
)

#: The fields of one call of an assistant message's ``tool_calls``
#: (``ChatCompletionMessageFunctionToolCallParam``; ``custom`` calls are refused by type).
TOOL_CALL_FIELDS = FieldTable(supported=frozenset({"id", "type", "function"}), ignored=frozenset(), refused={})

#: The fields of a call's ``function`` (``chat_completion_message_function_tool_call_param.Function``).
CALL_FUNCTION_FIELDS = FieldTable(supported=frozenset({"name", "arguments"}), ignored=frozenset(), refused={})

#: The fields of one tool (``ChatCompletionFunctionToolParam``; ``custom`` tools are refused by type).
TOOL_FIELDS = FieldTable(supported=frozenset({"type", "function"}), ignored=frozenset(), refused={})

#: The fields of a tool's ``function`` (``openai.types.shared_params.FunctionDefinition``).
FUNCTION_FIELDS = FieldTable(
    supported=frozenset({"name", "description", "parameters", "strict"}), ignored=frozenset(), refused={}
)

#: The fields of a named ``tool_choice``'s ``function`` (``ChatCompletionNamedToolChoiceParam``;
#: the choice itself has :data:`TOOL_FIELDS`).
NAMED_FUNCTION_FIELDS = FieldTable(supported=frozenset({"name"}), ignored=frozenset(), refused={})

#: The fields of ``response_format`` (``ResponseFormatText``, ``ResponseFormatJSONObject``,
#: ``ResponseFormatJSONSchema``) and of its ``json_schema`` (``response_format_json_schema.JSONSchema``).
RESPONSE_FORMAT_FIELDS = FieldTable(supported=frozenset({"type", "json_schema"}), ignored=frozenset(), refused={})
JSON_SCHEMA_FIELDS = FieldTable(
    supported=frozenset({"name", "schema", "strict"}),
    # documentation of the format for the model, which the grammar enforces anyway
    ignored=frozenset({"description"}),
    refused={},
)

#: The prefix of a tool call id on this surface (``call_`` + the neutral 24 hex digits).
TOOL_ID_PREFIX = "call_"

#: The fields of one text part of a message's content (``ChatCompletionContentPartTextParam``).
TEXT_PART_FIELDS = FieldTable(
    supported=frozenset({"type", "text"}),
    # a caching hint: the prefix cache is automatic
    ignored=frozenset({"prompt_cache_breakpoint"}),
    refused={},
)

#: The fields of ``stream_options`` (``ChatCompletionStreamOptionsParam``).
STREAM_OPTIONS_FIELDS = FieldTable(
    supported=frozenset({"include_usage"}),
    # a side-channel padding of OpenAI's chunks; ringserve sends none, which cannot change the text
    ignored=frozenset({"include_obfuscation"}),
    refused={},
)


def _error_object(kind: ErrorKind, message: str, param: str | None) -> dict[str, Any]:
    type_, code = ERROR_TYPES[kind]
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _usage(usage: Usage) -> dict[str, Any]:
    """OpenAI ``usage``: ``prompt_tokens`` counts the whole prompt, of which
    ``prompt_tokens_details.cached_tokens`` came from the prefix cache;
    ``completion_tokens_details.reasoning_tokens`` the completion tokens of the reasoning."""
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _logprobs_json(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
    """A choice's ``logprobs`` (``ChoiceLogprobs``): the tokens of its text (``content``), or null
    where it has none (a chunk without text, a request that did not ask)."""
    return {"content": [logprob_json(lp) for lp in logprobs], "refusal": None} if logprobs else None


def _reasoning_fields(text: str) -> dict[str, str]:
    return dict.fromkeys(REASONING_KEYS, text)


def tool_call_id(call_id: str) -> str:
    """A tool call's id on this surface: ``call_`` and the neutral 24 hex digits."""
    return TOOL_ID_PREFIX + call_id


class OpenAIRenderer:
    """Renders one completion's events as ``chat.completion.chunk`` data lines.

    Text deltas are ``delta.content``, reasoning deltas ``delta.reasoning_content`` and
    ``delta.reasoning`` (:data:`REASONING_KEYS`). A tool call's first chunk is
    ``delta.tool_calls: [{"index": k, "id": "call_...", "type": "function", "function": {"name":
    ..., "arguments": ""}}]``, its later chunks ``[{"index": k, "function": {"arguments":
    fragment}}]``, where ``k`` counts the message's tool calls from 0 (other blocks do not
    count), as OpenAI's streaming guide shows. A text delta that carries its tokens' log
    probabilities has them in the choice's ``logprobs.content``; every other chunk's
    ``logprobs`` is null.
    """

    def __init__(self, message_id: str, model: str, created: int, include_usage: bool) -> None:
        self._head = {"id": message_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage
        self._open = BlockKind.TEXT  # the kind of the block that deltas belong to
        self._calls = 0  # tool calls started so far; the open call's index is one less
        self._text_chunk = json_template(lambda text: self._chunk_object({"content": text}, None))
        self._reasoning_chunk = json_template(lambda text: self._chunk_object(_reasoning_fields(text), None))

    def _chunk_object(self, delta: dict[str, Any], finish_reason: str | None, cancelled: bool = False,
                      logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": _logprobs_json(logprobs), "finish_reason": finish_reason,
                  **cancelled_fields(cancelled)}
        chunk = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, cancelled: bool = False) -> WireEvent:
        return WireEvent(dumps(self._chunk_object(delta, finish_reason, cancelled)))

    def start(self, usage: Usage) -> list[WireEvent]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def block_start(self, start: BlockStart) -> list[WireEvent]:
        self._open = start.kind
        if start.kind is not BlockKind.TOOL_CALL:
            return []
        call = {"index": self._calls, "id": tool_call_id(start.call_id), "type": "function",
                "function": {"name": start.name, "arguments": ""}}
        self._calls += 1
        return [self._chunk({"tool_calls": [call]}, None)]

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        match self._open:
            case BlockKind.TEXT if delta.logprobs:
                return [WireEvent(dumps(self._chunk_object({"content": delta.text}, None, logprobs=delta.logprobs)))]
            case BlockKind.TEXT:
                return [WireEvent(self._text_chunk(delta.text))]
            case BlockKind.REASONING:
                return [WireEvent(self._reasoning_chunk(delta.text))]
            case BlockKind.TOOL_CALL:
                if not delta.text:
                    return []
                call = {"index": self._calls - 1, "function": {"arguments": delta.text}}
                return [self._chunk({"tool_calls": [call]}, None)]
            case _:
                assert_never(self._open)

    def block_stop(self, stop: BlockStop) -> list[WireEvent]:
        return []

    def finish(self, finish: Finish) -> list[WireEvent]:
        events = [self._chunk({}, FINISH_REASONS[finish.stop_reason], finish.stop_reason is StopReason.CANCELLED)]
        if self._include_usage:
            events.append(WireEvent(dumps({**self._head, "choices": [], "usage": _usage(finish.usage)})))
        events.append(WireEvent(DONE))
        return events

    def fail(self, failure: Failure) -> list[WireEvent]:
        return [WireEvent(dumps(_error_object(failure.kind, failure.message, None)))]

    def keepalive(self) -> list[WireEvent]:
        """None: every chunk is content, and no agent reads this surface; its readers' ``: ping``
        comments (``logs/reader.py``) keep the connection busy, and the OpenAI SDKs skip them."""
        return []


def _reasoning(m: dict[str, Any], where: str, role: str) -> str:
    """An assistant message's reasoning, sent back: ``reasoning_content``, else ``reasoning``
    (:data:`REASONING_KEYS`; a string or null); either on another role's message is reported
    and ignored (``surfaces/base.py`` ``report_ignored``).

    Raises:
        RingserveError: ``INVALID_REQUEST``: not a string.
    """
    for key in REASONING_KEYS:
        value = m.get(key)
        if value is None:
            continue
        if role != "assistant":
            report_ignored(f"{where}.{key}")
        elif not isinstance(value, str):
            raise invalid(f"{where}.{key}: must be a string", param="messages")
        else:
            return value
    return ""


def _message(m: Any, where: str, ids: CallIds) -> ChatMessage:
    """One message: its role, text content, an assistant's ``tool_calls`` and reasoning, a tool
    result's id."""
    if not isinstance(m, dict):
        raise invalid(f"{where}: must be an object", param="messages")
    wire_role = m.get("role")
    role = ROLES.get(wire_role) if isinstance(wire_role, str) else None
    if wire_role == "function":
        raise invalid(f"{where}.role: 'function' is not supported by ringserve ({_FUNCTIONS})", param="messages")
    if role is None:
        raise invalid(f"{where}.role: must be one of {', '.join(ROLES)}", param="messages")
    (TOOL_MESSAGE_FIELDS if role == "tool" else MESSAGE_FIELDS).check(m, where, param="messages")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    text = text_content(content, f"{where}.content", TEXT_PART_FIELDS)
    if role == "tool":
        return ChatMessage("tool", text, tool_call_id=ids.result(m.get("tool_call_id"), f"{where}.tool_call_id",
                                                                 "messages"))
    reasoning = _reasoning(m, where, role)
    calls = m.get("tool_calls")
    if calls is None or role != "assistant":
        if calls is not None:
            raise invalid(f"{where}.tool_calls: only assistant messages have tool calls", param="messages")
        return ChatMessage(role, text, reasoning=reasoning)
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls: must be a list", param="messages")
    return ChatMessage(role, text, tool_calls=tuple(_call(c, f"{where}.tool_calls[{j}]", ids)
                                                    for j, c in enumerate(calls)), reasoning=reasoning)


def _call(raw: Any, where: str, ids: CallIds) -> ToolCall:
    if isinstance(raw, dict) and raw.get("type") != "function":
        raise invalid(f"{where}.type: only function tool calls are supported, got {raw.get('type')!r:.80}",
                      param="messages")
    raw = TOOL_CALL_FIELDS.object(raw, where, "messages")
    function = CALL_FUNCTION_FIELDS.object(raw.get("function"), f"{where}.function", "messages")
    return ToolCall(
        call_id=ids.call(raw.get("id"), f"{where}.id", "messages"),
        name=tool_name(function.get("name"), f"{where}.function.name", "messages"),
        arguments=arguments_json(function.get("arguments"), f"{where}.function.arguments", "messages"),
    )


def _tool(raw: dict[str, Any], where: str) -> ToolSpec:
    require_function(raw, where, "tools", "tools")
    TOOL_FIELDS.check(raw, where, param="tools")
    where = f"{where}.function"
    return function_spec(FUNCTION_FIELDS.object(raw.get("function"), where, "tools"), where, "tools")


def _named_function(value: dict[str, Any]) -> str:
    """The name of a named ``tool_choice`` (``ChatCompletionNamedToolChoiceParam``)."""
    TOOL_FIELDS.check(value, "tool_choice", param="tool_choice")
    function = NAMED_FUNCTION_FIELDS.object(value.get("function"), "tool_choice.function", "tool_choice")
    return tool_name(function.get("name"), "tool_choice.function.name", "tool_choice")


def _response_format(value: Any) -> OutputFormat:
    if value is None:
        return OutputFormat()
    value = RESPONSE_FORMAT_FIELDS.object(value, "response_format", "response_format")
    kind = value.get("type")
    if kind == "text" or kind == "json_object":
        if value.get("json_schema") is not None:
            raise invalid(f"response_format.json_schema: not allowed with type {kind!r}", param="response_format")
        return OutputFormat(OutputKind(kind))
    if kind != "json_schema":
        raise invalid('response_format.type: must be "text", "json_object" or "json_schema"', param="response_format")
    spec = JSON_SCHEMA_FIELDS.object(value.get("json_schema"), "response_format.json_schema", "response_format")
    return schema_format(spec, "response_format.json_schema", "response_format")


def _logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs`` and ``top_logprobs`` (0..20): the alternatives per token, None when
    ``logprobs`` is not true.

    Raises:
        RingserveError: ``INVALID_REQUEST``: a ``top_logprobs`` out of range, or above 0 without
            ``logprobs: true`` (as OpenAI's API refuses it).
    """
    asked = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not asked:
        raise invalid("top_logprobs: needs logprobs: true", param="top_logprobs")
    return (top or 0) if asked else None


class OpenAISurface:
    """OpenAI Chat Completions: parsing, rendering and error shapes."""

    name = "openai"
    id_prefix = "chatcmpl-"
    prefer_respond_async = True
    refuses_lone_surrogates = False

    def restored(self, echo: str, signer: ReasoningSigner) -> OpenAISurface:
        """Itself: it keeps no state of its own (``echo`` is "") and signs no reasoning."""
        return self

    def edited(self, echo: str, applied: tuple[AppliedEdit, ...]) -> str:
        """``echo``: Chat Completions has no context edits to report."""
        return echo

    def parse_request(self, body: Any) -> ParsedRequest:
        """Validate a Chat Completions request body.

        Fields as :data:`REQUEST_FIELDS` lists them: ``model``, ``messages``
        (roles system/developer/user/assistant/tool; string or text-part content,
        parts checked against :data:`TEXT_PART_FIELDS`; an assistant's
        ``tool_calls``, each a function call with a new ``id`` and
        ``arguments`` JSON text of an object; a ``tool`` message's
        ``tool_call_id`` the id of an earlier call), ``tools`` (at most
        :data:`~ringserve.surfaces.base.MAX_TOOLS` function tools with
        distinct names; ``parameters`` an object schema, absent for none),
        ``tool_choice`` (``none``, ``auto``, ``required`` or a named function
        of ``tools``), ``parallel_tool_calls``, ``response_format``
        (``text``, ``json_object``, ``json_schema`` with ``name``, ``schema``,
        ``strict``; no schema: any JSON object),
        ``max_completion_tokens`` / ``max_tokens`` (1 to 1,000,000; absent or
        more than the context leaves: until the context is full; both given
        and different is a 400, as the SDK documents ``max_tokens`` as the
        deprecated spelling), the samplers (``temperature`` 0–2, ``top_p``, ``seed``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and llama.cpp's server's:
        ``surfaces/base.py`` :func:`~ringserve.surfaces.base.sampling_params`), ``logprobs`` and
        ``top_logprobs`` (:func:`_logprobs`), ``stop`` (a non-empty string or a list of them),
        ``stream``, ``stream_options`` (only with ``stream: true``, as the SDK documents;
        :data:`STREAM_OPTIONS_FIELDS`), ``reasoning_effort`` (the reasoning controls: ``none`` is
        thinking off); and, as llama.cpp's server does, ``chat_template_kwargs`` (variables of the
        model's chat template). Bookkeeping fields (``user``, ``metadata``, ``store``, ...) and
        unknown fields (the Node SDK's ``parsed``) are accepted and reported (``surfaces/base.py``
        ``report_ignored``); fields that a correct answer needs and ringserve cannot give
        (``functions``, custom tools, ``n`` > 1, image parts, ...) are refused.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming the offending field.
        """
        body = require_object(body)
        REQUEST_FIELDS.check(body)
        model = get_str(body, "model")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise invalid("messages: must be a non-empty list", param="messages")
        ids = CallIds()
        messages = [_message(m, f"messages[{i}]", ids) for i, m in enumerate(raw)]
        tools = tool_list(body.get("tools"), "tools", _tool)
        choice = openai_tool_choice(body.get("tool_choice"), tools, named=_named_function,
                                    parallel=get_bool(body, "parallel_tool_calls", True))
        max_tokens = get_int(body, "max_completion_tokens", lo=1, hi=MAX_TOKENS_LIMIT)
        legacy_max = get_int(body, "max_tokens", lo=1, hi=MAX_TOKENS_LIMIT)
        if max_tokens is not None and legacy_max is not None and max_tokens != legacy_max:
            raise invalid(
                f"max_tokens ({legacy_max}) and max_completion_tokens ({max_tokens}) differ: send only"
                " max_completion_tokens (max_tokens is deprecated in its favour)",
                param="max_tokens",
            )
        if max_tokens is None:
            max_tokens = legacy_max
        sampling = sampling_params(body, max_temperature=2.0)
        logprobs = _logprobs(body)
        stream = get_bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise invalid("stream_options: must be an object", param="stream_options")
        if options is not None and not stream:
            raise invalid("stream_options: only allowed when stream is true", param="stream_options")
        STREAM_OPTIONS_FIELDS.check(options or {}, "stream_options", param="stream_options")
        include_usage = get_bool(options or {}, "include_usage")
        request = GenerationRequest(
            messages=tuple(messages),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop_list(body.get("stop"), "stop", allow_string=True),
            tools=tools,
            tool_choice=choice,
            output=_response_format(body.get("response_format")),
            reasoning=reasoning_effort(body.get("reasoning_effort"), "reasoning_effort"),
            template_kwargs=template_kwargs(body),
            logprobs=logprobs,
        )
        check_enforced(request, "tools[{i}].function.parameters", "response_format.json_schema.schema")
        return ParsedRequest(request=request, stream=stream, model=model, include_usage=include_usage)

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> OpenAIRenderer:
        return OpenAIRenderer(message_id, model, created, include_usage)

    def message_json(self, view: MessageView) -> dict[str, Any]:
        """The non-stream ``chat.completion`` object."""
        return {
            "id": view.id,
            "object": "chat.completion",
            "created": view.created,
            "model": view.model,
            "choices": [
                {
                    "index": 0,
                    "message": self.content_json(view.content),
                    "logprobs": _logprobs_json(tuple(lp for b in view.content if b.kind is BlockKind.TEXT
                                                     for lp in b.logprobs)),
                    "finish_reason": None if view.stop_reason is None else FINISH_REASONS[view.stop_reason],
                    **cancelled_fields(view.cancelled),
                }
            ],
            "usage": _usage(view.usage),
        }

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> dict[str, Any]:
        """The assistant ``message`` of a ``chat.completion`` choice: ``content`` the text blocks
        joined (``null`` when the message is only tool calls), ``tool_calls`` with ``arguments``
        as JSON text, when there are any, and the reasoning blocks joined as
        ``reasoning_content`` and ``reasoning`` (:data:`REASONING_KEYS`), when there are any:
        what the stream's deltas add up to."""
        texts, calls, thoughts = [], [], []
        for b in blocks:
            match b.kind:
                case BlockKind.TEXT:
                    texts.append(b.text)
                case BlockKind.TOOL_CALL:
                    calls.append({"id": tool_call_id(b.call_id), "type": "function",
                                  "function": {"name": b.name, "arguments": b.text}})
                case BlockKind.REASONING:
                    thoughts.append(b.text)
                case _:
                    assert_never(b.kind)
        text = "".join(texts)
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message |= _reasoning_fields("".join(thoughts))
        return message

    def stop_reason(self, reason: StopReason) -> str:
        return FINISH_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return STATUS.get(error.kind, error.status)

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _error_object(error.kind, error.message, error.param)
