"""JSON schema to GBNF grammar, for decoding tool calls and JSON answers under a grammar.

The conversion is llama-cpp-python's bundled copy of llama.cpp's
``examples/json-schema-to-grammar.py`` (``llama_cpp.llama_grammar.SchemaConverter``;
pure Python, it does not load the native library, but importing it imports
``llama_cpp``, so this module is on the engine's side). Every schema it converts has
passed ``core/schema.py``, which decides what is enforced and refuses the rest.

Two fixes over the bundled converter (it is an older copy than llama.cpp's
current one): string characters exclude the control characters U+0000..U+001F
(JSON forbids them raw, ``json.loads`` refuses them), and literals (property
names, ``const`` / ``enum`` values) escape backslashes, so a name holding
``\\`` is emitted as valid JSON. ``$ref`` targets get rule names of their own,
so two tools' ``$defs`` of the same name never share a rule.

Grammars are cached (:data:`GRAMMAR_CACHE`, least recently used first out, at most
:data:`CACHE_BYTES`) keyed by the schema texts; their rule ``root`` is where decoding starts.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Hashable, Sequence
from typing import Any, assert_never

import attrs
from ringserve.engine._native import llama_grammar as _lg

from ringserve.core.cache import ByteLRU
from ringserve.core.detokenizer import Detokenizer
from ringserve.core.errors import RingserveError, invalid
from ringserve.core.events import GenerationRequest, OutputKind, ToolChoiceMode, ToolSpec
from ringserve.core.schema import check_repeats, check_schema, cleaned, enforced_schemas, ref_target, subschemas
from ringserve.core.toolcalls import CALL_CLOSE, CALL_OPEN, OPEN_MARK, CallEnd, ToolCallError, ToolCallParser, format_call

log = logging.getLogger("ringserve.engine")

__all__ = [
    "CACHE_BYTES",
    "GRAMMAR_CACHE",
    "MAX_CALLS",
    "CallWatch",
    "Constraint",
    "GrammarOff",
    "GrammarOn",
    "LazyCalls",
    "calls_grammar",
    "constraint_for",
    "output_grammar",
]

CACHE_BYTES = 16 << 20
"""The most the grammars kept may hold, their keys included (``sys.getsizeof`` of their texts).

