"""What every API surface provides: parse a request, render events, shape errors.

A surface is picked once per request (by route) and never tested for by name
inside the shell, in the manner of h11's ``READERS``/``WRITERS`` tables. Only
``surfaces/*`` know JSON keys; the SSE bytes are made by ``core/sse.py``.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, assert_never, overload

import attrs

from ringserve.core.errors import RingserveError, invalid
from ringserve.core.events import (
    AppliedEdit,
    ChatMessage,
    ContentBlock,
    Effort,
    GenerationRequest,
    LogitBias,
    OutputFormat,
    OutputKind,
    ReasoningConfig,
    SamplingParams,
    StopReason,
    TokenLogprob,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.render import Renderer
from ringserve.core.view import MessageView
from ringserve.core.schema import check_repeats, check_schema, enforced_schemas
from ringserve.core.signing import ReasoningSigner


T = TypeVar("T")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""One encoder for every event: ``json.dumps`` with these arguments builds a new one per call."""


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 kept as is (the SSE stream is UTF-8)."""
    return _ENCODER.encode(obj)


_SLOT = "\x00ringserve slot\x00"
"""Marker for :func:`json_template`'s string slot (NUL characters: no id or model name holds it)."""


def json_template(build: Callable[[str], Any]) -> Callable[[str], str]:
    """``dumps(build(text))`` for any ``text``, byte for byte, without building or encoding the rest again.

    ``build`` is called once, with a marker: the document it returns must hold
    that string as a value (once, or in several places that all take the text:
    OpenAI's ``reasoning_content`` and ``reasoning``), and be the same apart from
    it for every text (a delta event: only its text changes from token to token).
    The JSON around the marker's encoding is kept, and each call encodes only
    ``text`` into it, once (about 0.2 µs against 7 µs for building and dumping an
    OpenAI chunk, issue 19).

    Raises:
        ValueError: the document does not hold the marker.
    """
    parts = dumps(build(_SLOT)).split(dumps(_SLOT))
    if len(parts) < 2:
        raise ValueError("the template must hold its slot")
    encode = _ENCODER.encode

    def fill(text: str) -> str:
        return encode(text).join(parts)

    return fill


#: ``load(message_id)``: a stored message's view and its request body as received ("" when
#: ``[store] keep_prompts`` is false), or None when the store has no such message.
LoadStored = Callable[[str], tuple[MessageView, str] | None]


@attrs.frozen
class ParsedRequest:
    """A surface request after validation.

    Args:
        request: the surface-neutral generation request.
        stream: whether the client asked for an SSE stream.
        model: the model name the client sent (may be empty).
        include_usage: OpenAI ``stream_options.include_usage``.
        background: the request runs on without a reader (policy ``continue``), and one that does
            not stream is answered at once with the message's object (the Responses API's
            ``background``).
        store: False when the message is deleted once generated (the Responses API's ``store:
            false``).
        echo: the surface's own state, which the message's objects echo (``Surface.restored``;
            "" for a surface with none).
        echo_without_prompts: ``echo`` without prompt text, what the store keeps of it when
            ``[store] keep_prompts`` is false.
        continues: the stored conversation the request continues, still to be put into
            ``request`` (:class:`Continuation`); None for a request whole as it is.
        ignored: the paths of the fields accepted and ignored (:func:`read_request`).
        grammars: the Lark grammars of the request's freeform tools, each with the field that
            holds it (``tools[0].format.definition``): checked before the generation starts
            (``http/decide.py`` ``check_grammars``), on a worker thread, as their check takes
            time.
    """

    request: GenerationRequest
    stream: bool
    model: str = ""
    include_usage: bool = False
    background: bool = False
    store: bool = True
    echo: str = ""
    echo_without_prompts: str = ""
    continues: Continuation | None = None
    ignored: tuple[str, ...] = ()
    grammars: tuple[tuple[str, str], ...] = ()


@attrs.frozen(eq=False)
class Continuation:
    """A request that continues the conversation of a stored message (the Responses API's
    ``previous_response_id``).

    Attributes:
        previous_id: the stored message it continues.
        history: ``(load, max_bytes) -> turns``: the conversation so far, oldest first, read with
            ``load`` (it blocks: the shell runs it on a worker thread), the stored bodies it reads
            at most ``max_bytes`` in all.

            Raises ``RingserveError`` in the surface's terms (an unknown or unfinished message, a
            conversation too long).
        apply: ``turns -> ParsedRequest``: the request with that conversation in it (``continues``
            None); raises ``RingserveError`` when the request does not fit it.
    """

    previous_id: str
    history: Callable[[LoadStored, int], tuple[ChatMessage, ...]]
    apply: Callable[[tuple[ChatMessage, ...]], ParsedRequest]


