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

Tool calls are spelled in the model's own syntax: the arguments' rules come from the
converter (one per tool, and one per property for syntaxes that write parameters apart,
:class:`~ringserve.formats.base.ToolRules`), and the model format's
:meth:`~ringserve.formats.base.ChatFormat.call_grammar` puts them in its markup; a forced
reply may start with the format's thinking block, which a JSON answer may too
(:func:`~ringserve.formats.base.answer_start`).

Grammars are cached (:data:`GRAMMAR_CACHE`, least recently used first out, at most
:data:`CACHE_BYTES`) keyed by the schema texts and the format; their rule ``root`` is where
decoding starts.
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
from ringserve.core.events import FREEFORM_ARGUMENT, GenerationRequest, OutputKind, ToolChoiceMode, ToolSpec
from ringserve.core.lark import json_string, lark_rules
from ringserve.core.schema import check_repeats, check_schema, cleaned, enforced_schemas, ref_target, subschemas
from ringserve.core.toolcalls import CallEnd, OutputParser, ToolCallError
from ringserve.formats.base import CallGrammar, ChatFormat, ParamRule, ToolRules, answer_start
from ringserve.formats.generic import GENERIC
from ringserve.formats.tools import raw_param

log = logging.getLogger("ringserve.engine")

__all__ = [
    "CACHE_BYTES",
    "GRAMMAR_CACHE",
    "MAX_CALLS",
    "CallWatch",
    "Constraint",
    "ExampleCall",
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
class ExampleCall:
    """How a text under a calls grammar writes its first call: the call of ``tool`` as family
    ``family`` writes it (:meth:`~ringserve.formats.base.ChatFormat.write_call`), less its
    first ``skip`` characters (the trigger and head a lazy grammar starts after)."""

    family: str
    tool: str
    skip: int = 0


@attrs.frozen
class Constraint:
    """A sequence's output decoded under a grammar.

    Attributes:
        grammar: GBNF text (llama.cpp ``grammars/README.md``), start rule ``root``.
        value: the schema (checked JSON text) of the JSON value a text under the grammar holds:
            the answer, or the first tool's arguments.
        frame: the text before and after that value (or :attr:`call`) in the shortest such
            text (a thinking block's end, a call's head and end).
        call: for calls, how the value is written: in a call of the format's syntax.
            ``engine/examples.py`` makes a text the grammar accepts from these (the fake
            engine's reply); nothing on a request's path builds it.
    """

    grammar: str
    value: str
    frame: tuple[str, str] = ("", "")
    call: ExampleCall | None = None


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

    def add(self, schema: dict[str, Any], url: str, name: str, root: dict[str, Any] | None = None) -> str:
        """Visit one cleaned schema as rule ``name``; return the rule that matches it.

        Its ``$ref`` targets are registered by walking its schema nodes only (the bundled
        ``resolve_refs`` walks every object, ``const`` and ``enum`` values included, and
        rewrote a ``"$ref"`` key there), each ref made unique by prefixing ``url``, and
        resolved in ``root`` (the schema itself by default; the whole schema for a node of
        it, such as a property, added under the same ``url``)."""
        stack = [schema]
        while stack:
            node = stack.pop()
            if "$ref" in node:
                full = url + node["$ref"]
                self._refs[full] = ref_target(schema if root is None else root, node["$ref"])
                node["$ref"] = full
            stack += subschemas(node)
        return str(self.visit(schema, name))  # type: ignore[no-untyped-call]

    def rule(self, name: str, body: str) -> str:
        return str(self._add_rule(name, body))  # type: ignore[no-untyped-call]

    def any_value(self) -> str:
        """The rule of any JSON value."""
        return str(self._add_primitive("value", _lg.PRIMITIVE_RULES["value"]))

    def literal(self, text: str) -> str:
        return self._format_literal(text)

    def grammar(self) -> str:
        if "char" in self._rules:
            self._rules["char"] = _SAFE_CHAR
        return str(self.format_grammar())  # type: ignore[no-untyped-call]


def _convert(schemas: Sequence[tuple[str, str]]) -> tuple[_Converter, list[str]]:
    """A converter holding the rules ``s<i>`` of ``schemas`` (``(text, where)``), and those rules.

    Raises:
        RingserveError: a schema the converter cannot take (naming its ``where``).
    """
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
            return [item.name, item.description, item.parameters, item.grammar]
        case Constraint():
            return [item.grammar, item.value, *item.frame, *_texts(item.call)]
        case ExampleCall():
            return [item.family, item.tool]
        case _Lazy():
            return [item.rules, item.value, item.calls.trigger, item.calls.head, item.calls.one]
        case tuple():
            return [text for part in item for text in _texts(part)]
    return []


def _entry_bytes(key: Hashable, value: Constraint | _Lazy | None) -> int:
    return sum(sys.getsizeof(text) for text in (*_texts(key), *_texts(value)))


GRAMMAR_CACHE: ByteLRU[Constraint | _Lazy | None] = ByteLRU(CACHE_BYTES, _entry_bytes)
"""Every grammar made, by what it was made from (the format by its name)."""


def output_grammar(schema: str, where: str, chat_format: ChatFormat = GENERIC, reasoning_open: bool = False) -> Constraint:
    """The grammar of a JSON answer: an object valid under ``schema`` (``""``: any object),
    after the format's thinking block where it has one (:func:`~ringserve.formats.base.answer_start`).

    Raises:
        RingserveError: as :func:`check_schema`.
    """
    key = ("output", schema, where, chat_format.name, reasoning_open)
    constraint = GRAMMAR_CACHE.get(key, lambda: _output_grammar(schema, where, chat_format, reasoning_open))
    assert isinstance(constraint, Constraint)
    return constraint


def _output_grammar(schema: str, where: str, chat_format: ChatFormat, reasoning_open: bool) -> Constraint:
    text = schema or '{"type": "object"}'
    conv, (value,) = _convert([(text, where)])
    start = answer_start(chat_format.reasoning, reasoning_open)
    for name, body in start.rules:
        conv.rule(name, body)
    conv.rule("root", f"{start.expression} {value}" if start.expression else value)
    return Constraint(conv.grammar(), text, (start.shortest, ""))


def _freeform_rules(conv: _Converter, tool: ToolSpec, i: int) -> ToolRules:
    """A freeform tool's :class:`ToolRules`: its one argument, the input text, under the tool's
    Lark grammar (``core/lark.py``): raw where the syntax writes it as text (rules ``ff<i>-``),
    inside the JSON string of ``{"input": ...}`` where it writes JSON (rules ``ffj<i>-``,
    :func:`~ringserve.core.lark.json_string`)."""
    raw, raw_rules = lark_rules(tool.grammar, prefix=f"ff{i}-")
    quoted, quoted_rules = lark_rules(tool.grammar, prefix=f"ffj{i}-")
    for name, body in raw_rules:
        conv.rule(name, body)
    for name, body in quoted_rules:
        conv.rule(name, json_string(body))
    value = conv.rule(f"ffj{i}-value", f'"\\"" {quoted} "\\""')
    space = "[ \\t\\n]*"
    arguments = conv.rule(f"ffj{i}-arguments",
                          f'"{{" {space} {conv.literal(json.dumps(FREEFORM_ARGUMENT))} {space} ":" {space} {value} {space} "}}"')
    return ToolRules(tool.name, arguments, (ParamRule(FREEFORM_ARGUMENT, value, True, True, raw),))


def _tool_rules(tools: Sequence[ToolSpec], schemas: Sequence[str]) -> tuple[_Converter, list[ToolRules]]:
    """The :class:`ToolRules` of ``tools`` (``schemas[i]`` for ``tools[i]``) and the converter
    holding their rules: the arguments' rule ``s<i>`` (:func:`_convert`), and one per property. A tool decoded under "any
    object" (``_ANY_OBJECT``, a lazy grammar's loose tool) keeps its own schema's property
    names, each any JSON value, none required. A freeform tool with a grammar takes it
    (:func:`_freeform_rules`)."""
    conv, arguments = _convert([(text, f"tools[{i}].parameters") for i, text in enumerate(schemas)])
    rules = []
    for i, (tool, text, args) in enumerate(zip(tools, schemas, arguments, strict=True)):
        where = f"tools[{i}].parameters"
        if tool.grammar:
            rules.append(_freeform_rules(conv, tool, i))
            continue
        if text == _ANY_OBJECT:
            any_value = conv.any_value()
            params = tuple(ParamRule(name, any_value, raw_param(prop), False) for name, prop in _properties(tool))
        else:
            schema = cleaned(text, where)
            required = schema.get("required", ())
            try:
                params = tuple(
                    ParamRule(name, conv.add(prop, f"s{i}", f"s{i}-p{j}", schema), raw_param(prop), name in required)
                    for j, (name, prop) in enumerate(schema.get("properties", {}).items())
                )
            except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
                raise invalid(f"{where}: the schema cannot be turned into a grammar ({exc})", where) from None
        rules.append(ToolRules(tool.name, args, params))
    return conv, rules


def _properties(tool: ToolSpec) -> list[tuple[str, Any]]:
    """The properties a tool's schema names (none when it is not JSON or names none)."""
    try:
        schema = json.loads(tool.parameters)
    except ValueError:
        return []
    props = schema.get("properties") if isinstance(schema, dict) else None
    return list(props.items()) if isinstance(props, dict) else []


def _forced_grammar(chat_format: ChatFormat, rules: Sequence[ToolRules], parallel: bool) -> CallGrammar:
    """The format's call grammar for a forced tool.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``tool_choice``: the format's calls cannot
            be forced by a grammar.
    """
    try:
        return chat_format.call_grammar(rules, parallel)
    except NotImplementedError:
        raise invalid(f"tool_choice: this model's tool calls ({chat_format.name}) cannot be forced", "tool_choice") from None


def calls_grammar(
    tools: Sequence[ToolSpec], parallel: bool, chat_format: ChatFormat = GENERIC, reasoning_open: bool = False
) -> Constraint:
    """The grammar of a reply that is only tool calls, each naming one of ``tools``, in the
    format's syntax, after its thinking block where it has one (required when the prompt
    opened it).

    One call when ``parallel`` is False, else several (a unit per call up to
    :data:`MAX_CALLS`, or the calls of one section, as the syntax has it), each with
    arguments valid under that tool's schema. Its :attr:`~Constraint.value` is the first tool's
    arguments, written as :attr:`~Constraint.call` says.

    Raises:
        RingserveError: a schema the grammar cannot enforce (``param`` names
            ``tools[i].parameters``), or a format whose calls cannot be forced.
    """
    key = ("calls", tuple(tools), parallel, chat_format.name, reasoning_open)
    constraint = GRAMMAR_CACHE.get(key, lambda: _calls_grammar(tuple(tools), parallel, chat_format, reasoning_open))
    assert isinstance(constraint, Constraint)
    return constraint


def _calls_grammar(tools: tuple[ToolSpec, ...], parallel: bool, chat_format: ChatFormat, reasoning_open: bool) -> Constraint:
    conv, rules = _tool_rules(tools, [t.parameters for t in tools])
    grammar = _forced_grammar(chat_format, rules, parallel)
    for name, body in grammar.rules:
        conv.rule(name, body)
    conv.rule("root", grammar.forced(MAX_CALLS if parallel else 1, reasoning_open))
    frame = (grammar.forced_prefix(reasoning_open), "")
    return Constraint(conv.grammar(), tools[0].parameters, frame, ExampleCall(chat_format.name, tools[0].name))


_ANY_OBJECT = json.dumps({"type": "object"})


@attrs.frozen
class _Lazy:
    """A lazy grammar's parts but its root: every other rule (GBNF), the format's call
    grammar, the first tool's schema."""

    rules: str
    calls: CallGrammar
    value: str


@attrs.frozen
class LazyCalls:
    """Tool calls in a free reply (tool choice ``AUTO`` with a ``strict`` tool), each decoded
    under a grammar from its trigger (the format's call marker, ``<tool_call>``...) to the end
    of its unit; text outside calls is free.

    The engine follows the reply with a :class:`CallWatch` and puts the grammar
    :meth:`after` the trigger on the sequence's sampler chain from the next token.

    Attributes:
        tools: the request's tools: a ``strict`` tool's arguments are decoded under its
            schema, another tool's under "any JSON object" (its schema was not checked
            for what the grammar can enforce, and ``strict`` false asks for no more).
        chat_format: the model's format: the calls' syntax and the reply's parser.
        reasoning_open: the prompt opened the format's thinking block (the watch starts
            inside it).
        parallel: a unit may hold more than one call (syntaxes with a section of calls).
    """

    tools: tuple[ToolSpec, ...]
    chat_format: ChatFormat = GENERIC
    reasoning_open: bool = False
    parallel: bool = True

    @property
    def trigger(self) -> str:
        """The text that starts a call's unit (``""``: none can, the calls stay free)."""
        return self._parts().calls.trigger

    @property
    def one_call_units(self) -> bool:
        """Each unit holds one call, so the grammar goes off at the call's end; otherwise (a
        section of parallel calls) it stays on to the end of the reply, which after the section
        may only stop, as llama-server's lazy grammar has it."""
        calls = self._parts().calls
        return calls.repeat or not self.parallel

    def after(self, text: str) -> Constraint | None:
        """The grammar of the rest of a unit whose trigger the last token completed, with
        ``text`` after it in that token (:meth:`~ringserve.formats.base.CallGrammar.after`):
        the rest of the call's head, then its calls with the arguments valid for their tool.
        Its :attr:`~Constraint.value` is the first tool's arguments.

        Returns None when ``text`` goes beyond the head (a token that holds the marker's end
        and more; the call is then not constrained).

        Raises:
            RingserveError: a strict tool's schema the grammar cannot enforce.
            NotImplementedError: a format whose calls cannot be decoded under a grammar.
        """
        key = ("lazy", self.tools, self.chat_format.name, self.reasoning_open, self.parallel, text)
        constraint = GRAMMAR_CACHE.get(key, lambda: self._after(text))
        assert not isinstance(constraint, _Lazy)
        return constraint

    def _parts(self) -> _Lazy:
        key = ("lazy", self.tools, self.chat_format.name, self.parallel)
        parts = GRAMMAR_CACHE.get(key, self._make_parts)
        assert isinstance(parts, _Lazy)
        return parts

    def _make_parts(self) -> _Lazy:
        schemas = [t.parameters if t.strict else _ANY_OBJECT for t in self.tools]
        conv, rules = _tool_rules(self.tools, schemas)
        calls = self.chat_format.call_grammar(rules, self.parallel)
        for name, body in calls.rules:
            conv.rule(name, body)
        return _Lazy(conv.grammar(), calls, schemas[0])

    def _after(self, text: str) -> Constraint | None:
        parts = self._parts()
        calls = parts.calls
        root, rest = calls.after(text), calls.rest(text)
        if root is None or rest is None:
            return None
        skip = len(calls.trigger) + len(calls.head)
        call = ExampleCall(self.chat_format.name, self.tools[0].name, skip)
        return Constraint(f"{parts.rules}\nroot ::= {root}", parts.value, (rest, ""), call)


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

    It runs its own parser of the model's format over the decoded text, the one the reply
    stage runs, so both agree on where the thinking block is (a trigger inside it is
    thinking, not a call) and where a call ends (a ``</tool_call>`` inside an argument string
    is not an end). On: the token that completes the trigger outside the thinking block,
    with :meth:`LazyCalls.after` of what that token held after it. Off: the token that
    completes the call, where units hold one call (:attr:`LazyCalls.one_call_units`; the
    next trigger turns it on again). A call that cannot be constrained
    (:meth:`LazyCalls.after` is None, or its grammar cannot be made: logged, as
    ``engine/llama.py`` logs a grammar llama.cpp cannot parse) or read (``ToolCallError``,
    which the reply stage reports too) ends the watch: it never raises, so one sequence's
    grammar never fails the engine's other slots.
    """

    calls: LazyCalls
    _parser: OutputParser = attrs.field(init=False)
    _text: Detokenizer = attrs.field(init=False, factory=Detokenizer)
    _trigger: str = attrs.field(init=False)
    _tail: str = attrs.field(init=False, default="")
    _on: bool = attrs.field(init=False, default=False)
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        calls = self.calls
        self._parser = calls.chat_format.parser(calls.tools, reasoning_open=calls.reasoning_open)
        self._trigger = calls.trigger
        self._done = not self._trigger

    def feed(self, piece: bytes) -> GrammarOn | GrammarOff | None:
        """The switch that the token of ``piece`` (its bytes) makes, if any."""
        text = self._text.feed(piece)
        if self._done or not text:
            return None
        try:
            pieces = self._parser.feed(text)
        except ToolCallError:
            self._done = True
            return GrammarOff() if self._on else None
        if self._on:
            if self.calls.one_call_units and any(isinstance(p, CallEnd) for p in pieces):
                self._on = False
                return GrammarOff()
            return None
        if self._parser.in_reasoning:
            self._tail = ""
            return None
        seen = self._tail + text
        at = seen.rfind(self._trigger)
        if at < 0:
            self._tail = seen[-(len(self._trigger) - 1) :] if len(self._trigger) > 1 else ""
            return None
        self._tail = ""
        try:
            constraint = self.calls.after(seen[at + len(self._trigger) :])
        except RingserveError as exc:  # made at admission for the same tools: not expected here
            log.error("a tool call's grammar could not be made; the call is not constrained: %s", exc)
            constraint = None
        if constraint is None:
            self._done = True
            return None
        self._on = True
        return GrammarOn(constraint)


def constraint_for(
    request: GenerationRequest, chat_format: ChatFormat = GENERIC, reasoning_open: bool = False
) -> Constraint | LazyCalls | None:
    """The grammar a request's reply is decoded under, or None for free text, in the syntax
    of the model's format (``reasoning_open``: the prompt opened its thinking block).

    * a forced tool: ``REQUIRED``, calls of any of the tools, one or with
      ``parallel`` several; ``NAMED``, one call of that tool
      (a small model asked for "the" call repeats it until the limit):
      :func:`calls_grammar`;
    * otherwise ``JSON_OBJECT`` / ``JSON_SCHEMA`` output: :func:`output_grammar`
      (with tools under ``AUTO`` the model then cannot call them);
    * otherwise, ``AUTO`` with at least one ``strict`` tool: :class:`LazyCalls`,
      free text whose calls are decoded under a grammar from their trigger on (the
      grammar is made here once, so a schema it cannot take fails as a forced tool's),
      unless the format's calls cannot be decoded under a grammar (or have no trigger):
      then free, as without ``strict``;
    * otherwise None.

    The error fields are surface-neutral (``tools[i].parameters``,
    ``output.schema``); surfaces check :func:`enforced_schemas` with their own
    spellings first.

    Raises:
        RingserveError: ``INVALID_REQUEST``: a schema the grammar cannot
            enforce, a ``NAMED`` tool that is not among the tools, or a forced
            tool of a format whose calls cannot be decoded under a grammar.
    """
    enforced = enforced_schemas(request)
    for index, schema in enforced:
        check_schema(schema, "output.schema" if index is None else f"tools[{index}].parameters")
    if enforced:
        check_repeats([schema for _, schema in enforced], "output" if enforced[0][0] is None else "tools")
    tools, choice = request.tools, request.tool_choice
    if tools and choice.mode is ToolChoiceMode.REQUIRED:
        return calls_grammar(tools, choice.parallel, chat_format, reasoning_open)
    if tools and choice.mode is ToolChoiceMode.NAMED:
        for tool in tools:
            if tool.name == choice.name:
                return calls_grammar([tool], False, chat_format, reasoning_open)
        raise invalid(f"tool_choice names {choice.name!r}, which is not one of the tools", "tool_choice")
    match request.output.kind:
        case OutputKind.TEXT:
            if tools and choice.mode is ToolChoiceMode.AUTO and any(t.strict for t in tools):
                return _lazy_calls(LazyCalls(tuple(tools), chat_format, reasoning_open, choice.parallel))
            return None
        case OutputKind.JSON_OBJECT:
            return output_grammar("", "output", chat_format, reasoning_open)
        case OutputKind.JSON_SCHEMA:
            return output_grammar(request.output.schema, "output.schema", chat_format, reasoning_open)
        case _:
            assert_never(request.output.kind)


def _lazy_calls(calls: LazyCalls) -> LazyCalls | None:
    """``calls``, its grammar made now (and kept), so a schema it cannot take is refused
    before admission; None for a format whose calls cannot be decoded under a grammar, or
    start at no trigger (they stay free)."""
    try:
        trigger = calls.trigger
    except NotImplementedError:
        return None
    if not trigger:
        return None
    calls.after("")
    return calls