Measured: one tool's grammar (``get_weather``) is 454 bytes, the median of the benchmark's
random tool schemas 800 (at most 2.4 KB), twenty strict tools' call grammar 10.6 KB; the
largest a request may make (``core/schema.py`` ``MAX_GRAMMAR_BYTES``) under 1 MB, and a
grammar larger than this whole budget is not kept."""

MAX_CALLS = 4
"""Most tool calls in one reply when parallel calls are allowed."""

_SAFE_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


@attrs.frozen
class Constraint:
    """A sequence's output decoded under a grammar.

    Attributes:
        grammar: GBNF text (llama.cpp ``grammars/README.md``), start rule ``root``.
        value: the schema (checked JSON text) of the JSON value a text under the grammar holds:
            the answer, or the first tool's arguments.
        frame: the text before and after that value in the shortest such text (a call's
            head and end). ``engine/examples.py`` makes a text the grammar accepts from these
            two (the fake engine's reply); nothing on a request's path builds it.
    """

    grammar: str
    value: str
    frame: tuple[str, str] = ("", "")


class _Converter(_lg.SchemaConverter):
    # llama_grammar is untyped: its calls below carry ignores for mypy's strict core flags.
    """The bundled converter with the fixes the module docstring lists."""

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]
        self._ref_names: dict[str, str] = {}

    def _format_literal(self, literal: str) -> str:
        escaped = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        return f'"{escaped}"'

    def _resolve_ref(self, ref: str) -> str:
        name = self._ref_names.get(ref)
        if name is None:
            name = self._ref_names[ref] = f"ref{len(self._ref_names)}"
            body = self.visit(self._refs[ref], name)  # type: ignore[no-untyped-call]
            if body != name:
                self._rules[name] = body
        return name

    def add(self, schema: dict[str, Any], url: str, name: str) -> str:
        """Visit one cleaned schema as rule ``name``; return the rule that matches it.

        Its ``$ref`` targets are registered by walking its schema nodes only (the bundled
        ``resolve_refs`` walks every object, ``const`` and ``enum`` values included, and
        rewrote a ``"$ref"`` key there), each ref made unique by prefixing ``url``."""
        stack = [schema]
        while stack:
            node = stack.pop()
            if "$ref" in node:
                full = url + node["$ref"]
                self._refs[full] = ref_target(schema, node["$ref"])
                node["$ref"] = full
            stack += subschemas(node)
        return str(self.visit(schema, name))  # type: ignore[no-untyped-call]

    def rule(self, name: str, body: str) -> str:
        return str(self._add_rule(name, body))  # type: ignore[no-untyped-call]

    def literal(self, text: str) -> str:
        return self._format_literal(text)

    def grammar(self) -> str:
        if "char" in self._rules:
            self._rules["char"] = _SAFE_CHAR
        return str(self.format_grammar())  # type: ignore[no-untyped-call]


def _convert(schemas: Sequence[tuple[str, str]]) -> tuple[_Converter, list[str]]:
    conv = _Converter()
    rules = []
    for i, (text, where) in enumerate(schemas):
        schema = cleaned(text, where)
        try:
            rules.append(conv.add(schema, f"s{i}", f"s{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise invalid(f"{where}: the schema cannot be turned into a grammar ({exc})", where) from None
    return conv, rules


def _texts(item: object) -> list[str]:
    match item:
        case str():
            return [item]
        case ToolSpec():
            return [item.name, item.description, item.parameters]
        case Constraint():
            return [item.grammar, item.value, *item.frame]
        case tuple():
            return [text for part in item for text in _texts(part)]
    return []


def _entry_bytes(key: Hashable, value: Constraint | None) -> int:
    return sum(sys.getsizeof(text) for text in (*_texts(key), *_texts(value)))


GRAMMAR_CACHE: ByteLRU[Constraint | None] = ByteLRU(CACHE_BYTES, _entry_bytes)
"""Every grammar made, by what it was made from."""


def output_grammar(schema: str, where: str) -> Constraint:
    """The grammar of a JSON answer: an object valid under ``schema`` (``""``: any object).

    Raises:
        RingserveError: as :func:`check_schema`.
    """
    constraint = GRAMMAR_CACHE.get(("output", schema, where), lambda: _output_grammar(schema, where))
    assert constraint is not None
    return constraint


def _output_grammar(schema: str, where: str) -> Constraint:
    text = schema or '{"type": "object"}'
    conv, (value,) = _convert([(text, where)])
    conv.rule("root", value)
    return Constraint(conv.grammar(), text)


def calls_grammar(tools: Sequence[ToolSpec], parallel: bool) -> Constraint:
    """The grammar of a reply that is only tool calls, each naming one of ``tools``.

    One call when ``parallel`` is False, else 1..:data:`MAX_CALLS`, separated by
    a newline; each is :func:`~ringserve.core.toolcalls.format_call`'s syntax,
    ``{"name": NAME, "arguments": ARGS}`` between the markers, with ARGS valid
    under that tool's schema. Its :attr:`~Constraint.value` is the first tool's arguments
    in a call of that tool.

    Raises:
        RingserveError: a schema the grammar cannot enforce (``param`` names
            ``tools[i].parameters``).
    """
    key = ("calls", tuple(tools), parallel)
    constraint = GRAMMAR_CACHE.get(key, lambda: _calls_grammar(tuple(tools), parallel))
    assert constraint is not None
    return constraint


def _calls_grammar(tools: tuple[ToolSpec, ...], parallel: bool) -> Constraint:
    conv, body = _call_bodies(tools, [t.parameters for t in tools])
    call = conv.rule("call", f"{conv.literal(CALL_OPEN + _HEAD)} ( {body} ) {conv.literal('}' + CALL_CLOSE)}")
    root = call if not parallel else f'{call} ("\\n" {call}){{0,{MAX_CALLS - 1}}}'
    conv.rule("root", root)
    first = tools[0]
    head, _, tail = format_call(first.name, "\x00").partition("\x00")  # no tool name holds NUL
    return Constraint(conv.grammar(), first.parameters, (head, tail))


_HEAD = "{" + json.dumps("name") + ": "
"""What a call's JSON object starts with in the call syntax, before the tool's name."""


def _call_bodies(tools: Sequence[ToolSpec], schemas: Sequence[str]) -> tuple[_Converter, str]:
    """A converter holding the argument rules of ``tools`` (``schemas[i]`` for ``tools[i]``) and
    the alternatives, one per tool, of what follows :data:`_HEAD`: the name, then the arguments."""
    conv, rules = _convert([(text, f"tools[{i}].parameters") for i, text in enumerate(schemas)])
    alts = []
    for tool, args in zip(tools, rules, strict=True):
        head = conv.literal(f"{json.dumps(tool.name)}, {json.dumps('arguments')}: ")
        alts.append(f"{head} {args}")
    return conv, " | ".join(alts)


_ANY_OBJECT = json.dumps({"type": "object"})
_LEAD_WS = 2
"""Whitespace characters a call's grammar allows between the marker and the object."""


@attrs.frozen
class LazyCalls:
    """Tool calls in a free reply (tool choice ``AUTO`` with a ``strict`` tool), each decoded
    under a grammar from its ``<tool_call>`` marker to its closing marker; text outside calls
    is free.

    The engine follows the reply with a :class:`CallWatch` and puts the grammar
    :meth:`after` the marker on the sequence's sampler chain from the next token.

    Attributes:
        tools: the request's tools: a ``strict`` tool's arguments are decoded under its
            schema, another tool's under "any JSON object" (its schema was not checked
            for what the grammar can enforce, and ``strict`` false asks for no more).
    """

    tools: tuple[ToolSpec, ...]

    def after(self, text: str) -> Constraint | None:
        """The grammar of the rest of a call whose text after the ``<tool_call>`` marker
        is ``text`` (what the marker's token held after it, usually ``"\\n"`` or ``""``):
        whitespace, ``{"name": NAME, "arguments": ARGS}`` with NAME one of :attr:`tools`
        and ARGS valid for it, then ``\\n</tool_call>``, as
        :func:`~ringserve.core.toolcalls.format_call` writes a call. Its
        :attr:`~Constraint.value` is the first tool's arguments.

        Returns None when ``text`` is not whitespace followed by a start of
        ``{"name": `` (a token that holds the marker's end and more of the object; the
        call is then not constrained).
        """
        return GRAMMAR_CACHE.get(("lazy", self.tools, text), lambda: _lazy_rest(self.tools, text))


def _lazy_rest(tools: tuple[ToolSpec, ...], text: str) -> Constraint | None:
    stripped = text.lstrip(" \t\n")
    if not _HEAD.startswith(stripped):
        return None
    schemas = [t.parameters if t.strict else _ANY_OBJECT for t in tools]
    conv, body = _call_bodies(tools, schemas)
    head = _HEAD[len(stripped) :]
    lead = "" if stripped else f"[ \\t\\n]{{0,{_LEAD_WS}}} "
    literal = f"{conv.literal(head)} " if head else ""
    conv.rule("root", f"{lead}{literal}( {body} ) {conv.literal('}' + CALL_CLOSE)}")
    first = tools[0]
    frame = (f"{head}{json.dumps(first.name)}, {json.dumps('arguments')}: ", "}" + CALL_CLOSE)
    return Constraint(conv.grammar(), schemas[0], frame)


@attrs.frozen
class GrammarOn:
    """Put ``constraint`` first on the sequence's sampler chain, from its next token on."""

    constraint: Constraint


@attrs.frozen
class GrammarOff:
    """Take the call's grammar off the sequence's sampler chain: the call is complete."""


@attrs.define(eq=False)
class CallWatch:
    """Follows one sequence's sampled pieces and says when a call's grammar goes on and off
    (sans-I/O; the engine calls :meth:`feed` right after it samples each token, so a switch
    applies to the very next token).

    It runs its own :class:`~ringserve.core.toolcalls.ToolCallParser` over the decoded
    text, the same parser the reply stage runs, so both agree on where a call starts and
    ends (a ``</tool_call>`` inside an argument string is not an end). On: the token that
    completes ``<tool_call>``, with :meth:`LazyCalls.after` of what that token held
    after the marker. Off: the token that completes the call (under the grammar, the
    ``>`` of ``</tool_call>``); the next call turns it on again. A call that cannot be
    constrained (:meth:`LazyCalls.after` is None, or its grammar cannot be made: logged, as
    ``engine/llama.py`` logs a grammar llama.cpp cannot parse) or read (``ToolCallError``,
    which the reply stage reports too) ends the watch: it never raises, so one sequence's
    grammar never fails the engine's other slots.
    """

    calls: LazyCalls
    _parser: ToolCallParser = attrs.field(init=False)
    _text: Detokenizer = attrs.field(init=False, factory=Detokenizer)
    _tail: str = attrs.field(init=False, default="")
    _on: bool = attrs.field(init=False, default=False)
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._parser = ToolCallParser(frozenset(t.name for t in self.calls.tools))

    def feed(self, piece: bytes) -> GrammarOn | GrammarOff | None:
        """The switch that the token of ``piece`` (its bytes) makes, if any."""
        text = self._text.feed(piece)
        if self._done or not text:
            return None
        was_in_call = self._parser.in_call
        seen = self._tail + text
        try:
            pieces = self._parser.feed(text)
        except ToolCallError:
            self._done = True
            return GrammarOff() if self._on else None
        self._tail = "" if self._parser.in_call else seen[-(len(OPEN_MARK) - 1) :]
        if self._on and any(isinstance(p, CallEnd) for p in pieces):
            self._on = False
            return GrammarOff()
        if not was_in_call and self._parser.in_call:
            try:
                constraint = self.calls.after(seen[seen.find(OPEN_MARK) + len(OPEN_MARK) :])
            except RingserveError as exc:  # made at admission for the same tools: not expected here
                log.error("a tool call's grammar could not be made; the call is not constrained: %s", exc)
                constraint = None
            if constraint is None:
                self._done = True
                return None
            self._on = True
            return GrammarOn(constraint)
        return None


def constraint_for(request: GenerationRequest) -> Constraint | LazyCalls | None:
    """The grammar a request's reply is decoded under, or None for free text.

    * a forced tool: ``REQUIRED``, calls of any of the tools, one or with
      ``parallel`` up to :data:`MAX_CALLS`; ``NAMED``, one call of that tool
      (a small model asked for "the" call repeats it until the limit):
      :func:`calls_grammar`;
    * otherwise ``JSON_OBJECT`` / ``JSON_SCHEMA`` output: :func:`output_grammar`
      (with tools under ``AUTO`` the model then cannot call them);
    * otherwise, ``AUTO`` with at least one ``strict`` tool: :class:`LazyCalls`,
      free text whose calls are decoded under a grammar from their marker on (the
      grammar is made here once, so a schema it cannot take fails as a forced tool's);
    * otherwise None.

    The error fields are surface-neutral (``tools[i].parameters``,
    ``output.schema``); surfaces check :func:`enforced_schemas` with their own
    spellings first.

    Raises:
        RingserveError: ``INVALID_REQUEST``: a schema the grammar cannot
            enforce, or a ``NAMED`` tool that is not among the tools.
    """
    enforced = enforced_schemas(request)
    for index, schema in enforced:
        check_schema(schema, "output.schema" if index is None else f"tools[{index}].parameters")
    if enforced:
        check_repeats([schema for _, schema in enforced], "output" if enforced[0][0] is None else "tools")
    tools, choice = request.tools, request.tool_choice
    if tools and choice.mode is ToolChoiceMode.REQUIRED:
        return calls_grammar(tools, choice.parallel)
    if tools and choice.mode is ToolChoiceMode.NAMED:
        for tool in tools:
            if tool.name == choice.name:
                return calls_grammar([tool], False)
        raise invalid(f"tool_choice names {choice.name!r}, which is not one of the tools", "tool_choice")
    match request.output.kind:
        case OutputKind.TEXT:
            if tools and choice.mode is ToolChoiceMode.AUTO and any(t.strict for t in tools):
                calls = LazyCalls(tuple(tools))
                calls.after("")  # made now (and kept), so a schema it cannot take is refused before admission
                return calls
            return None
        case OutputKind.JSON_OBJECT:
            return output_grammar("", "output")
        case OutputKind.JSON_SCHEMA:
            return output_grammar(request.output.schema, "output.schema")
        case _:
            assert_never(request.output.kind)