#: The response header that names the request fields accepted and ignored (:func:`read_request`).
IGNORED_FIELDS_HEADER = "Ringserve-Ignored-Fields"
#: The most characters of its value: past it the list ends with ``+N more``.
MAX_IGNORED_FIELDS_CHARS = 1024

@attrs.define(eq=False)
class _Reading:
    """What the parse that :func:`read_request` runs gathers and checks on the way."""

    signer: ReasoningSigner | None
    ignored: list[str] = attrs.Factory(list)


_READING: contextvars.ContextVar[_Reading | None] = contextvars.ContextVar("ringserve_reading", default=None)


def report_ignored(path: str) -> None:
    """Note that the request field at ``path`` (``thinking.display``, ``messages[2].content[0]``)
    was accepted and ignored, for the :func:`read_request` that runs this parse; outside one
    it is only accepted."""
    reading = _READING.get()
    if reading is not None:
        reading.ignored.append(path)


def signed_reasoning(text: str, signature: str, where: str) -> str | None:
    """The reasoning a client handed back with a signature of ringserve's (an Anthropic thinking
    block's ``signature``, a Responses reasoning item's ``encrypted_content``): ``text``, or the
    text a sealed signature carries (``core/signing.py`` ``ReasoningSigner.restore``), when it
    verifies under the key of the :func:`read_request` that runs this parse; else None, and
    the block at ``where`` is reported (:func:`report_ignored`) to be dropped from the prompt,
    never an error (real Claude's, another server's, edited text). Outside a
    :func:`read_request`, or without a key, nothing verifies."""
    reading = _READING.get()
    restored = None if reading is None or reading.signer is None else reading.signer.restore(text, signature)
    if restored is None:
        report_ignored(where)
    return restored


def read_request(parse: Callable[[Any], ParsedRequest], body: Any, signing_key: str) -> ParsedRequest:
    """``parse(body)``, with the fields accepted and ignored in ``ignored`` (each path once, in
    the order met: :meth:`FieldTable.check` and :func:`report_ignored` note them, and each
    reasoning block dropped is one); the reasoning it was handed back verifies under
    ``signing_key`` (``[server] signing_key``; "": none does) in :func:`signed_reasoning`.

    The paths and the key are held in a context variable, so the parsers deep in a body need no
    extra argument (a Trio task has its own context: parses in concurrent requests do not mix).
    """
    reading = _Reading(ReasoningSigner.from_text(signing_key) if signing_key else None)
    token = _READING.set(reading)
    try:
        parsed = parse(body)
    finally:
        _READING.reset(token)
    return attrs.evolve(parsed, ignored=tuple(dict.fromkeys(reading.ignored)))


def ignored_fields_header(paths: tuple[str, ...]) -> str:
    """The value of :data:`IGNORED_FIELDS_HEADER`: the paths joined by ``", "``, at most
    :data:`MAX_IGNORED_FIELDS_CHARS` characters; a longer list keeps its first paths and ends
    with ``+N more``. A path is printable ASCII: other characters (a client's field name may hold
    any) are written as Python escapes (``\\r``, ``\\u00e9``)."""
    paths = tuple(p if p.isascii() and p.isprintable() else ascii(p)[1:-1] for p in paths)
    joined = ", ".join(paths)
    if len(joined) <= MAX_IGNORED_FIELDS_CHARS:
        return joined
    kept: list[str] = []
    size = 0  # of ", ".join(kept) plus the ", " after it
    for path in paths:
        rest = f"+{len(paths) - len(kept) - 1} more"
        if size + len(path) + 2 + len(rest) > MAX_IGNORED_FIELDS_CHARS:
            break
        kept.append(path)
        size += len(path) + 2
    return ", ".join([*kept, f"+{len(paths) - len(kept)} more"])


#: ringserve's extension key, next to the stop reason of a cancelled message on both surfaces:
#: Anthropic ``message_delta.delta`` and ``Message``, OpenAI the final chunk's choice and the
#: ``chat.completion`` choice. The stop reason itself stays a value of the SDKs' types (``end_turn``,
#: ``stop``); the SDKs' models allow extra keys, so typed clients read it as ``model_extra``.
CANCELLED_KEY = "ringserve_cancelled"


def cancelled_fields(cancelled: bool) -> dict[str, bool]:
    """``{"ringserve_cancelled": true}`` for a cancelled message, else nothing (see :data:`CANCELLED_KEY`)."""
    return {CANCELLED_KEY: True} if cancelled else {}


