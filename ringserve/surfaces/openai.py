"""OpenAI Chat Completions surface (``POST /v1/chat/completions``).

Shapes follow OpenAI's "Chat Completions" API reference and its "Streaming"
guide: ``chat.completion.chunk`` objects, a usage chunk with empty
``choices`` only when ``stream_options.include_usage`` is set, and a final
``data: [DONE]``. A mid-stream error is ``data: {"error": {...}}`` with no
``[DONE]`` after it (the official SDK raises on it). HTTP errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

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
from ringserve.surfaces.base import (
    FieldTable,
    MessageResult,
    ParsedRequest,
    Refused,
    WireEvent,
    cancelled_fields,
    dumps,
    get_bool,
    get_int,
    get_str,
    sampling_params,
    require_object,
    stop_list,
    text_content,
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
}

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_TOOLS = "tool use is not implemented yet, issue 14"
_ZERO = (0, 0.0)

#: What ``parse_request`` does with each field of
#: ``openai.types.chat.CompletionCreateParams`` (openai 3.57), and with ringserve's
#: extensions; the README's compatibility table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "stop", "seed",
        "stream", "stream_options",
        # extensions, as llama.cpp's server accepts them
        "top_k", "min_p",
    }),
    ignored=frozenset({
        # bookkeeping, caching and routing that cannot change the text
        "metadata", "user", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention",
        # a latency hint: the answer stays the model's own
        "prediction",
        # meaningful only with tools, which are refused
        "parallel_tool_calls",
    }),
    refused={
        "tools": Refused(_TOOLS, neutral=([],)),
        "tool_choice": Refused(_TOOLS, neutral=("none", "auto")),
        "functions": Refused(_TOOLS, neutral=([],)),
        "function_call": Refused(_TOOLS, neutral=("none", "auto")),
        "response_format": Refused("structured output is not implemented", neutral=({"type": "text"},)),
        "logprobs": Refused("log probabilities are not implemented", neutral=(False,)),
        "top_logprobs": Refused("log probabilities are not implemented", neutral=(0,)),
        "n": Refused("one choice per request", neutral=(1,)),
        "frequency_penalty": Refused("penalties are not implemented", neutral=_ZERO),
        "presence_penalty": Refused("penalties are not implemented", neutral=_ZERO),
        "logit_bias": Refused("logit bias is not implemented", neutral=({},)),
        "audio": Refused("audio output is not implemented"),
        "modalities": Refused("only text output", neutral=(["text"],)),
        "reasoning_effort": Refused("the model does not reason", neutral=("none",)),
        "verbosity": Refused("verbosity is not implemented"),
        "web_search_options": Refused("web search is not implemented"),
        "moderation": Refused("moderation models are not implemented; see [safety] in the README"),
    },
)

#: The fields of one message (system, developer, user and assistant messages; ``tool``
#: and ``function`` messages are refused by role).
MESSAGE_FIELDS = FieldTable(
    supported=frozenset({"role", "content"}),
    ignored=frozenset({"name", "refusal"}),
    refused={
        "tool_calls": Refused(_TOOLS, neutral=([],)),
        "function_call": Refused(_TOOLS),
        "audio": Refused("audio is not implemented"),
    },
)

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
    ``prompt_tokens_details.cached_tokens`` came from the prefix cache."""
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _text_only(kind: BlockKind) -> None:
    """Text is the only block kind the surface renders until tool use lands (issue 14)."""
    if kind is not BlockKind.TEXT:
        raise NotImplementedError(f"OpenAI rendering of {kind.value} blocks")


class OpenAIRenderer:
    """Renders one completion's events as ``chat.completion.chunk`` data lines."""

    def __init__(self, message_id: str, model: str, created: int, include_usage: bool) -> None:
        self._head = {"id": message_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, cancelled: bool = False) -> WireEvent:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                  **cancelled_fields(cancelled)}
        chunk = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return WireEvent(dumps(chunk))

    def start(self, usage: Usage) -> list[WireEvent]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def block_start(self, start: BlockStart) -> list[WireEvent]:
        _text_only(start.kind)
        return []

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        return [self._chunk({"content": delta.text}, None)]

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


class OpenAISurface:
    """OpenAI Chat Completions: parsing, rendering and error shapes."""

    name = "openai"
    id_prefix = "chatcmpl-"

    def parse_request(self, body: Any) -> ParsedRequest:
        """Validate a Chat Completions request body.

        Fields as :data:`REQUEST_FIELDS` lists them: ``model``, ``messages``
        (roles system/developer/user/assistant; string or text-part content,
        parts checked against :data:`TEXT_PART_FIELDS`),
        ``max_completion_tokens`` / ``max_tokens`` (1 to 1,000,000; absent or
        more than the context leaves: until the context is full; both given
        and different is a 400, as the SDK documents ``max_tokens`` as the
        deprecated spelling), ``temperature`` (0–2), ``top_p``, ``stop``
        (a non-empty string or a list of them), ``seed``, ``stream``,
        ``stream_options`` (only with ``stream: true``, as the SDK documents;
        :data:`STREAM_OPTIONS_FIELDS`); and, as llama.cpp's
        server does, ``top_k`` and ``min_p``. Bookkeeping fields (``user``,
        ``metadata``, ``store``, ...) are accepted and ignored; fields that
        would change the answer and are not implemented (``tools``,
        ``response_format``, ``logprobs``, ``n`` > 1, image parts, ...) and
        unknown fields are refused.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming the offending field.
        """
        body = require_object(body)
        REQUEST_FIELDS.check(body)
        model = get_str(body, "model")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise invalid("messages: must be a non-empty list", param="messages")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise invalid(f"messages[{i}]: must be an object", param="messages")
            wire_role = m.get("role")
            if wire_role in ("tool", "function"):
                raise invalid(f"messages[{i}].role: {wire_role!r} is not supported by ringserve ({_TOOLS})",
                              param="messages")
            MESSAGE_FIELDS.check(m, f"messages[{i}]", param="messages")
            role = ROLES.get(wire_role) if isinstance(wire_role, str) else None
            if role is None:
                raise invalid(f"messages[{i}].role: must be one of {', '.join(ROLES)}", param="messages")
            content = m.get("content")
            if content is None and role == "assistant":
                content = ""
            messages.append(ChatMessage(role, text_content(content, f"messages[{i}].content", TEXT_PART_FIELDS)))
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
        )
        return ParsedRequest(request=request, stream=stream, model=model, include_usage=include_usage)

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> OpenAIRenderer:
        return OpenAIRenderer(message_id, model, created, include_usage)

    def message_json(self, result: MessageResult) -> dict[str, Any]:
        """The non-stream ``chat.completion`` object."""
        return {
            "id": result.message_id,
            "object": "chat.completion",
            "created": result.created,
            "model": result.model,
            "choices": [
                {
                    "index": 0,
                    "message": self.content_json(result.content),
                    "logprobs": None,
                    "finish_reason": None if result.stop_reason is None else FINISH_REASONS[result.stop_reason],
                    **cancelled_fields(result.cancelled),
                }
            ],
            "usage": _usage(result.usage),
        }

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> dict[str, Any]:
        """The assistant ``message`` of a ``chat.completion`` choice."""
        for b in blocks:
            _text_only(b.kind)
        return {"role": "assistant", "content": "".join(b.text for b in blocks), "refusal": None}

    def stop_reason(self, reason: StopReason) -> str:
        return FINISH_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return STATUS.get(error.kind, error.status)

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _error_object(error.kind, error.message, error.param)
