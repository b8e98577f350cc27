"""Anthropic Messages API surface (``POST /v1/messages``).

Request and event shapes follow Anthropic's "Messages" and "Streaming
Messages" documentation: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``)..., ``content_block_stop``,
``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``),
``message_stop``; errors are ``{"type": "error", "error": {"type", "message"}}``
both as HTTP bodies and as the in-band ``event: error``.
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

#: ErrorKind → Anthropic error ``type`` (docs: "Errors").
ERROR_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.CONFLICT: "invalid_request_error",
    ErrorKind.GONE: "not_found_error",
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
}


_TOOLS = "tool use is not implemented yet, issue 14"

#: What ``parse_request`` does with each field of ``anthropic.types.MessageCreateParams``
#: and ``anthropic.types.beta.MessageCreateParams`` (anthropic 2.14; the beta one is
#: what ``client.beta.messages.create`` and pydantic-ai send), and with ringserve's
#: extensions; the README's compatibility table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
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
        "tools": Refused(_TOOLS, neutral=([],)),
        "tool_choice": Refused(_TOOLS, neutral=({"type": "none"}, {"type": "auto"})),
        "thinking": Refused("extended thinking is not implemented", neutral=({"type": "disabled"},)),
        "output_config": Refused("output formats and effort are not implemented", neutral=({},)),
        # beta
        "output_format": Refused("structured output is not implemented"),
        "mcp_servers": Refused(_TOOLS, neutral=([],)),
        "context_management": Refused("context management is not implemented"),
        "compaction": Refused("compaction is not implemented"),
        "thread": Refused("server-held threads are not implemented; send the whole conversation"),
    },
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


def _text_only(kind: BlockKind) -> None:
    """Text is the only block kind the surface renders until tool use lands (issue 14)."""
    if kind is not BlockKind.TEXT:
        raise NotImplementedError(f"Anthropic rendering of {kind.value} blocks")


def _block_json(block: ContentBlock) -> dict[str, Any]:
    """One block of a non-stream ``Message``'s ``content``."""
    _text_only(block.kind)
    return {"type": "text", "text": block.text}


class AnthropicRenderer:
    """Renders one message's events in Anthropic's streaming order (see module doc)."""

    def __init__(self, message_id: str, model: str) -> None:
        self._message_id = message_id
        self._model = model

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
        _text_only(start.kind)
        block = {"type": "content_block_start", "index": start.index, "content_block": {"type": "text", "text": ""}}
        return [WireEvent(dumps(block), "content_block_start")]

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        data = {"type": "content_block_delta", "index": delta.index, "delta": {"type": "text_delta", "text": delta.text}}
        return [WireEvent(dumps(data), "content_block_delta")]

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


class AnthropicSurface:
    """Anthropic Messages: parsing, rendering and error shapes."""

    name = "anthropic"
    id_prefix = "msg_"

    def parse_request(self, body: Any) -> ParsedRequest:
        """Validate a Messages request body.

        Fields as :data:`REQUEST_FIELDS` lists them: ``model``,
        ``max_tokens`` (required, 1 to 1,000,000; more than the context leaves
        is served until the context is full), ``messages`` (user, assistant
        and system turns; string content or a non-empty list of text blocks,
        checked against :data:`TEXT_BLOCK_FIELDS`), ``system`` (string or text
        blocks), ``temperature`` (0–1), ``top_p``, ``top_k``,
        ``stop_sequences`` (a list of non-empty strings), ``stream``; and, as llama.cpp's server does,
        ``min_p`` and ``seed``. Bookkeeping fields (``metadata``, ...) are
        accepted and ignored; fields that would change the answer and are
        not implemented (``tools``, ``thinking``, image or document blocks,
        ...) and unknown fields are refused. Headers such as
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
        messages: list[ChatMessage] = []
        if "system" in body and body["system"] is not None:
            messages.append(ChatMessage("system", text_content(body["system"], "system", TEXT_BLOCK_FIELDS)))
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise invalid("messages: must be a non-empty list", param="messages")
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise invalid(f"messages[{i}]: must be an object", param="messages")
            MESSAGE_FIELDS.check(m, f"messages[{i}]", param="messages")
            role = m.get("role")
            if role not in ROLES:
                raise invalid(f"messages[{i}].role: must be one of {', '.join(ROLES)}", param="messages")
            messages.append(ChatMessage(role, text_content(
                m.get("content"), f"messages[{i}].content", TEXT_BLOCK_FIELDS, allow_empty=False)))
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise invalid("metadata: must be an object", param="metadata")
        sampling = sampling_params(body, max_temperature=1.0)
        request = GenerationRequest(
            messages=tuple(messages),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop_list(body.get("stop_sequences"), "stop_sequences", allow_string=False),
        )
        return ParsedRequest(request=request, stream=get_bool(body, "stream"), model=model)

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> AnthropicRenderer:
        return AnthropicRenderer(message_id, model)

    def message_json(self, result: MessageResult) -> dict[str, Any]:
        """The non-stream ``Message`` object."""
        return {
            "id": result.message_id,
            "type": "message",
            "role": "assistant",
            "content": self.content_json(result.content),
            "model": result.model,
            "stop_reason": None if result.stop_reason is None else STOP_REASONS[result.stop_reason],
            "stop_sequence": result.stop_sequence,
            **cancelled_fields(result.cancelled),
            "usage": _usage(result.usage),
        }

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> list[dict[str, Any]]:
        """The ``content`` list of a ``Message``."""
        return [_block_json(b) for b in blocks]

    def stop_reason(self, reason: StopReason) -> str:
        return STOP_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return error.status

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _error_object(ERROR_TYPES[error.kind], error.message)
