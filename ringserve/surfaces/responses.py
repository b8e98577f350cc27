"""OpenAI Responses surface (``POST /v1/responses`` and the routes in ``http/responses.py``).

Shapes follow the official ``openai`` SDK's types (3.57): the request is
``openai.types.responses.ResponseCreateParams``, the object is
``openai.types.responses.Response``, and every stream event is one of
``openai.types.responses.ResponseStreamEvent``. A stream is ``event: <type>``
plus data JSON with the same ``type`` and a ``sequence_number`` equal to the
event's seq in the message's ring log (the renderer leaves it to the producer,
``core/producer.py``, which counts the seqs and puts ``id: <response_id>:<seq>``
on every event). No ``[DONE]``.

A text answer streams as::

    response.created (seq 0)  [response.queued, when background]  response.in_progress
    response.output_item.added  response.content_part.added  response.output_text.delta ...
    response.output_text.done  response.content_part.done  response.output_item.done
    then exactly one of response.completed | response.incomplete | response.failed

and a silence (a long prefill, a queue) gets ``response.in_progress`` again, carrying the
response as streamed so far: a documented event that the SDKs accept and Codex counts as data.

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
- an error (a drain's too): ``response.failed`` with ``error.code`` (``server_error``,
  ``rate_limit_exceeded``, ``invalid_prompt``) and the message, right after the last delta: the
  item it interrupted gets no done events (:class:`ResponsesRenderer`).

HTTP errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(the Chat Completions surface's table).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, assert_never

import attrs

from ringserve.core.errors import PROMPT_PARAM, ErrorKind, RingserveError, invalid
from ringserve.core.events import (
    AppliedEdit,
    FREEFORM_ARGUMENT,
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
    ReasoningConfig,
    StopReason,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    Usage,
)
from ringserve.core.lark import MAX_CHARS as MAX_GRAMMAR_CHARS
from ringserve.core.status import INTERRUPTED_MESSAGE, MessageStatus
from ringserve.core.render import SEQ_VALUE, WireEvent
from ringserve.core.signing import ReasoningSigner
from ringserve.core.view import MessageView
from ringserve.surfaces.base import (
    SAMPLER_FIELDS,
    check_enforced,
    logprob_json,
    CallIds,
    Continuation,
    LoadStored,
    FieldTable,
    ParsedRequest,
    Refused,
    arguments_json,
    dumps,
    function_spec,
    get_bool,
    get_int,
    get_str,
    openai_tool_choice,
    optional,
    reasoning_effort,
    report_ignored,
    require_object,
    signed_reasoning,
    sampling_params,
    schema_format,
    template_kwargs,
    tool_list,
    tool_name,
)
from ringserve.surfaces.openai import FINISH_REASONS, OpenAISurface, tool_call_id

MAX_OUTPUT_TOKENS_LIMIT = 1_000_000
#: OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


#: What ``parse_create`` does with each field of ``openai.types.responses.ResponseCreateParams``
#: (openai 3.57) and with ringserve's extensions; docs/compatibility.md's table.
REQUEST_FIELDS = FieldTable(
    supported=frozenset({
        "model", "input", "instructions", "max_output_tokens", "stream", "stream_options", "background", "store",
        "metadata", "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls",
        "prompt_cache_key", "reasoning", "include", "top_logprobs",
        # the samplers: OpenAI's (temperature, top_p), and the extensions llama.cpp's server accepts
        *SAMPLER_FIELDS,
        # an extension, as llama.cpp's server accepts it on its other routes
        "chat_template_kwargs",
    }),
    ignored=frozenset({
        # bookkeeping, caching and routing that cannot change the text
        "user", "service_tier", "safety_identifier", "prompt_cache_options",
        "prompt_cache_retention", "access_programs",
        # a check of OpenAI's own, and options of a hosted image tool the model cannot call
        "moderation", "image",
    }),
    refused={
        "max_tool_calls": Refused("a limit on the number of tool calls is not implemented"),
        "truncation": Refused("the input is never truncated: a conversation that does not fit is a 400",
                              neutral=("disabled",)),
        "conversation": Refused("the Conversations API is not implemented; use previous_response_id"),
        "context_management": Refused("context compaction is not implemented", neutral=([],)),
        "prompt": Refused("stored prompt templates are not implemented"),
        "background_options": Refused("completion windows are not implemented",
                                      neutral=({}, {"completion_window": "soonest"})),
    },
)

#: The fields of ``text`` (``ResponseTextConfigParam``).
TEXT_FIELDS = FieldTable(
    supported=frozenset({"format"}),
    # a style hint to the model
    ignored=frozenset({"verbosity"}),
    refused={},
)

#: The fields of ``reasoning`` (``openai.types.shared_params.Reasoning``): the effort, and a summary
#: (``generate_summary``: its deprecated spelling). Which past reasoning the prompt keeps is the
#: chat template's (``context``); there is one execution mode (``mode``).
REASONING_FIELDS = FieldTable(
    supported=frozenset({"effort", "summary", "generate_summary"}), ignored=frozenset({"context", "mode"}),
    refused={},
)

#: ``reasoning.summary`` values: each asks for the reasoning as a summary (:class:`ResponsesRenderer`).
SUMMARIES = ("auto", "concise", "detailed")

#: The ``include`` value that asks for each reasoning item's ``encrypted_content``, and the one
#: that asks for the log probabilities of the output text's tokens; the others
#: (``openai.types.responses.ResponseIncludable``: hosted tools' results, image URLs) have nothing
#: to add here and are reported.
ENCRYPTED_CONTENT = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"

#: The fields of ``text.format`` (``ResponseFormatTextConfigParam``: ``ResponseFormatText``,
#: ``ResponseFormatJSONObject``, ``ResponseFormatTextJSONSchemaConfigParam``; flat, unlike Chat's
#: ``response_format.json_schema``).
FORMAT_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "schema", "strict"}),
    # documentation of the format for the model, which the grammar enforces anyway
    ignored=frozenset({"description"}),
    refused={},
)

#: The fields of a function tool (``FunctionToolParam``: flat, unlike Chat's ``tools[i].function``;
#: a namespace's functions too).
TOOL_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "description", "parameters", "strict"}),
    ignored=frozenset(),
    refused={
        "defer_loading": Refused("tool search is not implemented", neutral=(False,)),
        "allowed_callers": Refused("programmatic tool calling is not implemented", neutral=(["direct"],)),
        "output_schema": Refused("tool output schemas are not implemented"),
        "async": Refused("asynchronous tool calls are not implemented", neutral=(False,)),
    },
)

#: The fields of a ``custom`` tool (``CustomToolParam``: a freeform tool, its input one text,
#: with a ``format``: ``{"type": "text"}`` or a Lark ``grammar``) and of its ``format``.
CUSTOM_TOOL_FIELDS = FieldTable(
    supported=frozenset({"type", "name", "description", "format"}),
    ignored=frozenset(),
    refused={key: TOOL_FIELDS.refused[key] for key in ("defer_loading", "allowed_callers", "async")},
)
CUSTOM_FORMAT_FIELDS = FieldTable(supported=frozenset({"type", "syntax", "definition"}), ignored=frozenset(),
                                  refused={})

#: The fields of a ``namespace`` tool (``NamespaceToolParam``: function and custom tools under
#: one name, which the model calls as ``namespace.name``: :func:`qualified`).
NAMESPACE_FIELDS = FieldTable(supported=frozenset({"type", "name", "description", "tools"}), ignored=frozenset(),
                              refused={})

#: The separator of a namespace and a tool's name in the name the model calls (``multi_agent_v1.spawn_agent``).
NAMESPACE_SEPARATOR = "."

#: The fields of a named ``tool_choice`` (``ToolChoiceFunctionParam``).
TOOL_CHOICE_FIELDS = FieldTable(supported=frozenset({"type", "name"}), ignored=frozenset(), refused={})

_CALLER = Refused("programmatic tool calling is not implemented", neutral=({"type": "direct"},))

#: The fields of a ``function_call`` input item (``ResponseFunctionToolCallParam``: a call of an
#: earlier answer sent back) and of a ``function_call_output`` item (``FunctionCallOutput``; its
#: ``name`` is the call's, which the call item or the previous response has).
CALL_ITEM_FIELDS = FieldTable(
    supported=frozenset({"type", "call_id", "name", "arguments", "namespace"}),
    # what the SDKs' stream helpers add to a call they hand back (the Node SDK's parsed_arguments)
    ignored=frozenset({"id", "status", "parsed_arguments"}),
    refused={"caller": _CALLER, "async": Refused("asynchronous tool calls are not implemented", neutral=(False,))},
)
#: A ``custom_tool_call`` input item (``ResponseCustomToolCallParam``), and the output item of a
#: call of either kind (``FunctionCallOutput``, ``ResponseCustomToolCallOutputParam``).
CUSTOM_CALL_ITEM_FIELDS = FieldTable(
    supported=frozenset({"type", "call_id", "name", "input", "namespace"}),
    ignored=frozenset({"id", "status"}),
    refused={key: CALL_ITEM_FIELDS.refused[key] for key in ("caller", "async")},
)
OUTPUT_ITEM_FIELDS = FieldTable(
    supported=frozenset({"type", "call_id", "output"}),
    ignored=frozenset({"id", "status", "name", "namespace"}),
    refused={"caller": _CALLER},
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

#: Input items of hosted tools (``web_search``, ``tool_search``, ...: :func:`_tool`), which an
#: earlier answer of another server may hold: dropped (the model never saw those tools).
HOSTED_ITEM_TYPES = frozenset({"web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                               "tool_search_call", "tool_search_output"})

#: Input item types of tools ringserve has no equivalent for, and others; any other type is
#: unknown. Both are 400s naming the type.
TOOL_ITEM_TYPES = frozenset({
    "computer_call", "computer_call_output", "local_shell_call", "local_shell_call_output", "shell_call",
    "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "additional_tools", "program", "program_output",
})
OTHER_ITEM_TYPES = frozenset({"compaction", "compaction_trigger", "item_reference",
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


def qualified(namespace: str | None, name: str) -> str:
    """The name the model calls a tool by: ``namespace.name`` in a namespace, else ``name``."""
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


@attrs.frozen
class CallName:
    """A tool as its call items spell it: ``name`` in ``namespace`` (None: none); ``custom``: a
    ``custom_tool_call`` with the text of its ``input`` (else a ``function_call`` with its
    arguments)."""

    name: str
    namespace: str | None = None
    custom: bool = False


@attrs.frozen
class ResponseOptions:
    """What a Response object echoes of its request (``openai.types.responses.Response``).

    ``text_format`` is the request's ``text.format`` as validated (``{"type": "text"}`` when absent).
    ``tools`` are the tools as the model sees them (a namespace's flattened, hosted ones left
    out), ``tool_echo`` the request's as ``Response.tools`` echoes them, and ``calls`` how the
    call items of the tools that are not plain functions spell them (by the name the model calls).
    ``effort`` and ``summary`` are the request's ``reasoning`` (:data:`SUMMARIES`), and
    ``encrypted_content`` whether its ``include`` asks for reasoning items' encrypted content.
    ``temperature``, ``top_p`` and ``top_logprobs`` are the request's (None: not sent).
    """

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] = attrs.Factory(dict)
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    text_format: dict[str, Any] = attrs.Factory(lambda: {"type": "text"})
    tool_echo: tuple[dict[str, Any], ...] = ()
    calls: dict[str, CallName] = attrs.Factory(dict)
    effort: str | None = None
    summary: str | None = None
    encrypted_content: bool = False

    def call_name(self, name: str) -> CallName:
        """How the call items of the tool the model calls ``name`` spell it."""
        return self.calls.get(name) or CallName(name)


@attrs.frozen
class ResponseCreate:
    """A parsed ``POST /v1/responses`` body.

    ``input`` is this request's own turns (``instructions`` not among them);
    :meth:`generation` prepends the system turn and a previous response's
    conversation. ``answers`` are the ``(call_id, where)`` of the ``function_call_output``
    items whose call is not in ``input``: a call of the previous responses, which
    :meth:`generation` checks.
    """

    options: ResponseOptions
    input: tuple[ChatMessage, ...]
    parsed: ParsedRequest
    answers: tuple[tuple[str, str], ...] = ()

    def generation(self, history: tuple[ChatMessage, ...] = ()) -> ParsedRequest:
        """The request to generate: ``instructions`` (a system turn), ``history``, then ``input``.

        Raises:
            RingserveError: ``INVALID_REQUEST`` (``param`` ``input``) for a ``function_call_output``
                whose ``call_id`` matches no function call of ``history`` or ``input``.
        """
        earlier = CallIds({call.call_id for m in history for call in m.tool_calls})
        for call_id, where in self.answers:
            earlier.result(call_id, where, "input")
        system = () if self.options.instructions is None else (ChatMessage("system", self.options.instructions),)
        messages = system + history + self.input
        return attrs.evolve(self.parsed, request=attrs.evolve(self.parsed.request, messages=messages))


def _input_items(value: Any) -> tuple[tuple[ChatMessage, ...], tuple[tuple[str, str], ...]]:
    """``input``: a string (one user turn) or a list of items; and the answers to calls not in it
    (:class:`ResponseCreate`).

    Items: messages; a ``function_call`` or ``custom_tool_call`` (an earlier answer's call sent
    back) is a call of the assistant turn before it (a new assistant turn when the item before
    is not one), named ``namespace.name`` when it has a namespace (:func:`qualified`); a
    ``function_call_output`` or ``custom_tool_call_output`` a ``tool`` turn. A ``reasoning``
    item's text (:func:`_reasoning_text`) is the reasoning of the assistant turn after it; one
    without (a summary only, another server's ``encrypted_content``) is dropped and reported,
    never an error. Items of hosted tools (:data:`HOSTED_ITEM_TYPES`) are
    dropped and reported.
    """
    if isinstance(value, str) and value:
        return (ChatMessage("user", value),), ()
    if not isinstance(value, list) or not value:
        raise invalid("input: must be a non-empty string or a non-empty list of items", param="input")
    messages: list[ChatMessage] = []
    ids, answers = CallIds(), []
    reasoning = ""  # of the assistant turn to come

    def assistant(turn: ChatMessage, merge: bool) -> None:
        nonlocal reasoning
        if merge and messages and messages[-1].role == "assistant":
            last = messages[-1]
            joined = "\n\n".join(r for r in (last.reasoning, reasoning) if r)
            messages[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, *turn.tool_calls), reasoning=joined)
        else:
            messages.append(attrs.evolve(turn, reasoning=reasoning))
        reasoning = ""

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: must be an object", param="input")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise invalid(f"{where}.type: must be a string", param="input")
        if kind == "reasoning":
            reasoning = "\n\n".join(r for r in (reasoning, _reasoning_text(item, where)) if r)
            continue
        if kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            (CUSTOM_CALL_ITEM_FIELDS if custom else CALL_ITEM_FIELDS).check(item, where, param="input")
            call = ToolCall(
                call_id=ids.call(item.get("call_id"), f"{where}.call_id", "input"),
                name=_call_name(item, where),
                arguments=(_freeform_arguments(item.get("input"), f"{where}.input") if custom
                           else arguments_json(item.get("arguments"), f"{where}.arguments", "input")),
            )
            assistant(ChatMessage("assistant", "", tool_calls=(call,)), merge=True)
            continue
        if kind in HOSTED_ITEM_TYPES:
            report_ignored(where)
            continue
        reasoning = "" if kind != "message" or item.get("role") != "assistant" else reasoning
        if kind in ("function_call_output", "custom_tool_call_output"):
            OUTPUT_ITEM_FIELDS.check(item, where, param="input")
            call_id = item.get("call_id")
            if isinstance(call_id, str) and call_id and call_id not in ids.seen:
                answers.append((call_id, f"{where}.call_id"))  # a call of the previous responses?
            else:
                call_id = ids.result(call_id, f"{where}.call_id", "input")
            messages.append(ChatMessage("tool", _item_text(item.get("output"), f"{where}.output"), tool_call_id=call_id))
            continue
        if kind != "message":
            if kind in TOOL_ITEM_TYPES or kind in OTHER_ITEM_TYPES:
                raise invalid(f"{where}: items of type {kind!r} are not supported by ringserve", param="input")
            raise invalid(f"{where}.type: unknown input item type {str(kind)[:60]!r}", param="input")
        ITEM_FIELDS.check(item, where, param="input")
        role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise invalid(f"{where}.role: must be one of {', '.join(ROLES)}", param="input")
        turn = ChatMessage(role, _item_text(item.get("content"), f"{where}.content"))
        if role == "assistant":
            assistant(turn, merge=False)
        else:
            messages.append(turn)
    return tuple(messages), tuple(answers)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The reasoning of a ``reasoning`` input item at ``where``: its ``content`` parts'
    (``reasoning_text``, or ``text``) text joined; else the text its ``encrypted_content`` carries
    when ringserve sealed it (an item of its own output with ``include:
    ["reasoning.encrypted_content"]``, sent back statelessly, as Codex does under ``store: false``;
    ``surfaces/base.py`` ``signed_reasoning`` checks the seal); else "" and the item is reported
    (a summary is not the reasoning, and OpenAI's encrypted content does not verify here)."""
    content = item.get("content")
    texts = [part.get("text") for part in content if isinstance(part, dict)
             and part.get("type") in ("reasoning_text", "text")] if isinstance(content, list) else []
    text = "".join(text for text in texts if isinstance(text, str))
    if text:
        return text
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed:
        return signed_reasoning("", sealed, where) or ""  # reported when it does not verify
    report_ignored(where)
    return ""


def _call_name(item: dict[str, Any], where: str) -> str:
    """The name a call item's tool has in the prompt: its ``name``, in its ``namespace`` if any."""
    name = tool_name(item.get("name"), f"{where}.name", "input")
    namespace = item.get("namespace")
    if namespace is None:
        return name
    return qualified(tool_name(namespace, f"{where}.namespace", "input"), name)


def _freeform_arguments(value: Any, where: str) -> str:
    """A ``custom_tool_call``'s ``input`` as a freeform call's arguments (``{"input": ...}``)."""
    if not isinstance(value, str):
        raise invalid(f"{where}: must be a string", param="input")
    return dumps({FREEFORM_ARGUMENT: value})


def _tool(raw: dict[str, Any], where: str) -> ToolSpec | tuple[ToolSpec, ...]:
    """One tool: a function (:data:`TOOL_FIELDS`), a ``custom`` tool (:func:`_custom_tool`), a
    ``namespace``'s function and custom tools (named ``namespace.name``, each described with the
    namespace's description), or none for a tool the model cannot call here, reported: hosted
    by OpenAI (``web_search``, ``file_search``, ``image_generation``, ``code_interpreter``,
    ``computer_use_preview``), run by a client for a model trained on them (``local_shell``,
    ``shell``, ``apply_patch``, a client-executed ``tool_search`` over deferred tools), or of a
    type ringserve does not know (Codex sends ``web_search`` and ``tool_search`` on every turn).
    ``mcp`` (remote MCP servers the server would have to call) is a 400 naming ``tools[i].type``."""
    match raw.get("type"):
        case "function":
            TOOL_FIELDS.check(raw, where, param="tools")
            return function_spec(raw, where, "tools")
        case "custom":
            return _custom_tool(raw, where)
        case "namespace":
            NAMESPACE_FIELDS.check(raw, where, param="tools")
            namespace = tool_name(raw.get("name"), f"{where}.name", "tools")
            about = optional(raw.get("description"), str, f"{where}.description", "tools") or ""
            inner = raw.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{where}.tools: must be a list of function and custom tools", param="tools")
            tools = []
            for j, tool in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
                    raise invalid(f"{at}: a namespace holds function and custom tools", param="tools")
                spec = _tool(tool, at)
                assert isinstance(spec, ToolSpec)
                description = f"{about}\n\n{spec.description}".strip() if about else spec.description
                tools.append(attrs.evolve(spec, name=qualified(namespace, spec.name), description=description))
            return tuple(tools)
        case "mcp":
            raise invalid(f"{where}.type: 'mcp' tools are not supported by ringserve (the server would have to"
                          " call the MCP server; run it in the client and send its tools as functions)",
                          param="tools")
        case _:
            report_ignored(where)
            return ()


def freeform_parameters(grammar: str) -> str:
    """The arguments' schema that a freeform tool shows the model: one string, its input, which
    matches the Lark ``grammar`` (written in the description, so that the model knows it)."""
    about = "The tool's input: free text." if not grammar else (
        "The tool's input: a text that matches this Lark grammar (not JSON, unless the grammar says so):\n"
        + grammar)
    return dumps({"type": "object", "properties": {FREEFORM_ARGUMENT: {"type": "string", "description": about}},
                  "required": [FREEFORM_ARGUMENT], "additionalProperties": False})


def _custom_tool(raw: dict[str, Any], where: str) -> ToolSpec:
    """A ``custom`` tool (:data:`CUSTOM_TOOL_FIELDS`): a freeform tool whose input is decoded under
    its ``format``'s grammar (Lark, or a ``regex`` as a Lark grammar of one terminal; none for
    ``{"type": "text"}``). A grammar longer than ``core/lark.py``'s ``MAX_CHARS`` is a 400 naming
    ``tools[i].format.definition`` here; the rest of its check takes time, and is the shell's, on
    a worker thread (:attr:`ParsedRequest.grammars`, :func:`_grammars`)."""
    CUSTOM_TOOL_FIELDS.check(raw, where, param="tools")
    name = tool_name(raw.get("name"), f"{where}.name", "tools")
    fmt = raw.get("format")
    grammar = ""
    if fmt is not None:
        fmt = CUSTOM_FORMAT_FIELDS.object(fmt, f"{where}.format", "tools")
        kind, syntax, definition = fmt.get("type"), fmt.get("syntax"), fmt.get("definition")
        if kind == "grammar" and syntax in ("lark", "regex") and isinstance(definition, str) and definition:
            grammar = definition if syntax == "lark" else (
                "start: /" + definition.replace("/", "\\/").replace("\n", "\\n") + "/")
            if len(grammar) > MAX_GRAMMAR_CHARS:
                raise invalid(f"{where}.format.definition: longer than {MAX_GRAMMAR_CHARS:,} characters",
                              param="tools")
        elif kind != "text" or len(fmt) > 1:
            raise invalid(f'{where}.format: must be {{"type": "text"}} or {{"type": "grammar", "syntax": "lark"'
                          ' or "regex", "definition": ...}}', param="tools")
    return ToolSpec(name=name, description=optional(raw.get("description"), str, f"{where}.description", "tools") or "",
                    parameters=freeform_parameters(grammar), strict=True, grammar=grammar)


def _call_names(value: Any) -> dict[str, CallName]:
    """The call items' names of a request's (valid) tools whose calls are not plain functions: a
    namespace's (by their qualified names) and custom tools."""
    names: dict[str, CallName] = {}
    for tool in value or ():
        if tool.get("type") == "custom":
            names[tool["name"]] = CallName(tool["name"], custom=True)
        if tool.get("type") == "namespace":
            for inner in tool["tools"]:
                names[qualified(tool["name"], inner["name"])] = CallName(inner["name"], tool["name"],
                                                                         inner["type"] == "custom")
    return names


def _grammars(value: Any, tools: tuple[ToolSpec, ...]) -> tuple[tuple[str, str], ...]:
    """The grammar of each of a request's (valid) ``custom`` tools that has one, as
    :func:`_custom_tool` made it, by the field that holds it (``tools[i].format.definition``, in a
    namespace ``tools[i].tools[j].format.definition``)."""
    grammar = {tool.name: tool.grammar for tool in tools if tool.grammar}
    fields = []
    for i, tool in enumerate(value or ()):
        inner = [(f"tools[{i}].tools[{j}]", qualified(tool["name"], t["name"]), t)
                 for j, t in enumerate(tool["tools"])] if tool.get("type") == "namespace" else []
        for where, name, raw in [(f"tools[{i}]", tool.get("name"), tool), *inner]:
            if raw.get("type") == "custom" and name in grammar:
                fields.append((f"{where}.format.definition", grammar[name]))
    return tuple(fields)


def _tool_echo(value: Any, tools: tuple[ToolSpec, ...]) -> tuple[dict[str, Any], ...]:
    """The request's tools as a Response object echoes them (``Response.tools``): functions as
    validated (:func:`_tool_json`), every other tool as sent."""
    specs = {tool.name: tool for tool in tools}
    return tuple(_tool_json(specs[tool["name"]]) if tool.get("type") == "function" else tool for tool in value or ())


def _named_function(value: dict[str, Any]) -> str:
    """The name of a named ``tool_choice`` (``ToolChoiceFunctionParam``, or ``ToolChoiceCustomParam``
    read as one)."""
    TOOL_CHOICE_FIELDS.check(value, "tool_choice", param="tool_choice")
    return tool_name(value.get("name"), "tool_choice.name", "tool_choice")


def _text_format(value: Any) -> tuple[OutputFormat, dict[str, Any]]:
    """``text.format`` (:data:`FORMAT_FIELDS`): the output format and the object to echo."""
    if value is None:
        return OutputFormat(), {"type": "text"}
    value = FORMAT_FIELDS.object(value, "text.format", "text")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        extra = sorted(set(value) - {"type"})
        if extra:
            raise invalid(f"text.format.{extra[0]}: not allowed with type {kind!r}", param="text")
        return OutputFormat(OutputKind(kind)), {"type": kind}
    if kind != "json_schema":
        raise invalid('text.format.type: must be "text", "json_object" or "json_schema"', param="text")
    if value.get("schema") is None:
        raise invalid("text.format.schema: field required", param="text")
    return schema_format(value, "text.format", "text"), value


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
        part_type = part.get("type")
        table = PART_FIELDS.get(part_type) if isinstance(part_type, str) else None
        if table is None:
            raise invalid(f"{where}[{j}]: content parts of type {str(part_type)[:60]!r} are not supported"
                          " by ringserve (only input_text and output_text)", param="input")
        table.check(part, f"{where}[{j}]", param="input")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text: must be a string", param="input")
        parts.append(text)
    return "".join(parts)


def _reasoning(value: Any) -> tuple[ReasoningConfig, str | None, str | None]:
    """``reasoning`` (:data:`REASONING_FIELDS`): the reasoning controls (``surfaces/base.py``
    ``reasoning_effort``), and the effort and summary that the Response object echoes.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``reasoning``.
    """
    if value is None:
        return ReasoningConfig(), None, None
    value = REASONING_FIELDS.object(value, "reasoning", "reasoning")
    summary = value.get("summary") or value.get("generate_summary")
    if summary is not None and summary not in SUMMARIES:
        raise invalid(f"reasoning.summary: must be one of {', '.join(SUMMARIES)}", param="reasoning")
    effort = value.get("effort")
    return reasoning_effort(effort, "reasoning.effort"), effort, summary


def _include(value: Any) -> frozenset[str]:
    """``include``: which of :data:`ENCRYPTED_CONTENT` and :data:`OUTPUT_LOGPROBS` it asks for;
    its other values are reported.

    Raises:
        RingserveError: ``INVALID_REQUEST``: not a list of strings.
    """
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid("include: must be a list of strings", param="include")
    for i, item in enumerate(value):
        if item not in (ENCRYPTED_CONTENT, OUTPUT_LOGPROBS):
            report_ignored(f"include[{i}]")
    return frozenset(value) & {ENCRYPTED_CONTENT, OUTPUT_LOGPROBS}


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


def _tool_choice(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """``tool_choice`` and ``parallel_tool_calls``; a ``custom`` tool is named as a function is."""
    value = body.get("tool_choice")
    if isinstance(value, dict) and value.get("type") == "custom":
        value = {**value, "type": "function"}
    return openai_tool_choice(value, tools, named=_named_function, parallel=get_bool(body, "parallel_tool_calls", True))


def _delivery(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream`` (with its ``stream_options``), ``background`` and ``store``, checked together."""
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
    return stream, background, store


def parse_create(body: Any) -> ResponseCreate:
    """Validate a ``POST /v1/responses`` body (also the body of ``POST /v1/responses/input_tokens``).

    Fields as :data:`REQUEST_FIELDS` lists them: ``model``, ``input`` (a
    string, or message items of role user/system/developer/assistant with
    ``input_text``/``output_text`` parts; :data:`ITEM_FIELDS`,
    :data:`PART_FIELDS`; ``function_call`` and ``custom_tool_call`` items, :data:`CALL_ITEM_FIELDS`,
    :data:`CUSTOM_CALL_ITEM_FIELDS`, with a new ``call_id`` and ``arguments`` JSON text of an
    object or an ``input`` text; their output items, :data:`OUTPUT_ITEM_FIELDS`, whose ``call_id``
    is an earlier call's, here or in the previous responses; reasoning items: :func:`_input_items`),
    ``tools`` (at most :data:`~ringserve.surfaces.base.MAX_TOOLS` tools as the model sees them,
    distinct names: functions, :data:`TOOL_FIELDS`, ``parameters`` an object schema; custom and
    namespace tools; hosted tools left out: :func:`_tool`), ``tool_choice`` (``none``, ``auto``,
    ``required``, ``{"type": "function" or "custom", "name": ...}``),
    ``parallel_tool_calls``, ``instructions`` (a system turn first; not carried
    over by ``previous_response_id``, as OpenAI documents), ``max_output_tokens``
    (1 to 1,000,000; more than the context leaves: until the context is full),
    ``temperature`` (0–2), ``top_p``, ``stream``, ``stream_options``
    (only with ``stream``), ``background``, ``store`` (``background`` needs
    it, as OpenAI's API requires), ``metadata`` (16 string pairs),
    ``previous_response_id``, ``prompt_cache_key`` (the prefix cache's slot choice prefers the
    slot its key last used), ``text`` (``format``: ``text``, ``json_object``, or
    ``json_schema`` with ``name``, ``schema``, ``strict``; :data:`FORMAT_FIELDS`), ``include``
    (:data:`ENCRYPTED_CONTENT`, :data:`OUTPUT_LOGPROBS`) and ``top_logprobs`` (0..20); and
    llama.cpp's server's other samplers as extensions (``surfaces/base.py``
    :func:`~ringserve.surfaces.base.sampling_params`). Unknown fields are accepted and reported;
    ``mcp`` tools, items of tools ringserve has no equivalent for and unknown item types are
    refused.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the offending field.
    """
    body = require_object(body)
    REQUEST_FIELDS.check(body)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise invalid("text: must be an object", param="text")
    TEXT_FIELDS.check(text or {}, "text", param="text")
    output, text_format = _text_format((text or {}).get("format"))
    if "input" not in body or body["input"] is None:
        raise invalid("input: field required", param="input")
    messages, answers = _input_items(body["input"])
    tools = tool_list(body.get("tools"), "tools", _tool)
    choice = _tool_choice(body, tools)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions: must be a string (a list of items is not supported)", param="instructions")
    stream, background, store = _delivery(body)
    previous = get_str(body, "previous_response_id") or None
    max_tokens = get_int(body, "max_output_tokens", lo=1, hi=MAX_OUTPUT_TOKENS_LIMIT)
    sampling = sampling_params(body, max_temperature=2.0)
    reasoning, effort, summary = _reasoning(body.get("reasoning"))
    include = _include(body.get("include"))
    top_logprobs = get_int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    request = check_enforced(GenerationRequest(messages=messages, max_tokens=max_tokens, sampling=sampling,
                                               tools=tools, tool_choice=choice, output=output, reasoning=reasoning,
                                               template_kwargs=template_kwargs(body),
                                               cache_key=get_str(body, "prompt_cache_key"),
                                               logprobs=(top_logprobs or 0) if OUTPUT_LOGPROBS in include else None),
                             "tools[{i}].parameters", "text.format.schema")
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
            tools=tools,
            tool_choice=choice,
            text_format=text_format,
            tool_echo=_tool_echo(body.get("tools"), tools),
            calls=_call_names(body.get("tools")),
            effort=effort,
            summary=summary,
            encrypted_content=ENCRYPTED_CONTENT in include,
            top_logprobs=top_logprobs,
        ),
        input=messages,
        parsed=ParsedRequest(request=request, stream=stream, model=get_str(body, "model"),
                             grammars=_grammars(body.get("tools"), tools)),
        answers=answers,
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


def options_echo(body: dict[str, Any], keep_prompts: bool) -> str:
    """What the store keeps of a request for the objects and streams that echo it (the
    ``echo`` of :meth:`ResponsesSurface.restored`): the body but its ``input``, and but its
    ``instructions`` unless ``keep_prompts`` (they are prompt text; ``metadata`` is not, and is
    kept). JSON text."""
    dropped = {"input"} if keep_prompts else {"input", "instructions"}
    return json.dumps({k: v for k, v in body.items() if k not in dropped}, ensure_ascii=False, separators=(",", ":"))


def echoed_options(echo: str) -> ResponseOptions:
    """The options an :func:`options_echo` text gives (defaults for "" or a body that no longer
    parses)."""
    if not echo:
        return ResponseOptions()
    try:
        return parse_create({**json.loads(echo), "input": "-"}).options  # the echo keeps no input
    except (ValueError, RingserveError):
        return ResponseOptions()


def stored_create(request_json: str) -> ResponseCreate | None:
    """The parsed request of a stored response, or None when the store kept no prompt
    (``[store] keep_prompts = false``) or its body no longer parses."""
    if not request_json:
        return None
    try:
        return parse_create(json.loads(request_json))
    except (ValueError, RingserveError):
        return None


#: The most responses a ``previous_response_id`` chain may go back.
MAX_CHAIN = 256


def parsed_request(create: ResponseCreate, body: dict[str, Any]) -> ParsedRequest:
    """A parsed create (or count) as the surface-neutral request: ``background``, ``store`` and
    the echo (the body but its ``input``: :func:`options_echo`) as its fields, and a
    ``previous_response_id`` as its :class:`~ringserve.surfaces.base.Continuation`."""
    options = create.options
    parsed = attrs.evolve(create.parsed, background=options.background, store=options.store,
                          echo=options_echo(body, True), echo_without_prompts=options_echo(body, False))
    previous = options.previous_response_id
    if previous is None:
        return attrs.evolve(parsed, request=create.generation().request)

    def apply(history: tuple[ChatMessage, ...]) -> ParsedRequest:
        return attrs.evolve(parsed, request=create.generation(history).request)

    return attrs.evolve(parsed, continues=Continuation(previous, functools.partial(conversation, previous), apply))


def not_found(response_id: str) -> RingserveError:
    """OpenAI's 404 for an unknown response (``Response with id '...' not found.``), with why."""
    return RingserveError(ErrorKind.NOT_FOUND, f"Response with id {response_id[:80]!r} not found: the id is unknown,"
                          " was deleted, or passed the store's retention ([store] max_age_seconds, max_bytes)")


def conversation(previous_id: str, load: LoadStored, max_bytes: int) -> tuple[ChatMessage, ...]:
    """The conversation a ``previous_response_id`` continues: oldest response first, each with its
    input turns and its output (not its ``instructions``, as OpenAI documents). It blocks (``load``
    reads the store): the shell runs it on a worker thread.

    Args:
        previous_id: the response continued.
        load: reads a stored response (:data:`~ringserve.surfaces.base.LoadStored`).
        max_bytes: the most bytes of stored request bodies and outputs the chain may hold in all
            (``server.max_body_bytes``, the bound of one request body).

    Raises:
        RingserveError: ``NOT_FOUND`` (an unknown id), ``INVALID_REQUEST`` (a response still in
        progress, or whose request was not kept; a chain longer than :data:`MAX_CHAIN`, or a loop,
        or larger than ``max_bytes``; an output that ends in the middle of a function call).
    """
    turns: list[tuple[ChatMessage, ...]] = []
    seen: set[str] = set()
    size = 0
    next_id: str | None = previous_id
    while next_id is not None:
        if next_id in seen or len(seen) >= MAX_CHAIN:
            raise invalid(f"previous_response_id: the chain of previous responses is longer than {MAX_CHAIN}",
                          param="previous_response_id")
        seen.add(next_id)
        stored = load(next_id) if next_id.startswith(ResponsesSurface.id_prefix) else None
        if stored is None:
            raise RingserveError(ErrorKind.NOT_FOUND, f"previous_response_id: {not_found(next_id)}",
                                 param="previous_response_id")
        view, request_json = stored
        if not view.status.final:
            raise invalid(f"previous_response_id: response {next_id} is still in progress",
                          param="previous_response_id")
        size += len(request_json) + sum(len(b.text) for b in view.content)
        if size > max_bytes:
            raise invalid(f"previous_response_id: the conversation of the previous responses is larger than"
                          f" server.max_body_bytes ({max_bytes} bytes)", param="previous_response_id")
        create = stored_create(request_json)
        if create is None:
            raise invalid(f"previous_response_id: the input of {next_id} is not kept ([store] keep_prompts = false)",
                          param="previous_response_id")
        turns.append(create.input + history_messages(view.content, next_id))
        next_id = create.options.previous_response_id
    return tuple(m for turn in reversed(turns) for m in turn)


def starting_after(raw: str | None) -> int | None:
    """The ``starting_after`` query parameter of a resume: the last ``sequence_number`` seen.

    Raises:
        RingserveError: ``INVALID_REQUEST`` unless it is a non-negative integer.
    """
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit():
        raise invalid(f"starting_after: must be a non-negative integer, got {raw[:40]!r}", param="starting_after")
    return int(raw)


def resume_error(error: RingserveError, response_id: str, starting_after: int | None) -> RingserveError:
    """A resume's error as the Responses routes spell it: an event never sent named by
    ``starting_after`` (None: the resume named none, or ``Last-Event-ID`` won), and a log that
    expired pointing at the response's own route."""
    if error.kind is ErrorKind.INVALID_REQUEST and starting_after is not None:
        return invalid(f"starting_after: no event {starting_after} was sent in this stream", param="starting_after")
    if error.kind is ErrorKind.GONE:  # a row written before schema 5, or a live log longer than the ring
        return RingserveError(ErrorKind.GONE, f"the event log of {response_id} has expired or left the ring;"
                              f" GET /v1/responses/{response_id} has the response")
    return error


def cancel_refusal(view: MessageView) -> RingserveError | None:
    """Why the response of ``view`` cannot be cancelled (None: it can): only a background response
    that is queued or in progress (or was cancelled: the same object again) can."""
    # (a response stored before schema 5 whose request was not kept may have been a background one)
    known = view.live or view.echo != ""
    if known and not echoed_options(view.echo).background:
        return invalid(f"response {view.id} was not created with background: true; only background"
                       " responses can be cancelled")
    if view.status is not MessageStatus.CANCELLED and view.status.final:  # (live until it is retired)
        status = status_outcome(view.status, view.stop_reason, view.error, background=True).status
        return invalid(f"response {view.id} is already {status}; only a queued or in-progress response"
                       " can be cancelled")
    return None


# -- the Response object ---------------------------------------------------------------------


def item_id(response_id: str, index: int = 0) -> str:
    """The id of output item ``index`` (the message's content block ``index``): ``msg_`` and the
    response id's own part, with ``_<index>`` after the first."""
    return "msg_" + response_id.removeprefix("resp_") + (f"_{index}" if index else "")


def reasoning_item_id(response_id: str, index: int = 0) -> str:
    """The id of output item ``index`` when it is a reasoning item: ``rs_`` and the response id's
    own part, with ``_<index>`` after the first (as :func:`item_id`)."""
    return "rs_" + response_id.removeprefix("resp_") + (f"_{index}" if index else "")


def usage_json(usage: Usage) -> dict[str, Any]:
    """``ResponseUsage``: ``input_tokens`` counts the whole prompt, of which ``cached_tokens``
    came from the prompt-prefix cache; ringserve writes no billed cache (``cache_write_tokens`` 0);
    ``reasoning_tokens`` are the output tokens of the model's thinking."""
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def _text_part(text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
    """An ``output_text`` part (``ResponseOutputText``), with its tokens' log probabilities
    (``include: ["message.output_text.logprobs"]``; bytes included, as its type has them)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": [logprob_json(lp) for lp in logprobs]}


def _delta_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """The ``logprobs`` of ``response.output_text.delta`` and ``.done`` (their ``Logprob`` has no bytes)."""
    return [logprob_json(lp, with_bytes=False) for lp in logprobs]


def _reasoning_part(text: str) -> dict[str, Any]:
    """A reasoning item's ``content`` part (``Content``: ``reasoning_text``)."""
    return {"type": "reasoning_text", "text": text}


def _summary_part(text: str) -> dict[str, Any]:
    """A reasoning item's ``summary`` part (``Summary``: ``summary_text``)."""
    return {"type": "summary_text", "text": text}


@attrs.frozen
class ReasoningItems:
    """How a response spells its reasoning items (``ResponseReasoningItem``), from its request.

    The reasoning text is the item's one ``content`` part (``reasoning_text``), as the gpt-oss
    reference server and vLLM give it; or, when the request asks for a ``summary``
    (``reasoning.summary``: :data:`SUMMARIES`), its one ``summary`` part instead: no model here
    summarises its reasoning, so the summary is the whole text, once (Codex shows summaries).
    With ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``) a whole item carries
    the text sealed under the server's key (``core/signing.py``), which a later request restores
    into its prompt when it sends the item back, with ``store: false`` as well
    (:func:`_reasoning_text`). ``signer`` is None for a surface not
    :meth:`~ResponsesSurface.restored` (the registry's): it seals nothing.
    """

    signer: ReasoningSigner | None
    summary: bool = False
    encrypted_content: bool = False

    def part(self, text: str) -> dict[str, Any]:
        """The part that holds the text (:meth:`item`'s one)."""
        return _summary_part(text) if self.summary else _reasoning_part(text)

    def item(self, response_id: str, index: int, text: str, status: str, *, started: bool = True) -> dict[str, Any]:
        """Output item ``index`` with the reasoning ``text`` (not ``started``: the item as
        ``response.output_item.added`` gives it, no part and no encrypted content yet).

        Raises:
            RuntimeError: its encrypted content is asked for, and there is no signer.
        """
        parts = [self.part(text)] if started else []
        item: dict[str, Any] = {"id": reasoning_item_id(response_id, index), "type": "reasoning",
                                "summary": parts if self.summary else []}
        if not self.summary:
            item["content"] = parts
        if self.encrypted_content and started:
            if self.signer is None:
                raise RuntimeError("a message's surface is restored(echo, signer) before it renders its reasoning")
            item["encrypted_content"] = self.signer.seal(text)
        return {**item, "status": status}


def call_item_id(call_id: str, custom: bool = False) -> str:
    """The output item id of a call: ``fc_`` (a ``custom_tool_call``'s: ``ctc_``) and the call's
    neutral 24 hex digits (its ``call_id`` is ``call_`` and the same digits, as on Chat Completions)."""
    return ("ctc_" if custom else "fc_") + call_id


class FreeformInput:
    """The input text of a freeform call (``custom_tool_call``), decoded from its arguments' JSON
    text ``{"input": "..."}`` as the fragments come (:meth:`feed`: the text they add).

    The head up to the string's opening quote is matched first (spaces allowed, as JSON allows
    them); an escape cut between two fragments waits for its end. Arguments of another shape
    (not what a freeform tool's grammar lets the model write) turn it ``off``: it adds nothing
    more, as after the string's end (``ended``).
    """

    _HEAD = re.compile(r'\s*\{\s*"' + FREEFORM_ARGUMENT + r'"\s*:\s*"')
    _ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4}|u(?![dD][89abAB])[0-9a-fA-F]{4})')

    def __init__(self) -> None:
        self._pending = ""  # the head so far, or an escape cut short
        self._in_string = False
        self.off = False  # the arguments are not {"input": "..."}
        self.ended = False  # the string ended: the rest is the object's end

    def feed(self, fragment: str) -> str:
        if self.off or self.ended:
            return ""
        text, self._pending = self._pending + fragment, ""
        if not self._in_string:
            head = self._HEAD.match(text)
            if head is None:
                self.off = not self._head_prefix(text)
                self._pending = "" if self.off else text
                return ""
            self._in_string, text = True, text[head.end():]
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c == '"':
                self.ended = True
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            escape = self._ESCAPE.match(text, i)
            if escape is None:
                if len(text) - i < 12:  # maybe cut short: wait for the rest
                    self._pending = text[i:]
                else:
                    self.off = True
                break
            out.append(json.loads(f'"{escape.group()}"'))
            i = escape.end()
        return "".join(out)

    @staticmethod
    def _head_prefix(text: str) -> bool:
        """Whether ``text`` may still become the head (it is a prefix of one)."""
        rest = text.lstrip()
        for part in ("{", f'"{FREEFORM_ARGUMENT}"', ":", '"'):
            if len(rest) <= len(part):
                return part.startswith(rest)
            if not rest.startswith(part):
                return False
            rest = rest[len(part):].lstrip()
        return True


def freeform_input(arguments: str) -> str:
    """A freeform call's input text from its arguments' JSON text (``{"input": text}``): the text
    so far while they are cut (a call still streaming, or cut by ``max_output_tokens``), and the
    arguments as they are when they hold no such text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        stream = FreeformInput()
        text = stream.feed(arguments)
        return arguments if stream.off else text
    if isinstance(value, dict) and isinstance(value.get(FREEFORM_ARGUMENT), str):
        return str(value[FREEFORM_ARGUMENT])
    return arguments


def _item(response_id: str, index: int, block: ContentBlock, status: str, options: ResponseOptions,
          reasoning: ReasoningItems, *, started: bool = True) -> dict[str, Any]:
    """Output item ``index``: an assistant message (``ResponseOutputMessage``; not ``started``: no
    part yet) for a text block; for a call a ``function_call`` (``ResponseFunctionToolCall``), or a
    ``custom_tool_call`` (``ResponseCustomToolCall``, its ``input`` the text) of a custom tool,
    with its ``namespace`` in one (``options.call_name``); a reasoning item for a reasoning block
    (:class:`ReasoningItems`)."""
    match block.kind:
        case BlockKind.TEXT:
            return {"id": item_id(response_id, index), "type": "message", "role": "assistant", "status": status,
                    "content": [_text_part(block.text, block.logprobs)] if started else []}
        case BlockKind.TOOL_CALL:
            name = options.call_name(block.name)
            item: dict[str, Any] = {"id": call_item_id(block.call_id, name.custom),
                                    "call_id": tool_call_id(block.call_id), "name": name.name}
            if name.namespace is not None:
                item["namespace"] = name.namespace
            if name.custom:
                return {**item, "type": "custom_tool_call", "input": freeform_input(block.text)}
            return {**item, "type": "function_call", "arguments": block.text, "status": status}
        case BlockKind.REASONING:
            return reasoning.item(response_id, index, block.text, status, started=started)
        case _:
            assert_never(block.kind)


def output_json(response_id: str, blocks: tuple[ContentBlock, ...], last_status: str,
                options: ResponseOptions, reasoning: ReasoningItems) -> list[dict[str, Any]]:
    """``Response.output``: one item per block (a message per text block, a call item per call, a
    reasoning item per reasoning block: :func:`_item`); every item but the last is ``completed``,
    the last one has ``last_status`` (the response's outcome)."""
    return [_item(response_id, i, block, "completed" if i < len(blocks) - 1 else last_status, options, reasoning)
            for i, block in enumerate(blocks)]


def history_messages(blocks: tuple[ContentBlock, ...], where: str) -> tuple[ChatMessage, ...]:
    """A stored response's output as the conversation turn it adds (``previous_response_id``):
    one assistant turn with its text, its function calls (``call_id`` as sent: ``call_...``) and
    its reasoning (its reasoning blocks joined by a blank line); none when the output is empty.

    Raises:
        RingserveError: ``INVALID_REQUEST`` (``param`` ``previous_response_id``) for a call whose
            arguments are not a JSON object (the response ended in the middle of it).
    """
    text = "".join(b.text for b in blocks if b.kind is BlockKind.TEXT)
    calls = tuple(ToolCall(tool_call_id(b.call_id), b.name, _whole_arguments(b, where, i))
                  for i, b in enumerate(blocks) if b.kind is BlockKind.TOOL_CALL)
    reasoning = "\n\n".join(b.text for b in blocks if b.kind is BlockKind.REASONING)
    return (ChatMessage("assistant", text, tool_calls=calls, reasoning=reasoning),) if text or calls else ()


def _whole_arguments(call: ContentBlock, response_id: str, index: int) -> str:
    """A stored call's arguments, which are whole JSON unless the response ended in the middle of
    the call: then the conversation cannot go on from it (its call cannot be answered, nor sent to
    the model again as it was), and the 400 says so."""
    try:
        return arguments_json(call.text, f"{response_id}.output[{index}].arguments", "previous_response_id")
    except RingserveError:
        raise invalid(f"previous_response_id: response {response_id} ended in the middle of its call of"
                      f" {call.name!r} (output[{index}]: cut by max_output_tokens, cancelled, or interrupted"
                      " by a drain or a crash), so its arguments are not a whole JSON object and no"
                      " conversation can go on from it; continue from the response before it, or send"
                      " the conversation as input", param="previous_response_id") from None


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
            return Outcome("failed", error=failure_error(ErrorKind.API_ERROR, error or INTERRUPTED_MESSAGE))
        case _:
            assert_never(status)


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    """A request's function tool as the Response object echoes it (``FunctionTool``)."""
    return {"type": "function", "name": tool.name, "description": tool.description or None,
            "parameters": json.loads(tool.parameters), "strict": tool.strict}


def _tool_choice_json(choice: ToolChoice, options: ResponseOptions) -> str | dict[str, str]:
    """A request's tool choice as the Response object echoes it (``ToolChoiceOptions``,
    ``ToolChoiceFunction``, ``ToolChoiceCustom``)."""
    match choice.mode:
        case ToolChoiceMode.NAMED:
            return {"type": "custom" if options.call_name(choice.name).custom else "function", "name": choice.name}
        case ToolChoiceMode.AUTO | ToolChoiceMode.NONE | ToolChoiceMode.REQUIRED:
            return choice.mode.value
        case _:
            assert_never(choice.mode)


def response_json(
    response_id: str,
    *,
    model: str,
    created: int,
    options: ResponseOptions,
    outcome: Outcome,
    blocks: tuple[ContentBlock, ...],
    usage: Usage | None,
    reasoning: ReasoningItems,
) -> dict[str, Any]:
    """The ``Response`` object (``openai.types.responses.Response``).

    Args:
        blocks: the content blocks so far (:func:`output_json`).
        usage: None until the response has ended.
        reasoning: how its reasoning items are spelled.
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
        "output": output_json(response_id, blocks, outcome.item_status, options, reasoning),
        "parallel_tool_calls": options.tool_choice.parallel,
        "previous_response_id": options.previous_response_id,
        "reasoning": {"effort": options.effort, "summary": options.summary},
        "temperature": options.temperature,
        "text": {"format": options.text_format},
        "tool_choice": _tool_choice_json(options.tool_choice, options),
        "tools": list(options.tool_echo),
        "top_logprobs": options.top_logprobs,
        "top_p": options.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else usage_json(usage),
    }


# -- rendering --------------------------------------------------------------------------------


class ResponsesRenderer:
    """Renders one response's events as typed Responses stream events (``numbered``: the producer
    puts each one's seq in its ``sequence_number``).

    Each content block is an output item (``output_index`` = the block's index): a text block a
    message item with one ``output_text`` part; a tool call a ``function_call`` item whose
    arguments stream as ``response.function_call_arguments.delta`` events (a custom tool's a
    ``custom_tool_call`` whose input streams as ``response.custom_tool_call_input.delta``); a
    reasoning block a reasoning item (:class:`ReasoningItems`) with one ``reasoning_text`` part
    whose text streams as ``response.reasoning_text.delta`` events (``response.content_part.added``
    before them, ``response.reasoning_text.done`` and ``response.content_part.done`` after, as the
    gpt-oss reference server sends them), or, when the request asks for a summary, one
    ``summary_text`` part (``response.reasoning_summary_part.added``,
    ``response.reasoning_summary_text.delta``..., ``.done``, ``response.reasoning_summary_part.done``).
    A stopped block's done events wait for what follows: the next block (the item is
    ``completed``) or the end of the generation (the item has the response's outcome:
    ``incomplete`` after a cut or a cancel). A failure closes nothing: ``response.failed`` follows
    the last delta, and the item it interrupted (or the stopped block whose done events waited)
    gets no done events; the failed response's ``output`` holds it as far as it got,
    ``incomplete``. A client builds its history from ``response.output_item.done`` (Codex does,
    ``codex-rs/codex-api/src/sse/responses.rs``) and retries a failed response whole: a done
    event would have made the partial item a finished one that the retry sends back (issue 43,
    item 12). The openai SDK's stream accumulator expects the same, filling a failed response's
    output with the items it saw added but not done.
    """

    def __init__(self, response_id: str, model: str, created: int, options: ResponseOptions,
                 reasoning: ReasoningItems) -> None:
        self._id, self._model, self._created, self._options = response_id, model, created, options
        self._reasoning = reasoning
        self._starts: list[BlockStart] = []  # each block's start
        self._items: list[list[str]] = []  # the text (or argument fragments) of each block
        self._logprobs: list[list[TokenLogprob]] = []  # the log probabilities of each block's tokens
        self._inputs: dict[int, FreeformInput] = {}  # the freeform calls' input decoders, by block
        self._open: int | None = None  # a block started and not stopped
        self._stopped: int | None = None  # a stopped block whose done events are due

    def _event(self, type_: str, **fields: Any) -> WireEvent:
        """An event whose ``sequence_number`` is its seq, which the producer fills in (``numbered``)."""
        return WireEvent(dumps({"type": type_, "sequence_number": SEQ_VALUE, **fields}), event=type_, numbered=True)

    def _block(self, index: int) -> ContentBlock:
        start = self._starts[index]
        return ContentBlock(start.kind, "".join(self._items[index]), start.name, start.call_id,
                            tuple(self._logprobs[index]))

    def _response(self, outcome: Outcome, usage: Usage | None) -> dict[str, Any]:
        blocks = tuple(self._block(i) for i in range(len(self._starts)))
        return response_json(self._id, model=self._model, created=self._created, options=self._options,
                             outcome=outcome, blocks=blocks, usage=usage, reasoning=self._reasoning)

    def _where(self, index: int) -> dict[str, Any]:
        """The position fields of a text event (item, output index, content part 0)."""
        return {"item_id": item_id(self._id, index), "output_index": index, "content_index": 0}

    def _call_where(self, index: int) -> dict[str, Any]:
        """The position fields of a call's arguments (or freeform input) event."""
        return {"item_id": call_item_id(self._starts[index].call_id, index in self._inputs), "output_index": index}

    def _thought_where(self, index: int) -> dict[str, Any]:
        """The position fields of a reasoning event (item, output index, part 0 of its content or
        its summary)."""
        part = "summary_index" if self._reasoning.summary else "content_index"
        return {"item_id": reasoning_item_id(self._id, index), "output_index": index, part: 0}

    def start(self, usage: Usage) -> list[WireEvent]:
        first = Outcome("queued" if self._options.background else "in_progress")
        events = [self._event("response.created", response=self._response(first, None))]
        if self._options.background:
            events.append(self._event("response.queued", response=self._response(first, None)))
        events.append(self._event("response.in_progress", response=self._response(Outcome("in_progress"), None)))
        return events

    def block_start(self, start: BlockStart) -> list[WireEvent]:
        events = self._close("completed")
        self._starts.append(start)
        self._items.append([])
        self._logprobs.append([])
        self._open = start.index
        if start.kind is BlockKind.TOOL_CALL and self._options.call_name(start.name).custom:
            self._inputs[start.index] = FreeformInput()
        item = _item(self._id, start.index, self._block(start.index), "in_progress", self._options, self._reasoning,
                     started=False)
        events.append(self._event("response.output_item.added", output_index=start.index, item=item))
        match start.kind:
            case BlockKind.TEXT:
                events.append(self._event("response.content_part.added", part=_text_part(""),
                                          **self._where(start.index)))
            case BlockKind.REASONING:
                added = "response.reasoning_summary_part.added" if self._reasoning.summary else (
                    "response.content_part.added")
                events.append(self._event(added, part=self._reasoning.part(""), **self._thought_where(start.index)))
            case BlockKind.TOOL_CALL:
                pass
            case _:
                assert_never(start.kind)
        return events

    def delta(self, delta: BlockDelta) -> list[WireEvent]:
        self._items[delta.index].append(delta.text)
        match self._starts[delta.index].kind:
            case BlockKind.TEXT:
                self._logprobs[delta.index] += delta.logprobs
                return [self._event("response.output_text.delta", delta=delta.text,
                                    logprobs=_delta_logprobs(delta.logprobs), **self._where(delta.index))]
            case BlockKind.REASONING:
                kind = "response.reasoning_summary_text.delta" if self._reasoning.summary else (
                    "response.reasoning_text.delta")
                return [self._event(kind, delta=delta.text, **self._thought_where(delta.index))]
            case BlockKind.TOOL_CALL:
                return self._call_delta(delta)
            case _:
                assert_never(self._starts[delta.index].kind)

    def _call_delta(self, delta: BlockDelta) -> list[WireEvent]:
        """A call's arguments fragment: its freeform input's text so far, or the fragment."""
        if delta.index in self._inputs:
            text = self._inputs[delta.index].feed(delta.text)
            return [self._event("response.custom_tool_call_input.delta", delta=text,
                                **self._call_where(delta.index))] if text else []
        if not delta.text:
            return []
        return [self._event("response.function_call_arguments.delta", delta=delta.text,
                            **self._call_where(delta.index))]

    def block_stop(self, stop: BlockStop) -> list[WireEvent]:
        self._open, self._stopped = None, stop.index
        return []

    def _close(self, item_status: str) -> list[WireEvent]:
        """The done events of the block that is stopped (or, at a finish, still open: a cancel's)."""
        index = self._stopped if self._stopped is not None else self._open
        if index is None:
            return []
        self._open = self._stopped = None
        block = self._block(index)
        match block.kind:
            case BlockKind.TOOL_CALL if index in self._inputs:
                events = [self._event("response.custom_tool_call_input.done", input=freeform_input(block.text),
                                      **self._call_where(index))]
            case BlockKind.TOOL_CALL:
                events = [self._event("response.function_call_arguments.done", arguments=block.text,
                                      **self._call_where(index))]
            case BlockKind.TEXT:
                events = [
                    self._event("response.output_text.done", text=block.text, logprobs=_delta_logprobs(block.logprobs),
                                **self._where(index)),
                    self._event("response.content_part.done", part=_text_part(block.text, block.logprobs),
                                **self._where(index)),
                ]
            case BlockKind.REASONING:
                where, part = self._thought_where(index), self._reasoning.part(block.text)
                if self._reasoning.summary:
                    events = [self._event("response.reasoning_summary_text.done", text=block.text, **where),
                              self._event("response.reasoning_summary_part.done", part=part, **where)]
                else:
                    events = [self._event("response.reasoning_text.done", text=block.text, **where),
                              self._event("response.content_part.done", part=part, **where)]
            case _:
                assert_never(block.kind)
        return [*events, self._event("response.output_item.done", output_index=index,
                                     item=_item(self._id, index, block, item_status, self._options, self._reasoning))]

    def finish(self, finish: Finish) -> list[WireEvent]:
        outcome = finish_outcome(finish.stop_reason)
        terminal = "response.completed" if outcome.status == "completed" else "response.incomplete"
        return [*self._close(outcome.item_status), self._event(terminal, response=self._response(outcome, finish.usage))]

    def fail(self, failure: Failure) -> list[WireEvent]:
        """``response.failed`` alone: the item in progress stays unfinished (see the class doc)."""
        outcome = Outcome("failed", error=failure_error(failure.kind, failure.message))
        return [self._event("response.failed", response=self._response(outcome, failure.usage))]

    def keepalive(self) -> list[WireEvent]:
        """``response.in_progress`` again, with the response as streamed so far (its id, every
        output item with its text or arguments so far): Codex resets its idle timer on it and
        ignores it, the OpenAI Node SDK's stream helper replaces its snapshot with it and the
        Python one checks its id (docs/agents.md, "Keepalives")."""
        return [self._event("response.in_progress", response=self._response(Outcome("in_progress"), None))]


class ResponsesSurface:
    """The OpenAI Responses API: one instance per message carries what its objects echo.

    The module's :data:`RESPONSES` (default options) parses requests and answers errors; the
    hub and the routes take the one :meth:`restored` from a message's echo, which renders its
    stream and spells its objects with the message's own :class:`ResponseOptions`.
    """

    name = "responses"
    id_prefix = "resp_"
    prefer_respond_async = False  # background: true instead
    refuses_lone_surrogates = True  # the object echoes request fields

    def __init__(self, options: ResponseOptions = ResponseOptions(), signer: ReasoningSigner | None = None) -> None:
        self.options = options
        self.signer = signer

    def restored(self, echo: str, signer: ReasoningSigner) -> ResponsesSurface:
        """The surface of a response whose request left ``echo`` (:func:`options_echo`), sealing
        its reasoning with ``signer``."""
        return ResponsesSurface(echoed_options(echo), signer)

    def _reasoning(self) -> ReasoningItems:
        return ReasoningItems(self.signer, self.options.summary is not None, self.options.encrypted_content)

    def edited(self, echo: str, applied: tuple[AppliedEdit, ...]) -> str:
        """``echo``: no Responses request has context edits yet."""
        return echo

    def parse_request(self, body: Any) -> ParsedRequest:
        """A ``POST /v1/responses`` body (:func:`parse_create`, then :func:`parsed_request`)."""
        return parsed_request(parse_create(body), body)

    def parse_count(self, body: Any) -> ParsedRequest:
        """A ``POST /v1/responses/input_tokens`` body (:func:`parse_count`, then :func:`parsed_request`)."""
        return parsed_request(parse_count(body), body)

    def count_json(self, input_tokens: int, original_input_tokens: int) -> dict[str, Any]:
        """The ``POST /v1/responses/input_tokens`` answer (``openai.types.responses.InputTokenCountResponse``;
        no context edits here)."""
        return {"object": "response.input_tokens", "input_tokens": input_tokens}

    def deleted_json(self, response_id: str) -> dict[str, Any]:
        """The ``DELETE /v1/responses/{id}`` answer, as OpenAI's API gives it."""
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> ResponsesRenderer:
        return ResponsesRenderer(message_id, model, created, self.options, self._reasoning())

    def message_json(self, view: MessageView) -> dict[str, Any]:
        """The Response object of a message, whatever its status (usage once it ended); ``self`` is
        the surface ``restored`` from the message's echo."""
        outcome = status_outcome(view.status, view.stop_reason, view.error, self.options.background)
        return response_json(view.id, model=view.model, created=view.created, options=self.options,
                             outcome=outcome, blocks=view.content, usage=view.usage if view.status.final else None,
                             reasoning=self._reasoning())

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> list[dict[str, Any]]:
        """The message's content (``GET /v1/messages/{id}``): an ``output_text`` part per text
        block, a ``reasoning_text`` part per reasoning block, a call item per call."""
        out = []
        for i, b in enumerate(blocks):
            match b.kind:
                case BlockKind.TEXT:
                    out.append(_text_part(b.text, b.logprobs))
                case BlockKind.REASONING:
                    out.append(_reasoning_part(b.text))
                case BlockKind.TOOL_CALL:
                    out.append(_item("", i, b, "completed", self.options, self._reasoning()))
                case _:
                    assert_never(b.kind)
        return out

    def stop_reason(self, reason: StopReason) -> str:
        """The Chat Completions spelling (``GET /v1/messages/{id}`` shows it for every surface)."""
        return FINISH_REASONS[reason]

    def error_status(self, error: RingserveError) -> int:
        return _OPENAI.error_status(error)

    def error_json(self, error: RingserveError) -> dict[str, Any]:
        body = _OPENAI.error_json(error)
        if error.param == PROMPT_PARAM:
            body["error"]["param"] = "input"
        return body


RESPONSES = ResponsesSurface()
