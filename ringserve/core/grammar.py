"""JSON schema to GBNF grammar, for decoding tool calls and JSON answers under a grammar.

The conversion is llama-cpp-python's bundled copy of llama.cpp's
``examples/json-schema-to-grammar.py`` (``llama_cpp.llama_grammar.SchemaConverter``;
pure Python, it does not load the native library). That converter silently
ignores much of JSON Schema, so every schema is first checked here: a keyword
the converter would not enforce is refused with a 400 that names it (and where
it is), never decoded as if it were not there.

What is enforced (per schema node, following the converter's own dispatch in
``SchemaConverter.visit``):

* ``$ref`` to the same document (``#/...``, ``$defs`` / ``definitions``,
  recursion included), alone;
* ``anyOf`` (a non-empty list), alone;
* ``type`` as a list of JSON type names, alone;
* ``const``; ``enum`` (non-empty); either with a ``type`` their values have;
* objects: ``properties``, ``required`` (names among ``properties``),
  ``additionalProperties``: ``false`` (absent means ``false`` too: the
  grammar emits only the listed properties, which still validates), or,
  without ``properties``, ``true`` or a schema (a map); next to
  ``properties`` it is refused, as an extra key could repeat a listed one;
* arrays: ``items`` (a schema) with ``minItems`` / ``maxItems``; ``prefixItems``
  or ``items`` as a list (a tuple, exactly those items);
* strings: ``minLength`` / ``maxLength``; ``format`` ``date``, ``time``,
  ``date-time``, ``uuid``; a maximum at most :data:`MAX_OPTIONAL_REPEATS` above its
  minimum (strings and arrays), and the bounds of all the schemas one request enforces
  at most :data:`MAX_REPEATS` repetitions in all (:func:`check_repeats`);
* the types ``string``, ``number``, ``integer``, ``boolean``, ``null``,
  ``array``, ``object`` (any value of that type); ``{}`` is any object.

Annotations are accepted and dropped (:data:`ANNOTATIONS`). Everything else
is refused, among them (:data:`REFUSED` lists the standard ones) ``oneOf``
(decoded as ``anyOf``, exclusivity not enforced), ``allOf``, ``not``,
``pattern`` (the converter's regex translation is partial), ``minimum`` and the
other numeric bounds, ``patternProperties``, ``uniqueItems``, other formats
(``email``, ``uri``...), boolean schemas and unknown keywords.

Two fixes over the bundled converter (it is an older copy than llama.cpp's
current one): string characters exclude the control characters U+0000..U+001F
(JSON forbids them raw, ``json.loads`` refuses them), and literals (property
names, ``const`` / ``enum`` values) escape backslashes, so a name holding
``\\`` is emitted as valid JSON. ``$ref`` targets get rule names of their own,
so two tools' ``$defs`` of the same name never share a rule.

Grammars are cached (LRU, :data:`CACHE_SIZE` entries) keyed by the schema
texts; their rule ``root`` is where decoding starts.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, assert_never

import attrs
from ringserve.engine._native import llama_grammar as _lg

from ringserve.core.detokenizer import Detokenizer
from ringserve.core.errors import invalid
from ringserve.core.events import GenerationRequest, OutputKind, ToolChoiceMode, ToolSpec
from ringserve.core.toolcalls import CALL_CLOSE, CALL_OPEN, OPEN_MARK, CallEnd, ToolCallError, ToolCallParser, format_call

__all__ = [
    "ANNOTATIONS",
    "CACHE_SIZE",
    "MAX_CALLS",
    "MAX_OPTIONAL_REPEATS",
    "REFUSED",
    "CallWatch",
    "Constraint",
    "GrammarOff",
    "GrammarOn",
    "LazyCalls",
    "calls_grammar",
    "check_repeats",
    "check_schema",
    "enforced_schemas",
    "constraint_for",
    "example_instance",
    "output_grammar",
]

CACHE_SIZE = 256
"""Grammars kept by each cache (entries)."""

MAX_CALLS = 4
"""Most tool calls in one reply when parallel calls are allowed."""

MAX_REPEATS = 20_000
"""Most repetitions the length and item bounds of one request's enforced schemas may write in all.