class Surface(Protocol):
    """One API dialect (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses).

    Attributes:
        name: its name: the store keeps a message's surface by it, and its ``[policy]`` key.
        id_prefix: the start of its messages' ids (no other surface's starts with it).
        prefer_respond_async: it takes ringserve's ``Prefer: respond-async`` (a 202 with the
            message's URL); the Responses API has its own ``background`` instead.
        refuses_lone_surrogates: its objects echo request fields, which the store keeps as UTF-8
            text: a body holding a lone surrogate is a 400 before it is parsed.
    """

    name: str
    id_prefix: str
    prefer_respond_async: bool
    refuses_lone_surrogates: bool

    def parse_request(self, body: Any) -> ParsedRequest: ...

    def restored(self, echo: str, signer: ReasoningSigner) -> Surface:
        """The surface that renders a message and spells its objects, live or stored again
        (``live/resume.py`` ``rebuilt``): from the ``echo`` the route passed to ``Hub.create``
        ("" for a surface with no state of its own), signing its reasoning with ``signer`` (the
        server's key: ``Hub.signer``), so that a rebuilt stream carries the same signatures."""
        ...

    def edited(self, echo: str, applied: tuple[AppliedEdit, ...]) -> str:
        """The echo of a message whose prompt ``applied`` context edits trimmed: ``echo``, with
        what the surface reports of them in its objects (``echo`` itself for a surface that
        reports none). The hub renders the message with ``restored`` of it, and stores it."""
        ...

    def renderer(self, message_id: str, model: str, created: int, include_usage: bool) -> Renderer: ...

    def message_json(self, view: MessageView) -> dict[str, Any]:
        """The surface's object of a message (its non-stream answer, once it ended)."""
        ...

    def content_json(self, blocks: tuple[ContentBlock, ...]) -> Any:
        """A message's content blocks as the surface spells a message's content (``GET``)."""
        ...

    def stop_reason(self, reason: StopReason) -> str: ...

    def error_status(self, error: RingserveError) -> int:
        """The HTTP status of ``error`` on this surface (the kind's own, unless the surface's API differs)."""
        ...

    def error_json(self, error: RingserveError) -> dict[str, Any]: ...


class Counting(Surface, Protocol):
    """A surface with a route that counts a request's prompt tokens without generating."""

    def parse_count(self, body: Any) -> ParsedRequest:
        """A counting request's body, as the generation request whose prompt it counts."""
        ...

    def count_json(self, input_tokens: int, original_input_tokens: int) -> dict[str, Any]:
        """The counting route's answer: the prompt's tokens, and its tokens before its context
        edits (equal when they cleared nothing)."""
        ...


# -- validation helpers shared by both parsers ----------------------------------------------


@attrs.frozen
class Refused:
    """A request field that a correct answer needs and ringserve cannot give (``n`` > 1, an MCP
    server the server would have to call).

    A request that sets it gets a 400 naming it, never an answer that
    silently ignores it, unless its value is ``None`` or one of ``neutral``
    (values that cannot change the answer, such as ``tools: []`` or
    ``n: 1``; compared by type and value, so ``True`` is not ``1``).

    Attributes:
        why: the reason given in the error message.
        neutral: the values accepted as if the field were absent.
    """

    why: str
    neutral: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        """Whether ``value`` is ``None`` or one of the neutral values."""
        return value is None or any(type(value) is type(n) and value == n for n in self.neutral)


@attrs.frozen
class FieldTable:
    """What a surface does with each field of a JSON object of its requests.

    The one place per surface (and per object: the request body, a message)
    that lists every field the official SDK's request type has (``anthropic.
    types.MessageCreateParams``, ``openai.types.chat.CompletionCreateParams``),
    which docs/compatibility.md's tables follow (tests/test_docs.py checks).

    The policy (issue 33: a field a real client sends must never fail its request): honour
    what can be honoured (``supported``); accept what cannot change the substance of the answer
    (``ignored``: caching hints, client bookkeeping, hosted tools the model cannot call), and
    report it (:func:`report_ignored`: the ``Ringserve-Ignored-Fields`` response header and a
    debug log line); refuse with a 400 only where a correct answer needs the field and
    ringserve cannot give it (``refused``). A field in no list (a newer API's, or what an SDK
    helper adds, such as the OpenAI Node SDK's ``parsed``) is accepted and reported too.

    Attributes:
        supported: fields that the parser reads.
        ignored: fields accepted and reported, because they cannot change the
            answer (``metadata``, ``user``, ...).
        refused: fields a correct answer needs that ringserve cannot give: a 400 unless their
            value is neutral.
    """

    supported: frozenset[str]
    ignored: frozenset[str]
    refused: Mapping[str, Refused]

    def object(self, value: Any, where: str, param: str) -> dict[str, Any]:
        """``value``, a JSON object at ``where`` whose fields :meth:`check` accepts.

        Raises:
            RingserveError: ``INVALID_REQUEST`` with ``param`` when it is not an object, or as
                :meth:`check` does.
        """
        if not isinstance(value, dict):
            raise invalid(f"{where}: must be an object", param=param)
        self.check(value, where, param)
        return value

    def check(self, obj: dict[str, Any], where: str = "", param: str | None = None) -> None:
        """Refuse the fields of ``obj`` that a correct answer needs and ringserve cannot give;
        report those it accepts and ignores (:func:`report_ignored`: an ``ignored`` field that is
        not null, and a field in no list).

        Args:
            obj: the JSON object (a request body or one of its messages).
            where: the object's path in error messages (``"messages[2]"``);
                empty for the body.
            param: the error's ``param``; None: the field's own name.

        Raises:
            RingserveError: ``INVALID_REQUEST`` (400) naming the first refused
                field with a non-neutral value.
        """
        for key, value in obj.items():
            if key in self.supported:
                continue
            path = f"{where}.{key}" if where else key
            rule = self.refused.get(key)
            if rule is None:
                if value is not None:
                    report_ignored(path)
            elif not rule.allows(value):
                raise invalid(f"{path}: not supported by ringserve ({rule.why})", param=param or key)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


