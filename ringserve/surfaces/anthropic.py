"""Anthropic Messages API surface (``POST /v1/messages``).

Request and event shapes follow Anthropic's "Messages" and "Streaming
Messages" documentation: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``; ``input_json_delta`` in a ``tool_use`` block;
``thinking_delta``, then one ``signature_delta``, in a ``thinking`` block)...,
``content_block_stop`` for each block, then
``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``),
``message_stop``; errors are ``{"type": "error", "error": {"type", "message"}}``
both as HTTP bodies and as the in-band ``event: error``. A silence gets ``event: ping``
(``{"type": "ping"}``), which every SDK skips.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, assert_never

import attrs

from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import (
    AppliedEdit,
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    ClearThinking,
    ClearToolUses,
    ContentBlock,
    ContextEdit,
    Effort,
    Failure,
    Finish,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    ReasoningConfig,
    StopReason,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    Trigger,
    Usage,
)
from ringserve.core.render import WireEvent
from ringserve.core.signing import ReasoningSigner
from ringserve.core.view import MessageView
from ringserve.surfaces.base import (
    check_enforced,
    SAMPLER_FIELDS,
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
    report_ignored,
    signed_reasoning,
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
#: and ``anthropic.types.beta.MessageCreateParams`` (anthropic 2.16; the beta one is
#: what ``client.beta.messages.create``, pydantic-ai and Claude Code send), and with ringserve's
#: extensions; docs/compatibility.md's table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "tools", "tool_choice",
        "output_config", "output_format", "thinking", "context_management",
        # the samplers: Anthropic's (temperature, top_p, top_k), and the extensions llama.cpp's server accepts
        *SAMPLER_FIELDS,
    }),
    ignored=frozenset({
        # request bookkeeping and routing that cannot change the text
        "metadata", "service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id",
        "cache_control", "diagnostics", "container",
        # beta: billing, and retries on other models after a refusal (there is one model)
        "billing_policy", "fallback_credit_token", "fallbacks",
    }),
    refused={
        # beta
        "mcp_servers": Refused("MCP servers would have to be called by the server", neutral=([],)),
        "compaction": Refused("a compaction request asks for a summary of the conversation, which is not implemented"),
        "thread": Refused("server-held threads are not implemented; send the whole conversation"),
    },
)

#: The fields of ``POST /v1/messages/count_tokens`` (``anthropic.types.MessageCountTokensParams``):
#: every field of a request (Claude Code counts with the bodies it sends), those that shape the
#: prompt read as there, the others accepted and reported.
_PROMPT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "output_config", "output_format",
                            "thinking", "context_management"})
COUNT_TOKENS_FIELDS = FieldTable(
    supported=_PROMPT_FIELDS,
    # what only a generation reads; compaction, which count_tokens ignores (the SDK's docstring says so)
    ignored=(REQUEST_FIELDS.supported - _PROMPT_FIELDS) | REQUEST_FIELDS.ignored | {"compaction"},
    refused={"mcp_servers": REQUEST_FIELDS.refused["mcp_servers"], "thread": REQUEST_FIELDS.refused["thread"]},
)

#: The fields of one message (``MessageParam``: user, assistant and system messages; a
#: mid-conversation system message's ``output_config``, Claude Code's per-turn effort).
MESSAGE_FIELDS = FieldTable(supported=frozenset({"role", "content", "output_config"}), ignored=frozenset(), refused={})

#: The fields of one text block of a message's or the system prompt's content (``TextBlockParam``).
TEXT_BLOCK_FIELDS = FieldTable(
    supported=frozenset({"type", "text"}),
    # a caching hint: the prefix cache is automatic
    ignored=frozenset({"cache_control"}),
    refused={"citations": Refused("citations are not implemented", neutral=([],))},
)

#: The fields of an assistant message's ``thinking`` block (``ThinkingBlockParam``) and of a
#: ``redacted_thinking`` block (``RedactedThinkingBlockParam``: opaque, never ringserve's, dropped).
THINKING_BLOCK_FIELDS = FieldTable(
    supported=frozenset({"type", "thinking", "signature"}), ignored=frozenset({"cache_control"}), refused={}
)
REDACTED_THINKING_FIELDS = FieldTable(
    supported=frozenset({"type", "data"}), ignored=frozenset({"cache_control"}), refused={}
)

#: The fields of ``thinking`` (``ThinkingConfigParam``: enabled, adaptive, disabled; beta
#: between_tools): thinking on or off, its budget, and how the reply shows it (``display``:
#: :data:`DISPLAYS`).
THINKING_FIELDS = FieldTable(
    supported=frozenset({"type", "budget_tokens", "display"}), ignored=frozenset({"block_binding"}), refused={}
)

#: ``thinking.display`` → whether the reply's thinking blocks are sent without their text
#: (``omitted``: a sealed signature carries it, :class:`ThinkingDisplay`). No model here summarises
#: its thinking, so the shown ones all show it whole: ``summarized``, and the two Claude Code
#: 2.1.332 asks for beside it (``highlights``, and ``updates`` under its
#: ``thinking_display_updates`` beta, the one it sends with ``--output-format stream-json``; the
#: values it knows are ``["summarized","omitted","highlights"]`` in its binary).
DISPLAYS = {"summarized": False, "highlights": False, "updates": False, "omitted": True}

#: ``thinking.type`` → whether thinking is on (``adaptive`` and ``between_tools``: the model decides).
THINKING_TYPES = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}

#: ``output_config.effort`` values (``OutputConfigParam``).
EFFORTS = ("low", "medium", "high", "xhigh", "max")

#: The fields of ``context_management`` (``BetaContextManagementConfigParam``) and of its edits
#: (``BetaClearThinking20251015EditParam``, ``BetaClearToolUses20250919EditParam``); the
#: compaction edit (``compact_20260112``) is refused by type: it would summarise.
CONTEXT_MANAGEMENT_FIELDS = FieldTable(supported=frozenset({"edits"}), ignored=frozenset(), refused={})
CLEAR_THINKING_FIELDS = FieldTable(supported=frozenset({"type", "keep"}), ignored=frozenset(), refused={})
CLEAR_TOOL_USES_FIELDS = FieldTable(
    supported=frozenset({"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}),
    ignored=frozenset(),
    refused={},
)
#: The fields of a ``{"type": ..., "value": N}`` threshold (``BetaInputTokensTriggerParam``, ...).
THRESHOLD_FIELDS = FieldTable(supported=frozenset({"type", "value"}), ignored=frozenset(), refused={})

_TOOLSETS = Refused("toolsets are not implemented")

#: The fields of one custom tool (``ToolParam``, ``BetaToolParam``). The other tool types
#: (Anthropic's server and client tools: ``bash_20250124``, ``web_search_20250305``, ...) are
#: refused by their ``type``. A tool with ``defer_loading`` stays out of the prompt until a
#: ``tool_reference`` block in a tool result names it (tool search).
TOOL_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "description", "input_schema", "strict", "defer_loading"}),
    ignored=frozenset({
        "cache_control",  # a caching hint: the prefix cache is automatic
        "eager_input_streaming",  # arguments are always streamed as they are decoded
        "input_examples",  # examples for the model: the schema says what it may send
    }),
    refused={
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

#: The fields of a ``tool_reference`` block in a tool result's content (``ToolReferenceBlockParam``).
TOOL_REFERENCE_FIELDS = FieldTable(
    supported=frozenset({"type", "tool_name"}), ignored=frozenset({"cache_control"}), refused={}
)

#: The fields of ``output_config`` (``OutputConfigParam``, ``BetaOutputConfigParam``).
OUTPUT_CONFIG_FIELDS = FieldTable(
    supported=frozenset({"format", "effort"}),
    # a budget the client tracks over several requests: each answer stays the model's own
    ignored=frozenset({"task_budget"}),
    refused={},
)

#: The fields of a message's ``output_config`` (Claude Code's per-turn effort, on its
#: mid-conversation system message; beta ``per-turn-control``).
TURN_OUTPUT_CONFIG_FIELDS = FieldTable(supported=frozenset({"effort"}), ignored=frozenset(), refused={})

#: The fields of ``output_config.format`` (``JSONOutputFormatParam``), what ``messages.parse(output_format=...)``
#: sends (anthropic 2.14, beta or not: ``{"type": "json_schema", "schema": ...}``), and of the
#: deprecated top-level ``output_format``, read the same way.
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

#: The data of a ``ping`` event (:meth:`AnthropicRenderer.keepalive`).
_PING = dumps({"type": "ping"})

ROLES = ("user", "assistant", "system")


def _error_object(kind_name: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind_name, "message": message}}


def _usage(usage: Usage) -> dict[str, Any]:
    """Anthropic ``usage``: ``input_tokens`` is the uncached part of the prompt and
    ``cache_read_input_tokens`` the part read from the prefix cache (their sum is the prompt);
    ``output_tokens_details.thinking_tokens`` the output tokens of the thinking blocks, their
    closing marker included (``OutputTokensDetails``, as Anthropic counts them)."""
    return {
        "input_tokens": usage.input_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"thinking_tokens": usage.reasoning_tokens},
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


@attrs.frozen
class ThinkingDisplay:
    """How a message's thinking blocks are shown: their text, and a signature of ringserve's
    (``core/signing.py``) that lets the block come back in a later request's history; with
    ``omitted`` (the request's ``thinking.display: "omitted"``) the text is withheld and the
    signature is sealed: it carries the text, which the block restores when it comes back.
    ``signer`` is None for a surface not :meth:`~AnthropicSurface.restored` (the registry's):
    it renders no thinking block."""

    signer: ReasoningSigner | None
    omitted: bool = False

    def signature(self, text: str) -> str:
        """The signature of a thinking block whose text is ``text``.

        Raises:
            RuntimeError: no signer (a surface not restored renders no reasoning).
        """
        if self.signer is None:
            raise RuntimeError("a message's surface is restored(echo, signer) before it renders its thinking")
        return self.signer.seal(text) if self.omitted else self.signer.sign(text)

    def block(self, text: str) -> dict[str, Any]:
        """A whole thinking block (``ThinkingBlock``)."""
        return {"type": "thinking", "thinking": "" if self.omitted else text, "signature": self.signature(text)}


#: A thinking block's ``content_block_start``: its text and its signature follow as deltas.
_THINKING_START = {"type": "thinking", "thinking": "", "signature": ""}

#: The delta type and key of the text of a text and of a thinking block.
_TEXT_DELTAS = {BlockKind.TEXT: ("text_delta", "text"), BlockKind.REASONING: ("thinking_delta", "thinking")}


def _block_json(block: ContentBlock, thinking: ThinkingDisplay) -> dict[str, Any]:
    """One block of a non-stream ``Message``'s ``content`` (``TextBlock``, ``ToolUseBlock``,
    ``ThinkingBlock``)."""
    match block.kind:
        case BlockKind.TEXT:
            return {"type": "text", "text": block.text}
        case BlockKind.TOOL_CALL:
            return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                    "input": _input(block.text)}
        case BlockKind.REASONING:
            return thinking.block(block.text)
        case _:
            assert_never(block.kind)


class AnthropicRenderer:
    """Renders one message's events in Anthropic's streaming order (see module doc).

    Each block is ``content_block_start`` (``{"type": "text", "text": ""}``, ``{"type":
    "tool_use", "id": "toolu_...", "name": ..., "input": {}}`` or ``{"type": "thinking",
    "thinking": "", "signature": ""}``), its deltas (``text_delta``; ``input_json_delta`` with
    the arguments' next ``partial_json`` fragment; ``thinking_delta``, then one
    ``signature_delta`` with the block's signature, :class:`ThinkingDisplay`) and
    ``content_block_stop``, with the index the block has in the message (blocks of every kind
    are numbered together). A thinking block whose text is ``omitted`` has no
    ``thinking_delta``: its sealed signature carries the text.
    """

    def __init__(self, message_id: str, model: str, thinking: ThinkingDisplay,
                 edits: dict[str, Any] | None = None) -> None:
        self._message_id = message_id
        self._model = model
        self._thinking = thinking
        self._edits = context_management_fields(edits)
        self._open = BlockKind.TEXT  # the kind of the block that deltas belong to
        self._text_delta: tuple[int, Callable[[str], str]] | None = None  # the open block's delta template
        self._thought: list[str] = []  # the text of the open thinking block, which its signature signs

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
        self._thought = []
        # an empty block: "text": "", "input": {} (the arguments follow as input_json_delta), or
        # "thinking": "" and "signature": "" (both follow as deltas)
        block = _THINKING_START if start.kind is BlockKind.REASONING else _block_json(
            ContentBlock(start.kind, name=start.name, call_id=start.call_id), self._thinking)
        data = {"type": "content_block_start", "index": start.index, "content_block": block}
        return [WireEvent(dumps(data), "content_block_start")]

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        if self._open is BlockKind.TOOL_CALL:
            body = {"type": "input_json_delta", "partial_json": delta.text}
            data = {"type": "content_block_delta", "index": delta.index, "delta": body}
            return [WireEvent(dumps(data), "content_block_delta")]
        if self._open is BlockKind.REASONING:
            self._thought.append(delta.text)
            if self._thinking.omitted:
                return []
        if self._text_delta is None or self._text_delta[0] != delta.index:
            index, (kind, key) = delta.index, _TEXT_DELTAS[self._open]
            self._text_delta = index, json_template(lambda text: {
                "type": "content_block_delta", "index": index, "delta": {"type": kind, key: text}})
        return [WireEvent(self._text_delta[1](delta.text), "content_block_delta")]

    def block_stop(self, stop: BlockStop) -> list[WireEvent]:
        stopped = WireEvent(dumps({"type": "content_block_stop", "index": stop.index}), "content_block_stop")
        if self._open is not BlockKind.REASONING:
            return [stopped]
        signature = {"type": "signature_delta", "signature": self._thinking.signature("".join(self._thought))}
        return [WireEvent(dumps({"type": "content_block_delta", "index": stop.index, "delta": signature}),
                          "content_block_delta"), stopped]

    def finish(self, finish: Finish) -> list[WireEvent]:
        delta = {
            "stop_reason": STOP_REASONS[finish.stop_reason],
            "stop_sequence": finish.stop_sequence,
            **cancelled_fields(finish.stop_reason is StopReason.CANCELLED),
        }
        data = {"type": "message_delta", "delta": delta, "usage": _usage(finish.usage), **self._edits}
        return [
            WireEvent(dumps(data), "message_delta"),
            WireEvent(dumps({"type": "message_stop"}), "message_stop"),
        ]

    def fail(self, failure: Failure) -> list[WireEvent]:
        return [WireEvent(dumps(_error_object(ERROR_TYPES[failure.kind], failure.message)), "error")]

    def keepalive(self) -> list[WireEvent]:
        """``event: ping`` (data ``{"type": "ping"}``), which Anthropic's streaming docs list and
        every SDK skips (https://docs.claude.com/en/docs/build-with-claude/streaming, "Ping
        events"); its bytes reset Claude Code's idle timer (docs/agents.md)."""
        return [WireEvent(_PING, "ping")]


#: Claude Code's first system block: ``x-anthropic-billing-header: cc_version=2.1.332.21e;
#: cc_entrypoint=sdk-cli;`` (a version stamp for Anthropic's billing, different across versions
#: and sessions). It means nothing to a model and, at the head of the prompt, would make every
#: session's prompt differ from its first token: it is dropped and reported.
BILLING_STAMP = re.compile(r"x-anthropic-billing-header: [^\n]*")


@attrs.define
class _Conversation:
    """What :func:`conversation` gathers while it reads the messages."""

    messages: list[ChatMessage] = attrs.Factory(list)
    ids: CallIds = attrs.Factory(CallIds)
    referenced: list[tuple[str, str]] = attrs.Factory(list)  # (tool name, where) of tool_reference blocks
    effort: Effort | None = None  # of the last message that has one


def conversation(body: dict[str, Any]) -> GenerationRequest:
    """The prompt part of a request body: ``system``, ``messages``, ``tools``, ``tool_choice``,
    ``output_config``, ``thinking`` and ``context_management``, as a request with no
    ``max_tokens``; the thinking blocks handed back join their turns' reasoning where their
    signatures verify (``surfaces/base.py`` ``signed_reasoning``).

    * ``system``: a string or text blocks; Claude Code's billing stamp (:data:`BILLING_STAMP`)
      is dropped.
    * ``messages``: a ``system`` message stays where it stands (the chat template folds it in);
      its ``output_config.effort`` (Claude Code's per-turn effort) overrides the request's. One
      with no text is a control message: its controls apply and it renders nothing (Claude
      Code under ``--bare`` sends ``{"role": "system", "content": [], "output_config":
      {"effort": ...}}``); ``content: []`` with no ``output_config`` field is a 400, as
      ``BetaSystemMessageParam`` documents. ``content: []`` is a 400 on a ``user`` or
      ``assistant`` turn too, but for a last ``assistant`` turn, which the Messages API lets be
      empty.
    * ``tools``: at most :data:`~ringserve.surfaces.base.MAX_TOOLS` custom tools
      (:data:`TOOL_FIELDS`) with distinct names and an object ``input_schema``; a tool with
      ``defer_loading`` joins the prompt only once a ``tool_reference`` block names it.
    * ``tool_choice``: ``auto``, ``any``, ``{"type": "tool", "name": ...}`` (a tool of
      ``tools``) or ``none``; ``disable_parallel_tool_use``.
    * An assistant turn's ``tool_use`` blocks (``id``, ``name``, ``input`` an object) become its
      tool calls, after its text; its ``thinking`` blocks its reasoning (if signed here), its
      ``redacted_thinking`` blocks are dropped; a user turn's ``tool_result`` blocks
      (``tool_use_id`` of an earlier ``tool_use``, ``content`` a string or text and
      ``tool_reference`` blocks, ``is_error``) become ``tool`` turns, in block order with the
      user's text between them. Either needs ``tools``, as the Messages API requires.
    * ``output_config.format`` (or the deprecated ``output_format``): ``{"type": "json_schema",
      "schema": {...}}``.
    * ``thinking`` and ``output_config.effort``: the reasoning controls (:func:`_reasoning`).
    * ``context_management.edits``: history to trim (:func:`_context_edits`).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the offending field.
    """
    seen = _Conversation()
    if body.get("system") is not None:
        seen.messages.append(ChatMessage("system", _system(body["system"])))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: must be a non-empty list", param="messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where}: must be an object", param="messages")
        MESSAGE_FIELDS.check(m, where, param="messages")
        if m.get("output_config") is not None:
            seen.effort = _effort(m["output_config"], f"{where}.output_config", TURN_OUTPUT_CONFIG_FIELDS) or seen.effort
        _turns(m, where, seen, last=i == len(raw) - 1)
    every = tool_list(body.get("tools"), "tools", _tool)
    deferred = _deferred(body.get("tools"))
    names = {t.name for t in every}
    for name, where in seen.referenced:
        if name not in names:
            raise invalid(f"{where}.tool_name: {name!r:.80} names no tool of tools", param="messages")
    referenced = {name for name, _ in seen.referenced}
    tools = tuple(t for t in every if t.name not in deferred or t.name in referenced)
    if not every and any(m.tool_calls or m.role == "tool" for m in seen.messages):
        # The Messages API's own refusal (anthropic-sdk-python issue 494 quotes it).
        raise invalid("tools: requests which include tool_use or tool_result blocks must define tools", param="tools")
    output_config = body.get("output_config")
    if output_config is not None:
        seen.effort = seen.effort or _effort(output_config, "output_config", OUTPUT_CONFIG_FIELDS)
    output_where = "output_config.format"
    if output_config is not None and output_config.get("format") is not None:
        output = _output(output_config["format"], output_where)
    elif body.get("output_format") is not None:
        output_where = "output_format"
        output = _output(body["output_format"], output_where)
    else:
        output = OutputFormat()
    request = GenerationRequest(
        messages=tuple(seen.messages),
        max_tokens=None,
        tools=every,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        output=output,
        reasoning=_reasoning(body.get("thinking"), seen.effort),
        context_edits=_context_edits(body.get("context_management")),
    )
    # the schemas are checked with every tool, so that an error names the tool's own index
    check_enforced(request, "tools[{i}].input_schema", f"{output_where}.schema")
    return attrs.evolve(request, tools=tools)


def _system(value: Any) -> str:
    """The system prompt's text, without Claude Code's billing stamp (:data:`BILLING_STAMP`)."""
    if isinstance(value, str):
        stamp = BILLING_STAMP.match(value)
        if stamp is None:
            return value
        report_ignored("system")
        return value[stamp.end():].lstrip("\n")
    if isinstance(value, list):
        texts = []
        for i, block in enumerate(value):
            text = text_block(block, f"system[{i}]", "system", TEXT_BLOCK_FIELDS)
            if BILLING_STAMP.fullmatch(text.strip()):
                report_ignored(f"system[{i}]")
            else:
                texts.append(text)
        return "".join(texts)
    return text_content(value, "system", TEXT_BLOCK_FIELDS)


def _effort(value: Any, where: str, fields: FieldTable) -> Effort | None:
    """The ``effort`` of an ``output_config`` at ``where``, its fields checked against ``fields``
    (None: not given)."""
    param = where.split(".")[0].split("[")[0]
    effort = fields.object(value, where, param).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise invalid(f"{where}.effort: must be one of {', '.join(EFFORTS)}", param=param)
    return Effort(effort)


def _reasoning(value: Any, effort: Effort | None) -> ReasoningConfig:
    """``thinking`` (:data:`THINKING_TYPES`; ``budget_tokens``, at least 1, with ``enabled``)
    and the effort, as the request's reasoning controls. A model that does not reason answers
    as without them."""
    if value is None:
        return ReasoningConfig(effort=effort)
    value = THINKING_FIELDS.object(value, "thinking", "thinking")
    kind = value.get("type")
    if kind not in THINKING_TYPES:
        raise invalid(f"thinking.type: must be one of {', '.join(THINKING_TYPES)}", param="thinking")
    budget = None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise invalid("thinking.budget_tokens: must be a positive integer", param="thinking")
    elif value.get("budget_tokens") is not None:
        raise invalid(f"thinking.budget_tokens: only with type 'enabled', not {kind!r}", param="thinking")
    return ReasoningConfig(enabled=THINKING_TYPES[kind], effort=effort, budget_tokens=budget)


def _omitted(value: Any) -> bool:
    """Whether ``thinking.display`` (:data:`DISPLAYS`; absent: ``summarized``) withholds the
    thinking text (``thinking`` already read by :func:`_reasoning`).

    Raises:
        RingserveError: ``INVALID_REQUEST``: another value.
    """
    display = value.get("display") if isinstance(value, dict) else None
    if display is None:
        return False
    if display not in DISPLAYS:
        raise invalid(f"thinking.display: must be one of {', '.join(DISPLAYS)}", param="thinking")
    return DISPLAYS[display]


def _threshold(value: Any, where: str, kinds: tuple[str, ...]) -> tuple[str, int]:
    """A ``{"type": KIND, "value": N}`` threshold at ``where``: its kind (one of ``kinds``) and N >= 0."""
    value = THRESHOLD_FIELDS.object(value, where, "context_management")
    kind, n = value.get("type"), value.get("value")
    if kind not in kinds:
        raise invalid(f"{where}.type: must be one of {', '.join(kinds)}", param="context_management")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise invalid(f"{where}.value: must be a non-negative integer", param="context_management")
    return kind, n


def _names(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise invalid(f"{where}: must be a list of tool names", param="context_management")
    return frozenset(value)


def _context_edits(value: Any) -> tuple[ContextEdit, ...]:
    """``context_management.edits`` as context edits (``core/context.py``): ``clear_thinking_20251015``
    (``keep``: ``"all"``, ``{"type": "all"}`` or ``{"type": "thinking_turns", "value": N}``; absent:
    1 turn) and ``clear_tool_uses_20250919`` (``trigger``, ``keep``, ``clear_at_least``,
    ``exclude_tools``, ``clear_tool_inputs``; absent: Anthropic's defaults)."""
    if value is None:
        return ()
    value = CONTEXT_MANAGEMENT_FIELDS.object(value, "context_management", "context_management")
    raw = value.get("edits")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid("context_management.edits: must be a list", param="context_management")
    edits: list[ContextEdit] = []
    for i, edit in enumerate(raw):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == "clear_thinking_20251015":
            edit = CLEAR_THINKING_FIELDS.object(edit, where, "context_management")
            keep = edit.get("keep")
            if keep is None:
                edits.append(ClearThinking())
            elif keep == "all" or keep == {"type": "all"}:
                edits.append(ClearThinking(keep_turns=None))
            else:
                edits.append(ClearThinking(_threshold(keep, f"{where}.keep", ("thinking_turns",))[1]))
        elif kind == "clear_tool_uses_20250919":
            edit = CLEAR_TOOL_USES_FIELDS.object(edit, where, "context_management")
            tool_uses = ClearToolUses()
            if edit.get("trigger") is not None:
                trigger_kind, trigger = _threshold(edit["trigger"], f"{where}.trigger", tuple(Trigger))
                tool_uses = attrs.evolve(tool_uses, trigger=trigger, trigger_kind=Trigger(trigger_kind))
            if edit.get("keep") is not None:
                tool_uses = attrs.evolve(tool_uses, keep=_threshold(edit["keep"], f"{where}.keep", ("tool_uses",))[1])
            if edit.get("clear_at_least") is not None:
                least = _threshold(edit["clear_at_least"], f"{where}.clear_at_least", ("input_tokens",))[1]
                tool_uses = attrs.evolve(tool_uses, clear_at_least=least)
            if edit.get("exclude_tools") is not None:
                tool_uses = attrs.evolve(tool_uses, exclude=_names(edit["exclude_tools"], f"{where}.exclude_tools"))
            inputs = edit.get("clear_tool_inputs")
            if inputs is not None:
                clear = inputs if isinstance(inputs, bool) else _names(inputs, f"{where}.clear_tool_inputs")
                tool_uses = attrs.evolve(tool_uses, clear_inputs=clear)
            edits.append(tool_uses)
        else:
            raise invalid(
                f"{where}.type: must be clear_thinking_20251015 or clear_tool_uses_20250919, got {kind!r:.80}"
                " (compaction, which summarises, is not implemented)",
                param="context_management",
            )
    return tuple(edits)


#: Block types a message of the other role may not hold: (type, the role it belongs to).
_ROLE_OF_BLOCK = {"tool_use": "assistant", "tool_result": "user", "thinking": "assistant",
                  "redacted_thinking": "assistant"}


def _turns(m: dict[str, Any], where: str, seen: _Conversation, *, last: bool) -> None:
    """Add the neutral turns of one message (the ``last`` of the request or not) to ``seen``: one,
    none for a system message with no text (a control message: :func:`conversation`), or a user
    message's tool results and texts in order."""
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role: must be one of {', '.join(ROLES)}", param="messages")
    content, where = m.get("content"), f"{where}.content"
    if role == "system":
        text = text_content(content, where, TEXT_BLOCK_FIELDS)
        if text:
            seen.messages.append(ChatMessage("system", text))
        elif content == [] and not any(v is not None for v in (m.get("output_config") or {}).values()):
            raise invalid(f"{where}: a system message needs content or output_config fields", param="messages")
        return
    if not isinstance(content, list) or not content:
        empty_ok = last and role == "assistant"  # an empty prefill, as the Messages API allows
        seen.messages.append(ChatMessage(role, text_content(content, where, TEXT_BLOCK_FIELDS, allow_empty=empty_ok)))
        return
    texts: list[str] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []  # the reasoning of its thinking blocks signed here
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in _ROLE_OF_BLOCK and _ROLE_OF_BLOCK[kind] != role:
            raise invalid(f"{at}: {kind} blocks belong in {_ROLE_OF_BLOCK[kind]} messages", param="messages")
        if kind == "tool_use":
            calls.append(_tool_use(block, at, seen.ids))
        elif kind == "thinking":
            THINKING_BLOCK_FIELDS.check(block, at, param="messages")
            thinking, signature = block.get("thinking"), block.get("signature")
            if not isinstance(thinking, str) or not isinstance(signature, str):
                raise invalid(f"{at}: a thinking block has a string thinking and a string signature", param="messages")
            restored = signed_reasoning(thinking, signature, at)
            if restored is not None:
                thoughts.append(restored)
        elif kind == "redacted_thinking":
            REDACTED_THINKING_FIELDS.check(block, at, param="messages")
            report_ignored(at)  # opaque data of another server's: nothing to restore
        elif kind == "tool_result":
            if texts:
                seen.messages.append(ChatMessage("user", "".join(texts)))
                texts = []
            seen.messages.append(_tool_result(block, at, seen))
        else:
            texts.append(text_block(block, at, where, TEXT_BLOCK_FIELDS))
    if role == "assistant":
        seen.messages.append(ChatMessage("assistant", "".join(texts), tool_calls=tuple(calls),
                                         reasoning="\n\n".join(thoughts)))
    elif texts:
        seen.messages.append(ChatMessage("user", "".join(texts)))


def _tool_use(block: dict[str, Any], where: str, ids: CallIds) -> ToolCall:
    TOOL_USE_FIELDS.check(block, where, param="messages")
    call_id = ids.call(block.get("id"), f"{where}.id", "messages")
    name = tool_name(block.get("name"), f"{where}.name", "messages")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input: must be an object", param="messages")
    return ToolCall(call_id, name, dumps(arguments))


def _tool_result(block: dict[str, Any], where: str, seen: _Conversation) -> ChatMessage:
    """A ``tool`` turn: the result's text (a string, or its text blocks joined); its
    ``tool_reference`` blocks name deferred tools that join the prompt (noted in ``seen``)."""
    TOOL_RESULT_FIELDS.check(block, where, param="messages")
    call_id = seen.ids.result(block.get("tool_use_id"), f"{where}.tool_use_id", "messages")
    content = block.get("content")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            if isinstance(part, dict) and part.get("type") == "tool_reference":
                TOOL_REFERENCE_FIELDS.check(part, at, param="messages")
                seen.referenced.append((tool_name(part.get("tool_name"), f"{at}.tool_name", "messages"), at))
            else:
                texts.append(text_block(part, at, "messages", TEXT_BLOCK_FIELDS))
        text = "".join(texts)
    else:
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
    optional(raw.get("defer_loading"), bool, f"{where}.defer_loading", "tools")
    return ToolSpec(
        name=tool_name(raw.get("name"), f"{where}.name", "tools"),
        description=optional(raw.get("description"), str, f"{where}.description", "tools") or "",
        parameters=json_schema(raw.get("input_schema"), f"{where}.input_schema", "tools", arguments=True),
        strict=bool(optional(raw.get("strict"), bool, f"{where}.strict", "tools")),
    )


def _deferred(tools: Any) -> frozenset[str]:
    """The names of the tools with ``defer_loading: true`` (``tools`` already parsed by :func:`tool_list`)."""
    return frozenset(t["name"] for t in tools or () if t.get("defer_loading") is True)


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


def _output(value: Any, where: str) -> OutputFormat:
    """Structured output from ``{"type": "json_schema", "schema": {...}}`` at ``where``."""
    param = where.split(".")[0]
    fmt = OUTPUT_FORMAT_FIELDS.object(value, where, param)
    if fmt.get("type") != "json_schema":
        raise invalid(f'{where}.type: must be "json_schema"', param=param)
    schema = json_schema(fmt.get("schema"), f"{where}.schema", param, arguments=False)
    return OutputFormat(OutputKind.JSON_SCHEMA, schema)


#: ``AppliedEdit.edit``'s kind → (the edit's ``type``, the key of what it cleared), as
#: ``BetaClearThinking20251015EditResponse`` and ``BetaClearToolUses20250919EditResponse`` spell them.
APPLIED_EDITS = {ClearThinking: ("clear_thinking_20251015", "cleared_thinking_turns"),
                 ClearToolUses: ("clear_tool_uses_20250919", "cleared_tool_uses")}


def context_management_fields(edits: dict[str, Any] | None) -> dict[str, Any]:
    """``{"context_management": edits}`` of a message whose context edits cleared something (in
    ``message_delta`` and the ``Message``: ``BetaContextManagementResponse``), else nothing."""
    return {} if edits is None else {"context_management": edits}


class AnthropicSurface:
    """Anthropic Messages: parsing, rendering and error shapes.

    A message is rendered by the surface :meth:`restored` from its echo (a JSON object, "" for
    none): what its context edits cleared, if they trimmed its prompt (``edits``,
    ``BetaContextManagementResponse``: ``{"applied_edits": [...]}``, :meth:`edited`), and
    whether its thinking is ``omitted``; and with the server's ``signer``, which signs its
    thinking blocks (:class:`ThinkingDisplay`). The registry's has neither.
    """

    name = "anthropic"
    id_prefix = "msg_"
    prefer_respond_async = True
    refuses_lone_surrogates = False

    def __init__(self, edits: dict[str, Any] | None = None, signer: ReasoningSigner | None = None,
                 omitted: bool = False) -> None:
        self.edits = edits
        self.signer = signer
        self.omitted = omitted

    def restored(self, echo: str, signer: ReasoningSigner) -> AnthropicSurface:
        """The surface of a message with ``echo`` (``{"context_management": ..., "thinking_display":
        "omitted"}``, either key absent; "" for neither), signing with ``signer``."""
        state = json.loads(echo) if echo else {}
        return AnthropicSurface(state.get("context_management"), signer, state.get("thinking_display") == "omitted")

    def edited(self, echo: str, applied: tuple[AppliedEdit, ...]) -> str:
        """The echo of a message whose prompt ``applied`` trimmed: ``echo`` with the
        ``context_management`` its ``message_delta`` and ``Message`` report (``applied_edits``,
        in order)."""
        edits = []
        for edit in applied:
            kind, cleared = APPLIED_EDITS[type(edit.edit)]
            edits.append({"type": kind, cleared: edit.cleared, "cleared_input_tokens": edit.cleared_input_tokens})
        return dumps({**(json.loads(echo) if echo else {}), "context_management": {"applied_edits": edits}})

    def _display(self) -> ThinkingDisplay:
        return ThinkingDisplay(self.signer, self.omitted)

    def parse_request(self, body: Any) -> ParsedRequest:
        """Validate a Messages request body.

        Fields as :data:`REQUEST_FIELDS` lists them: ``model``,
        ``max_tokens`` (required, 1 to 1,000,000; more than the context leaves
        is served until the context is full), ``messages`` (user, assistant
        and system turns; string content or a list of blocks, see
        :func:`conversation`), ``system`` (string or text
        blocks), ``tools``, ``tool_choice``, ``output_config``, ``thinking`` and
        ``context_management`` (see :func:`conversation`), ``temperature`` (0–1), ``top_p``, ``top_k``,
        ``stop_sequences`` (a list of non-empty strings), ``stream``; and, as llama.cpp's server does,
        its other samplers (``surfaces/base.py`` :func:`~ringserve.surfaces.base.sampling_params`).
        Bookkeeping fields (``metadata``, ``cache_control``, ...) and
        unknown fields are accepted and reported (``surfaces/base.py`` ``report_ignored``);
        what a correct answer needs and ringserve cannot give (image or document blocks, server
        tools, MCP servers, ...) is refused. Headers such as ``anthropic-beta`` are not read.

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
        echo = dumps({"thinking_display": "omitted"}) if _omitted(body.get("thinking")) else ""
        return ParsedRequest(request=request, stream=get_bool(body, "stream"), model=model, echo=echo,
                             echo_without_prompts=echo)

    def parse_count(self, body: Any) -> ParsedRequest:
        """Validate a ``POST /v1/messages/count_tokens`` body (:data:`COUNT_TOKENS_FIELDS`).

        The conversation is read as :meth:`parse_request` reads it (system
        prompt, tools, tool choice, output format, thinking, context edits), so its prompt is the
        one that request would be given; the request has no ``max_tokens``. The fields only a
        generation reads (``max_tokens``, ``stream``, ...) are accepted and reported.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming the offending field.
        """
        body = require_object(body)
        COUNT_TOKENS_FIELDS.check(body)
        return ParsedRequest(request=conversation(body), stream=False, model=get_str(body, "model", required=True))

    def count_json(self, input_tokens: int, original_input_tokens: int) -> dict[str, Any]:
        """The ``POST /v1/messages/count_tokens`` answer (``anthropic.types.MessageTokensCount``);
        when context edits trimmed the prompt, the tokens before them as
        ``context_management.original_input_tokens`` (``BetaMessageTokensCount``)."""
        if original_input_tokens == input_tokens:
            return {"input_tokens": input_tokens}
        return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": original_input_tokens}}

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> AnthropicRenderer:
        return AnthropicRenderer(message_id, model, self._display(), self.edits)

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
            **context_management_fields(self.edits),
        }

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> list[dict[str, Any]]:
        """The ``content`` list of a ``Message``: text, ``tool_use`` (``input`` an object) and
        ``thinking`` blocks."""
        display = self._display()
        return [_block_json(b, display) for b in blocks]

    def stop_reason(self, reason: StopReason) -> str:
        return STOP_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return error.status

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        return _error_object(ERROR_TYPES[error.kind], error.message)