A bound of N writes N copies of its item's rule into the grammar (a few bytes of GBNF each),
which llama.cpp parses on the decode thread at each begin, while every stream waits: 128
strict tools of 20 strings with ``maxLength`` 1000 each (2.56 million repetitions, about
140 KB of JSON) made a 20.7 MB grammar that took 7.0 s and 1.18 GB to parse; one
``minLength`` of 10**7 a 50 MB one. 20,000 is at most a few hundred kilobytes.
"""

MAX_OPTIONAL_REPEATS = 1000
"""Most optional repetitions a bound may leave (``maxLength - minLength``, ``maxItems - minItems``).

The converter writes each optional repetition as one more nested group (``(c (c ...)?)?``).
llama.cpp's grammar parser (``llama_sampler_init_grammar``, llama-cpp-python 0.3) refuses
such a rule past about this many ("exceeds sane defaults": 1,000 parses, 1,024 does not), and
from about 20,000 its recursive descent overflows the decode thread's stack: a segfault that
kills the server (measured with the bundled model's vocabulary). A lower bound alone is a flat
sequence, which it parses.
"""

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
    }
)
"""Keywords that do not constrain a value (JSON Schema 2020-12 annotations): accepted, dropped."""

_DEFS = ("$defs", "definitions")

REFUSED = frozenset(
    {
        "oneOf",
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "pattern",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "additionalItems",
        "$dynamicRef",
        "$anchor",
    }
)
"""Standard keywords the converter does not enforce (refused wherever they appear)."""

_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
_SAFE_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


@attrs.frozen
class Constraint:
    """A sequence's output decoded under a grammar.

    Attributes:
        grammar: GBNF text (llama.cpp ``grammars/README.md``), start rule ``root``.
        example: a text the grammar accepts (what the fake engine replies).
    """

    grammar: str
    example: str


class _Refused(Exception):
    """A schema problem, with the JSON path of the node (``where``) it is at."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where
        self.message = message


def _type_ok(value: Any, typ: str) -> bool:
    match typ:
        case "string":
            return isinstance(value, str)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "null":
            return value is None
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
    return False


def _non_negative_int(node: dict[str, Any], key: str, where: str) -> None:
    value = node.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Refused(where, f"'{key}' must be a non-negative integer")


def _bounds(node: dict[str, Any], low: str, high: str, where: str) -> int:
    """The repetitions a ``low``/``high`` pair (``minLength``/``maxLength``,
    ``minItems``/``maxItems``) writes into the grammar: ``high``, or ``low`` without one.

    Refuses a pair that is not two non-negative integers, has ``high`` below ``low``, or
    leaves more than :data:`MAX_OPTIONAL_REPEATS` optional repetitions."""
    _non_negative_int(node, low, where)
    _non_negative_int(node, high, where)
    if high not in node:
        return int(node.get(low, 0))
    span = node[high] - node.get(low, 0)
    if span < 0:
        raise _Refused(where, f"'{high}' is below '{low}'")
    if span > MAX_OPTIONAL_REPEATS:
        raise _Refused(
            where, f"'{high}' more than {MAX_OPTIONAL_REPEATS} above '{low}' is not supported (llama.cpp's grammar limit)"
        )
    return int(node[high])


class _Checker:
    """Walks a schema: refuses what the converter would not enforce, returns a copy without
    annotations (the converter mistakes an annotation-only node for an unknown type)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.repeats = 0  # what the bounds met so far write into the grammar (see _bounds)

    def clean(self, node: Any, where: str) -> dict[str, Any]:
        if not isinstance(node, dict):
            raise _Refused(where, "a schema must be a JSON object (boolean schemas are not supported)")
        for key in node:
            if key in REFUSED:
                raise _Refused(where, f"keyword '{key}' is not supported")
        out: dict[str, Any] = {}
        for key in _DEFS:
            if key in node:
                defs = node[key]
                if not isinstance(defs, dict):
                    raise _Refused(where, f"'{key}' must be an object of schemas")
                out[key] = {k: self.clean(v, f"{where}.{key}.{k}") for k, v in defs.items()}
        keys = {k for k in node if k not in ANNOTATIONS and k not in _DEFS}
        allowed, children = self._dispatch(node, keys, where)
        extra = sorted(keys - allowed)
        if extra:
            raise _Refused(where, f"keyword '{extra[0]}' is not supported here")
        for key in keys:
            out[key] = children.get(key, node[key])
        return out

    def _dispatch(self, node: dict[str, Any], keys: set[str], where: str) -> tuple[set[str], dict[str, Any]]:
        """The keywords the converter's branch for ``node`` honours, and the cleaned children."""
        typ = node.get("type")
        fmt = node.get("format")
        if "$ref" in keys:
            self._resolve(node["$ref"], where)
            return {"$ref"}, {}
        if "anyOf" in keys:
            alts = node["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise _Refused(where, "'anyOf' must be a non-empty list of schemas")
            return {"anyOf"}, {"anyOf": [self.clean(a, f"{where}.anyOf[{i}]") for i, a in enumerate(alts)]}
        if isinstance(typ, list):
            if not typ or not all(isinstance(t, str) and t in _TYPES for t in typ):
                raise _Refused(where, f"'type' must name JSON types, got {str(typ)[:60]}")
            return {"type"}, {}
        if typ is not None and not (isinstance(typ, str) and typ in _TYPES):
            raise _Refused(where, f"unknown type {str(typ)[:60]!r}")
        if "const" in keys or "enum" in keys:
            values = [node["const"]] if "const" in keys else node["enum"]
            if not isinstance(values, list) or not values:
                raise _Refused(where, "'enum' must be a non-empty list")
            if typ is not None and not all(_type_ok(v, typ) for v in values):
                raise _Refused(where, f"a value of 'enum'/'const' is not of type {typ!r}")
            return {"const" if "const" in keys else "enum", "type"}, {}
        required = node.get("required")
        if typ in (None, "object") and "properties" not in keys and isinstance(required, list) and required:
            raise _Refused(where, f"'required' names {required[0]!r}, which is not in 'properties' (there are none)")
        additional = node.get("additionalProperties")
        if typ in (None, "object") and ("properties" in keys or ("additionalProperties" in keys and additional is not True)):
            return self._object(node, keys, where)
        if typ in (None, "array") and ("items" in keys or "prefixItems" in keys):
            return self._array(node, keys, where)
        if typ in (None, "string") and isinstance(fmt, str) and fmt in _FORMATS:
            return {"type", "format"}, {}
        if "format" in keys:
            raise _Refused(where, f"format {fmt!r} is not supported")
        if typ == "string" and ("minLength" in keys or "maxLength" in keys):
            self.repeats += _bounds(node, "minLength", "maxLength", where)
            return {"type", "minLength", "maxLength"}, {}
        if typ is None and keys:
            raise _Refused(where, f"keyword '{sorted(keys)[0]}' is not supported without a matching 'type'")
        if typ == "object" and additional is True:
            return {"type", "additionalProperties"}, {}  # any object
        return {"type"}, {}

    def _object(self, node: dict[str, Any], keys: set[str], where: str) -> tuple[set[str], dict[str, Any]]:
        props = node.get("properties", {})
        if not isinstance(props, dict):
            raise _Refused(where, "'properties' must be an object of schemas")
        children: dict[str, Any] = {
            "properties": {k: self.clean(v, f"{where}.properties.{k}") for k, v in props.items()}
        }
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _Refused(where, "'required' must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise _Refused(where, f"'required' names {missing[0]!r}, which is not in 'properties'")
        additional = node.get("additionalProperties", False)
        if props and additional is not False:
            # The grammar's extra keys may repeat a listed one, whose value then escapes its schema.
            raise _Refused(where, "keyword 'additionalProperties' is supported next to 'properties' only as false")
        if isinstance(additional, dict):
            children["additionalProperties"] = self.clean(additional, f"{where}.additionalProperties")
        elif not isinstance(additional, bool):
            raise _Refused(where, "'additionalProperties' must be a boolean or a schema")
        return {"type", "properties", "required", "additionalProperties"}, children

    def _array(self, node: dict[str, Any], keys: set[str], where: str) -> tuple[set[str], dict[str, Any]]:
        if "items" in keys and "prefixItems" in keys:
            raise _Refused(where, "keyword 'prefixItems' is not supported together with 'items'")
        key = "items" if "items" in keys else "prefixItems"
        items = node[key]
        if isinstance(items, list):
            if not items:
                raise _Refused(where, f"'{key}' must not be empty")
            return {"type", key}, {key: [self.clean(s, f"{where}.{key}[{i}]") for i, s in enumerate(items)]}
        if key == "prefixItems":
            raise _Refused(where, "'prefixItems' must be a list of schemas")
        self.repeats += _bounds(node, "minItems", "maxItems", where)
        return {"type", "items", "minItems", "maxItems"}, {"items": self.clean(items, f"{where}.items")}

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#/") or "~" in ref or "%" in ref:
            raise _Refused(where, f"'$ref' {ref!r} is not supported (only '#/...' paths into the same schema)")
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise _Refused(where, f"'$ref' {ref!r} does not resolve")
            target = target[part]
        return target


def _checked(text: str, where: str, param: str | None = None) -> dict[str, Any]:
    """The cleaned schema of ``text``, an object schema; raises the 400 naming ``where``."""
    try:
        return json.loads(_cached_clean(text)[0])  # type: ignore[no-any-return]
    except _Refused as exc:
        at = where + exc.where
        raise invalid(f"{at}: {exc.message}", param or where) from None


def check_schema(text: str, where: str, param: str | None = None) -> None:
    """Check that ``text`` is an object schema the grammar can enforce.

    Args:
        text: the schema's JSON text.
        where: the request field it came from, e.g. ``tools[0].input_schema``
            (named in the message, and the error's ``param`` unless ``param`` is given).
        param: the error's ``param``.

    Raises:
        RingserveError: ``INVALID_REQUEST``: not JSON, not an object schema, or
            a keyword that is not enforced, e.g. ``tools[0].input_schema:
            keyword 'patternProperties' is not supported``; a keyword below the
            top is named with its path (``tools[0].input_schema.properties.a:
            keyword 'minimum' is not supported``).
    """
    _checked(text, where, param)


def check_repeats(schemas: Sequence[str], param: str) -> None:
    """Check that the schemas one request enforces (each already passed :func:`check_schema`)
    write at most :data:`MAX_REPEATS` repetitions into its grammars in all.

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param``, giving the total.
    """
    total = sum(_cached_clean(text)[1] for text in schemas)
    if total > MAX_REPEATS:
        raise invalid(
            f"the schemas' minLength/maxLength/minItems/maxItems add up to {total} repetitions,"
            f" over the limit of {MAX_REPEATS} for one request's grammar",
            param,
        )


@functools.lru_cache(maxsize=CACHE_SIZE)
def _cached_clean(text: str) -> tuple[str, int]:
    """The cleaned schema's JSON text and the repetitions its bounds write (cached; failures
    are not cached and raise :class:`_Refused`)."""
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise _Refused("", f"the schema is not valid JSON ({exc})") from None
    checker = _Checker(schema)
    try:
        cleaned = checker.clean(schema, "")
    except RecursionError:
        raise _Refused("", "the schema is nested too deeply") from None
    typ = cleaned.get("type")
    if typ != "object" and not (typ is None and ("properties" in cleaned or "additionalProperties" in cleaned)):
        raise _Refused("", 'the schema must be an object schema ("type": "object")')
    return json.dumps(cleaned), checker.repeats


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
        """Visit one cleaned schema as rule ``name``; return the rule that matches it."""
        return str(self.visit(self.resolve_refs(schema, url), name))  # type: ignore[no-untyped-call]

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
        cleaned = _checked(text, where)
        try:
            rules.append(conv.add(cleaned, f"s{i}", f"s{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise invalid(f"{where}: the schema cannot be turned into a grammar ({exc})", where) from None
    return conv, rules


@functools.lru_cache(maxsize=CACHE_SIZE)
def output_grammar(schema: str, where: str) -> Constraint:
    """The grammar of a JSON answer: an object valid under ``schema`` (``""``: any object).

    Raises:
        RingserveError: as :func:`check_schema`.
    """
    text = schema or '{"type": "object"}'
    conv, (value,) = _convert([(text, where)])
    conv.rule("root", value)
    return Constraint(conv.grammar(), _example(text, where))


def calls_grammar(tools: Sequence[ToolSpec], parallel: bool) -> Constraint:
    """The grammar of a reply that is only tool calls, each naming one of ``tools``.

    One call when ``parallel`` is False, else 1..:data:`MAX_CALLS`, separated by
    a newline; each is :func:`~ringserve.core.toolcalls.format_call`'s syntax,
    ``{"name": NAME, "arguments": ARGS}`` between the markers, with ARGS valid
    under that tool's schema. ``example``
    calls the first tool once.

    Raises:
        RingserveError: a schema the grammar cannot enforce (``param`` names
            ``tools[i].parameters``).
    """
    return _calls_grammar(tuple(tools), parallel)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _calls_grammar(tools: tuple[ToolSpec, ...], parallel: bool) -> Constraint:
    conv, body = _call_bodies(tools, [t.parameters for t in tools])
    call = conv.rule("call", f"{conv.literal(CALL_OPEN + _HEAD)} ( {body} ) {conv.literal('}' + CALL_CLOSE)}")
    root = call if not parallel else f'{call} ("\\n" {call}){{0,{MAX_CALLS - 1}}}'
    conv.rule("root", root)
    first = tools[0]
    return Constraint(conv.grammar(), format_call(first.name, _example(first.parameters, "tools[0].parameters")))


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
        :func:`~ringserve.core.toolcalls.format_call` writes a call. ``example``
        (what the fake engine writes) calls the first tool.

        Returns None when ``text`` is not whitespace followed by a start of
        ``{"name": `` (a token that holds the marker's end and more of the object; the
        call is then not constrained).
        """
        return _lazy_rest(self.tools, text)


@functools.lru_cache(maxsize=CACHE_SIZE)
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
    args = _example(schemas[0], "tools[0].parameters")
    example = f"{head}{json.dumps(first.name)}, {json.dumps('arguments')}: {args}}}{CALL_CLOSE}"
    return Constraint(conv.grammar(), example)


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
    constrained (:meth:`LazyCalls.after` is None) or read (``ToolCallError``, which the
    reply stage reports too) ends the watch.
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
            constraint = self.calls.after(seen[seen.find(OPEN_MARK) + len(OPEN_MARK) :])
            if constraint is None:
                self._done = True
                return None
            self._on = True
            return GrammarOn(constraint)
        return None


def _example(text: str, where: str) -> str:
    """The JSON text of :func:`example_instance` for schema ``text``.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``where``: a schema with no finite
            value, as one whose required properties lead back to it through ``$ref``.
    """
    try:
        return json.dumps(example_instance(_checked(text, where)))
    except RecursionError:
        raise invalid(f"{where}: the schema has no finite value (a '$ref' cycle through required properties)", where) from None


def example_instance(schema: dict[str, Any], root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value valid under a cleaned schema (from :func:`check_schema`'s rules) whose JSON
    text (``json.dumps``) the schema's grammar accepts: the first alternative, the first
    enum value, every property down to depth 3 (only the required ones below; required
    ones first, as the grammar orders them), the fewest array items allowed but 1, short
    strings."""
    root = schema if root is None else root
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return example_instance(target, root, depth + 1)
    if "anyOf" in schema:
        return example_instance(schema["anyOf"][0], root, depth)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    typ = schema.get("type")
    if isinstance(typ, list):
        typ = typ[0]
    elif typ is None and "format" in schema:
        typ = "string"
    elif typ is None and ("items" in schema or "prefixItems" in schema):
        typ = "array"
    if "properties" in schema or typ in (None, "object"):
        # The converter's order: the required properties, then the others, each in schema order.
        props = schema.get("properties", {})
        required = [k for k in props if k in schema.get("required", ())]
        optional = [k for k in props if k not in required] if depth < 3 else []
        return {k: example_instance(props[k], root, depth + 1) for k in required + optional}
    match typ:
        case "array":
            items = schema.get("items", schema.get("prefixItems", {}))
            if isinstance(items, list):
                return [example_instance(s, root, depth + 1) for s in items]
            n = max(schema.get("minItems", 0), min(1, schema.get("maxItems", 1)))
            return [example_instance(items, root, depth + 1) for _ in range(n)]
        case "string":
            fmt = schema.get("format", "")
            if fmt.startswith("uuid"):
                return "123e4567-e89b-12d3-a456-426614174000"
            if fmt in ("date", "time", "date-time"):
                return {"date": "2024-01-02", "time": "12:30:00Z", "date-time": "2024-01-02T12:30:00Z"}[fmt]
            n = max(schema.get("minLength", 0), min(7, schema.get("maxLength", 7)))
            return ("example" * (n // 7 + 1))[:n]
        case "number":
            return 1.5
        case "integer":
            return 1
        case "boolean":
            return True
        case "null":
            return None
    raise AssertionError(f"unexpected schema {schema!r}")  # pragma: no cover - cleaned schemas only



def enforced_schemas(request: GenerationRequest) -> list[tuple[int | None, str]]:
    """The schemas :func:`constraint_for` enforces or checks, as ``(tool index, schema text)``
    (index None: the output schema): every tool's under ``REQUIRED``, the named tool's under
    ``NAMED``; else the ``strict`` tools' under ``AUTO`` and a ``JSON_SCHEMA`` output's."""
    tools, choice = request.tools, request.tool_choice
    if tools and choice.mode is ToolChoiceMode.REQUIRED:
        return [(i, t.parameters) for i, t in enumerate(tools)]
    if tools and choice.mode is ToolChoiceMode.NAMED:
        return [(i, t.parameters) for i, t in enumerate(tools) if t.name == choice.name]
    schemas: list[tuple[int | None, str]] = []
    if tools and choice.mode is ToolChoiceMode.AUTO:
        schemas += [(i, t.parameters) for i, t in enumerate(tools) if t.strict]
    if request.output.kind is OutputKind.JSON_SCHEMA:
        schemas.append((None, request.output.schema))
    return schemas


def constraint_for(request: GenerationRequest) -> Constraint | LazyCalls | None:
    """The grammar a request's reply is decoded under, or None for free text.

    * a forced tool: ``REQUIRED``, calls of any of the tools, one or with
      ``parallel`` up to :data:`MAX_CALLS`; ``NAMED``, one call of that tool
      (a small model asked for "the" call repeats it until the limit):
      :func:`calls_grammar`;
    * otherwise ``JSON_OBJECT`` / ``JSON_SCHEMA`` output: :func:`output_grammar`
      (with tools under ``AUTO`` the model then cannot call them);
    * otherwise, ``AUTO`` with at least one ``strict`` tool: :class:`LazyCalls`,
      free text whose calls are decoded under a grammar from their marker on;
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
                return LazyCalls(tuple(tools))
            return None
        case OutputKind.JSON_OBJECT:
            return output_grammar("", "output")
        case OutputKind.JSON_SCHEMA:
            return output_grammar(request.output.schema, "output.schema")
        case _:
            assert_never(request.output.kind)