@overload
def get_int(body: dict[str, Any], key: str, *, lo: int, hi: int, default: int) -> int: ...


@overload
def get_int(body: dict[str, Any], key: str, *, lo: int, hi: int, default: None = None) -> int | None: ...


def get_int(body: dict[str, Any], key: str, *, lo: int, hi: int, default: int | None = None) -> int | None:
    """``body[key]``, an integer in ``lo..hi``; ``default`` when absent or null.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``key``.
    """
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key}: must be an integer", param=key)
    if not lo <= value <= hi:
        raise invalid(f"{key}: must be between {lo} and {hi}, got {value}", param=key)
    return value


def get_float(body: dict[str, Any], key: str, *, lo: float, hi: float, above: bool = False) -> float | None:
    """``body[key]``, a finite number in ``lo..hi`` (above ``lo`` where ``above``); None when
    absent or null.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``key``.
    """
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{key}: must be a number", param=key)
    try:
        number = float(value)
    except OverflowError:  # an integer past a double's range
        number = math.inf
    if not (lo < number if above else lo <= number) or not number <= hi or not math.isfinite(number):
        if not math.isinf(hi):
            raise invalid(f"{key}: must be between {lo} and {hi}, got {value!r:.40}", param=key)
        bound = "" if math.isinf(lo) else f" greater than {lo}" if above else f" of at least {lo}"
        raise invalid(f"{key}: must be a finite number{bound}, got {value!r:.40}", param=key)
    return number


def get_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{key}: must be a boolean", param=key)
    return value


def get_str(body: dict[str, Any], key: str, *, required: bool = False, default: str = "") -> str:
    value = body.get(key)
    if value is None:
        if required:
            raise invalid(f"{key}: field required", param=key)
        return default
    if not isinstance(value, str):
        raise invalid(f"{key}: must be a string", param=key)
    return value


def template_kwargs(body: dict[str, Any], key: str = "chat_template_kwargs") -> str:
    """llama-server's ``chat_template_kwargs``: an object whose members are variables of the
    model's chat template (``{"enable_thinking": false}``); its JSON text for
    :attr:`GenerationRequest.template_kwargs <ringserve.core.events.GenerationRequest>`
    (``""`` when absent or null).

    Raises:
        RingserveError: ``INVALID_REQUEST``: not an object.
    """
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise invalid(f"{key}: must be an object", param=key)
    return json.dumps(value, ensure_ascii=False)


_KIND_NAMES: dict[type, str] = {bool: "a boolean", str: "a string"}


def optional(value: Any, kind: type[T], where: str, param: str) -> T | None:
    """``value`` if it is None or a ``kind`` (``bool``, ``str``), else a 400 naming ``where``."""
    if value is not None and not isinstance(value, kind):
        raise invalid(f"{where}: must be {_KIND_NAMES[kind]}", param=param)
    return value


def text_block(block: Any, where: str, param: str, block_fields: FieldTable) -> str:
    """The text of one ``{"type": "text", "text": ...}`` block at ``where``, its other keys
    checked against ``block_fields``; a block of any other type is a 400 naming the type."""
    if not isinstance(block, dict):
        raise invalid(f"{where}: must be an object", param=param)
    if block.get("type") != "text":
        raise invalid(
            f"{where}: content blocks of type {block.get('type')!r} are not supported by ringserve (only text)",
            param=param,
        )
    block_fields.check(block, where, param=param)
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text: must be a string", param=param)
    return text


def text_content(
    value: Any, where: str, block_fields: FieldTable, *, allow_empty: bool = True, param: str | None = None
) -> str:
    """Message content: a string, or a list of ``{"type": "text", "text": ...}`` blocks joined.

    The other keys of a text block are checked against ``block_fields`` (the
    surface's table for one block or part). A block of any other type
    (``image``, ``document``, ``image_url``, ...) is a 400
    naming the type; so is an empty list unless ``allow_empty`` (the
    Anthropic API refuses ``content: []``). ``param`` defaults to ``where``.
    """
    param = param or where
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value and not allow_empty:
            raise invalid(f"{where}: must not be an empty list", param=param)
        return "".join(text_block(block, f"{where}[{i}]", param, block_fields) for i, block in enumerate(value))
    raise invalid(f"{where}: must be a string or a list of text blocks", param=param)


#: OpenAI's ``reasoning_effort`` (Chat Completions) and ``reasoning.effort`` (Responses) values
#: (``openai.types.shared.ReasoningEffort``): ``none`` turns thinking off, the others are efforts.
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_effort(value: Any, key: str) -> ReasoningConfig:
    """OpenAI's reasoning effort at ``key`` as the request's reasoning controls: ``none`` is
    thinking off, another value the effort (thinking as the model's default); absent or null is
    the default. A model that does not reason answers as without it.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``key`` for a value not in :data:`OPENAI_EFFORTS`.
    """
    if value is None:
        return ReasoningConfig()
    if value not in OPENAI_EFFORTS:
        raise invalid(f"{key}: must be one of {', '.join(OPENAI_EFFORTS)}", param=key.split(".")[0])
    return ReasoningConfig(enabled=False) if value == "none" else ReasoningConfig(effort=Effort(value))


# -- tools and structured output, the same rules on both surfaces -----------------------------

#: The most tools one request may offer: OpenAI's documented limit for ``tools`` (Anthropic
#: documents none); a longer list is a 400.
MAX_TOOLS = 128

#: A tool's name, as both APIs document it: 1 to 64 ASCII letters, digits, ``_`` or ``-``.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def tool_name(value: Any, where: str, param: str) -> str:
    """A tool name at ``where`` (see :data:`TOOL_NAME`), or a 400."""
    if not isinstance(value, str) or not TOOL_NAME.fullmatch(value):
        raise invalid(f"{where}: a tool name is 1 to 64 letters, digits, '_' or '-', got {value!r:.80}", param=param)
    return value


def json_schema(value: Any, where: str, param: str, *, arguments: bool) -> str:
    """A JSON schema given as a JSON object, as compact JSON text.

    With ``arguments`` (a tool's arguments) the schema must describe an object: ``"type":
    "object"``, as Anthropic's ``input_schema`` requires and OpenAI's ``parameters`` documents.
    Whether a schema keyword can be enforced is the grammar compiler's decision (``core/``).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``where``.
    """
    if not isinstance(value, dict):
        raise invalid(f"{where}: a JSON schema must be a JSON object", param=param)
    if arguments and value.get("type") != "object":
        raise invalid(f"{where}: a tool's arguments schema must have \"type\": \"object\"", param=param)
    return dumps(value)


def tool_list(value: Any, key: str,
              one: Callable[[dict[str, Any], str], ToolSpec | Sequence[ToolSpec]]) -> tuple[ToolSpec, ...]:
    """The request's tools: ``value`` a list of at most :data:`MAX_TOOLS` objects, each parsed
    by ``one(obj, "tools[i]")`` into a tool or the tools it stands for (a Responses namespace:
    its functions; a hosted tool the model cannot call: none), with distinct names; None or
    absent is no tools.

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param=key``.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"{key}: must be a list of tools", param=key)
    if len(value) > MAX_TOOLS:
        raise invalid(f"{key}: at most {MAX_TOOLS} tools, got {len(value)}", param=key)
    tools: list[ToolSpec] = []
    for i, raw in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"{where}: must be an object", param=key)
        made = one(raw, where)
        for tool in (made,) if isinstance(made, ToolSpec) else made:
            if any(t.name == tool.name for t in tools):
                raise invalid(f"{where}.name: duplicate tool name {tool.name!r}", param=key)
            tools.append(tool)
    return tuple(tools)


def function_spec(function: dict[str, Any], where: str, param: str) -> ToolSpec:
    """A function tool from the object at ``where`` holding its ``name``, ``description``,
    ``parameters`` and ``strict`` (OpenAI Chat's ``tools[i].function``, a Responses ``tools[i]``).

    ``parameters`` absent or null is a function without arguments, as OpenAI documents; else an
    object schema (:func:`json_schema`).

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param``.
    """
    parameters = function.get("parameters")
    return ToolSpec(
        name=tool_name(function.get("name"), f"{where}.name", param),
        description=optional(function.get("description"), str, f"{where}.description", param) or "",
        parameters=dumps({"type": "object", "properties": {}}) if parameters is None
        else json_schema(parameters, f"{where}.parameters", param, arguments=True),
        strict=bool(optional(function.get("strict"), bool, f"{where}.strict", param)),
    )


def schema_format(spec: dict[str, Any], where: str, param: str) -> OutputFormat:
    """Structured output from the object at ``where`` holding ``name``, ``schema`` and ``strict``
    (OpenAI Chat's ``response_format.json_schema``, a Responses ``text.format``): the name is
    checked (1 to 64 letters, digits, ``_`` or ``-``); no schema is any JSON object (the name
    alone constrains nothing).

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param``.
    """
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(f"{where}.name: 1 to 64 letters, digits, '_' or '-'", param=param)
    optional(spec.get("strict"), bool, f"{where}.strict", param)
    schema = spec.get("schema")
    if schema is None:
        return OutputFormat(OutputKind.JSON_OBJECT)
    return OutputFormat(OutputKind.JSON_SCHEMA, json_schema(schema, f"{where}.schema", param, arguments=False))


def check_enforced(request: GenerationRequest, tool_schema: str, output_schema: str) -> GenerationRequest:
    """``request``, once the schemas its reply will be decoded under (``core/schema.py``
    ``enforced_schemas``) are known to be enforceable; errors name the surface's own fields:
    ``tool_schema`` with ``{i}`` for the tool's index (``tools[{i}].input_schema``), and
    ``output_schema`` (``output_config.format.schema``).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the keyword that cannot be enforced, with
        ``param`` the top-level field; or bounds over ``core/schema.py``'s ``MAX_REPEATS``
        in all (``param`` the first enforced schema's top-level field).
    """
    enforced = enforced_schemas(request)
    params = []
    for index, schema in enforced:
        where = output_schema if index is None else tool_schema.format(i=index)
        params.append(re.split(r"[.\[]", where, maxsplit=1)[0])
        check_schema(schema, where, param=params[-1])
    if enforced:
        check_repeats([schema for _, schema in enforced], params[0])
    return request


def require_function(obj: dict[str, Any], where: str, param: str, what: str) -> None:
    """A 400 naming ``where.type`` unless ``obj`` is ``{"type": "function", ...}`` (OpenAI's tools,
    calls and named choices; ``what`` says which, in the message)."""
    if obj.get("type") != "function":
        raise invalid(f"{where}.type: only function {what} are supported by ringserve, got {obj.get('type')!r:.80}",
                      param=param)


#: The string values of an OpenAI ``tool_choice`` (Chat Completions and Responses) → mode.
TOOL_CHOICE_MODES = {"none": ToolChoiceMode.NONE, "auto": ToolChoiceMode.AUTO, "required": ToolChoiceMode.REQUIRED}


def openai_tool_choice(
    value: Any, tools: tuple[ToolSpec, ...], *, parallel: bool, named: Callable[[dict[str, Any]], str]
) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required`` or a named function
    ``{"type": "function", ...}``, whose name ``named(value)`` reads (Chat Completions nests it
    under ``function``, Responses does not); absent is ``auto``.

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param="tool_choice"``.
    """
    if value is None:
        return ToolChoice(parallel=parallel)
    if isinstance(value, str) and value in TOOL_CHOICE_MODES:
        return tool_choice(ToolChoice(TOOL_CHOICE_MODES[value], parallel=parallel), tools, "tool_choice")
    if not isinstance(value, dict):
        raise invalid('tool_choice: must be "none", "auto", "required" or a named function', param="tool_choice")
    require_function(value, "tool_choice", "tool_choice", "choices")
    return tool_choice(ToolChoice(ToolChoiceMode.NAMED, named(value), parallel), tools, "tool_choice")


def tool_choice(choice: ToolChoice, tools: tuple[ToolSpec, ...], key: str) -> ToolChoice:
    """``choice`` checked against the request's tools: a forced choice needs tools, and a
    named one a tool of that name.

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param=key``.
    """
    match choice.mode:
        case ToolChoiceMode.AUTO | ToolChoiceMode.NONE:
            pass
        case ToolChoiceMode.REQUIRED:
            if not tools:
                raise invalid(f"{key}: a tool call is required but the request has no tools", param=key)
        case ToolChoiceMode.NAMED:
            if not any(t.name == choice.name for t in tools):
                raise invalid(f"{key}: no tool named {choice.name!r} in tools", param=key)
        case _:
            assert_never(choice.mode)
    return choice


@attrs.define
class CallIds:
    """The tool-call ids of a conversation's assistant turns so far, oldest first.

    A tool result must answer one of them (both APIs refuse a result for a call that was never
    made); ids are kept as the client sent them.
    """

    seen: set[str] = attrs.Factory(set)

    def call(self, value: Any, where: str, param: str) -> str:
        """Note the id of an assistant turn's call at ``where``; a 400 unless a new non-empty string."""
        if not isinstance(value, str) or not value:
            raise invalid(f"{where}: a tool call id must be a non-empty string", param=param)
        if value in self.seen:
            raise invalid(f"{where}: duplicate tool call id {value!r:.80}", param=param)
        self.seen.add(value)
        return value

    def result(self, value: Any, where: str, param: str) -> str:
        """The id a tool result at ``where`` answers; a 400 unless an earlier call has it."""
        if not isinstance(value, str) or value not in self.seen:
            raise invalid(f"{where}: {value!r:.80} matches no earlier tool call id", param=param)
        return value


def arguments_json(value: Any, where: str, param: str) -> str:
    """A history tool call's arguments: JSON text of an object (OpenAI's ``arguments``), kept as
    the client sent it, as llama-server keeps it: a template that writes the arguments as text
    shows the model that text (``{"city": "Paris"}`` stays so, not ``{"city":"Paris"}``).

    Raises:
        RingserveError: ``INVALID_REQUEST`` when it is not a string holding a JSON object.
    """
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise invalid(f"{where}: must be JSON text of an object", param=param) from None
        if isinstance(parsed, dict):
            return value
    raise invalid(f"{where}: must be JSON text of an object", param=param)


def stop_list(
    value: Any, key: str, *, allow_string: bool, max_items: int = 16, max_len: int = 256
) -> tuple[str, ...]:
    """Stop sequences: a list of non-empty strings, or one string where ``allow_string``
    (OpenAI's ``stop``; Anthropic's ``stop_sequences`` is a list). An empty string is a 400:
    it would stop before the first token on some servers and be dropped on others."""
    if value is None:
        return ()
    if isinstance(value, str) and allow_string:
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        kind = "a string or a list of strings" if allow_string else "a list of strings"
        raise invalid(f"{key}: must be {kind}", param=key)
    if len(value) > max_items:
        raise invalid(f"{key}: at most {max_items} stop sequences", param=key)
    if any(not s for s in value):
        raise invalid(f"{key}: a stop sequence must not be empty", param=key)
    if any(len(s) > max_len for s in value):
        raise invalid(f"{key}: each stop sequence has at most {max_len} characters", param=key)
    return tuple(value)


#: The sampler fields :func:`sampling_params` reads on every surface: each API's own
#: (``temperature``, ``top_p``; Anthropic's ``top_k``; OpenAI Chat's ``seed``, ``presence_penalty``,
#: ``frequency_penalty``, ``logit_bias``) and the others llama-server reads on each of its routes,
#: with its names (``tools/server/server-schema.cpp``).
SAMPLER_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "repeat_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty", "logit_bias", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability", "xtc_threshold",
})

#: The largest ``repeat_last_n``, ``dry_allowed_length`` and ``dry_penalty_last_n`` (llama-server's
#: hard limit, ``INT32_MAX``).
MAX_WINDOW = 2**31 - 1

#: OpenAI's range for ``presence_penalty``, ``frequency_penalty`` and a ``logit_bias``'s biases.
PENALTY_RANGE, BIAS_RANGE = 2.0, 100.0

_INTEGER = re.compile(r"\s*[+-]?[0-9]+")


def sampling_params(body: dict[str, Any], *, max_temperature: float) -> SamplingParams:
    """The request's sampler settings (:data:`SAMPLER_FIELDS`), None for each it does not set
    (``core/sampling.py`` fills them from the defaults); the same keys on every surface.

    ``temperature`` (0 = greedy; at most ``max_temperature``, 1 for Anthropic and 2 for
    OpenAI, as their APIs allow), ``top_p``, ``min_p``, ``typical_p``, ``xtc_probability``,
    ``xtc_threshold`` (0..1), ``top_k`` (0..1,000,000), ``repeat_penalty`` (above 0),
    ``presence_penalty`` and ``frequency_penalty`` (-2..2, OpenAI's range), ``repeat_last_n``,
    ``dry_allowed_length``, ``dry_penalty_last_n`` (0..2**31-1), ``dry_multiplier`` (>= 0),
    ``dry_base`` (below 1 is the default's, as llama-server reads it), ``dry_sequence_breakers``
    (a non-empty list of strings), ``logit_bias`` (:func:`logit_bias`), ``seed`` (any integer,
    taken modulo 2**32; -1 draws one, as llama-server's).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming the field.
    """
    seed = get_int(body, "seed", lo=-(2**63), hi=2**64 - 1)
    dry_base = get_float(body, "dry_base", lo=-math.inf, hi=math.inf)
    return SamplingParams(
        temperature=get_float(body, "temperature", lo=0.0, hi=max_temperature),
        top_k=get_int(body, "top_k", lo=0, hi=1_000_000),
        top_p=get_float(body, "top_p", lo=0.0, hi=1.0),
        min_p=get_float(body, "min_p", lo=0.0, hi=1.0),
        typical_p=get_float(body, "typical_p", lo=0.0, hi=1.0),
        repeat_penalty=get_float(body, "repeat_penalty", lo=0.0, hi=math.inf, above=True),
        repeat_last_n=get_int(body, "repeat_last_n", lo=0, hi=MAX_WINDOW),
        presence_penalty=get_float(body, "presence_penalty", lo=-PENALTY_RANGE, hi=PENALTY_RANGE),
        frequency_penalty=get_float(body, "frequency_penalty", lo=-PENALTY_RANGE, hi=PENALTY_RANGE),
        dry_multiplier=get_float(body, "dry_multiplier", lo=0.0, hi=math.inf),
        dry_base=None if dry_base is None or dry_base < 1.0 else dry_base,
        dry_allowed_length=get_int(body, "dry_allowed_length", lo=0, hi=MAX_WINDOW),
        dry_penalty_last_n=get_int(body, "dry_penalty_last_n", lo=0, hi=MAX_WINDOW),
        dry_sequence_breakers=_breakers(body.get("dry_sequence_breakers")),
        xtc_probability=get_float(body, "xtc_probability", lo=0.0, hi=1.0),
        xtc_threshold=get_float(body, "xtc_threshold", lo=0.0, hi=1.0),
        logit_bias=logit_bias(body.get("logit_bias")),
        seed=None if seed is None else seed % 2**32,
    )


def token_text(piece: bytes) -> str:
    """A token's text as llama-server spells it in its log probabilities (``validate_utf8`` in
    ``tools/server/server-common.cpp``): its bytes but for a UTF-8 character cut at their end,
    decoded (an invalid byte as U+FFFD). The ``bytes`` beside it hold them all."""
    for back in range(1, min(4, len(piece)) + 1):
        byte = piece[-back]
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 0
        if back < need:  # the lead of a character its bytes do not finish
            return piece[:-back].decode("utf-8", "replace")
    return piece.decode("utf-8", "replace")


def logprob_json(logprob: TokenLogprob, *, with_bytes: bool = True) -> dict[str, Any]:
    """A token's log probabilities as OpenAI spells them: ``token``, ``logprob``, ``bytes`` (its
    UTF-8 bytes; not ``with_bytes``: none), and ``top_logprobs`` of the same shape without their
    own (``openai.types.chat.ChatCompletionTokenLogprob``, the Responses ``output_text`` part's
    ``Logprob``; without bytes, ``response.output_text.delta``'s)."""

    def one(piece: bytes, value: float) -> dict[str, Any]:
        entry: dict[str, Any] = {"token": token_text(piece), "logprob": value}
        if with_bytes:
            entry["bytes"] = list(piece)
        return entry

    return {**one(logprob.piece, logprob.logprob), "top_logprobs": [one(t.piece, t.logprob) for t in logprob.top]}


def _breakers(value: Any) -> tuple[str, ...] | None:
    """``dry_sequence_breakers``: a non-empty list of strings (llama-server refuses an empty one)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise invalid("dry_sequence_breakers: must be a non-empty list of strings", param="dry_sequence_breakers")
    return tuple(value)


def logit_bias(value: Any) -> tuple[LogitBias, ...] | None:
    """``logit_bias`` as llama-server reads it on its OpenAI-compatible routes: OpenAI's object
    of token ids (decimal strings) to biases, or a list of ``[token, bias]`` pairs; a token may
    also be a text (its every token gets the bias); a bias is a number in -100..100 (OpenAI's
    range) or ``false`` (the token is banned). An empty object or list is no bias. Whether an id
    is in the vocabulary is checked where the request is prepared (``core/sampling.py``
    ``check_logit_bias``).

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``logit_bias``.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = [(int(k) if _INTEGER.fullmatch(k) else k, v, f"logit_bias[{k!r:.40}]") for k, v in value.items()]
    elif isinstance(value, list):
        pairs = []
        for i, pair in enumerate(value):
            where = f"logit_bias[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise invalid(f"{where}: must be a [token, bias] pair", param="logit_bias")
            token = pair[0]
            if isinstance(token, bool) or not isinstance(token, (int, str)):
                raise invalid(f"{where}: the token must be an id or a text", param="logit_bias")
            pairs.append((token, pair[1], where))
    else:
        raise invalid("logit_bias: must be an object of token ids to biases, or a list of [token, bias] pairs",
                      param="logit_bias")
    return tuple(LogitBias(token, _bias(bias, where)) for token, bias, where in pairs)


def _bias(value: Any, where: str) -> float:
    if value is False:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -BIAS_RANGE <= value <= BIAS_RANGE:
        raise invalid(f"{where}: a bias is a number between -100 and 100, or false (banned), got {value!r:.40}",
                      param="logit_bias")
    return float(value)
