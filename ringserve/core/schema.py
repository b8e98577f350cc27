"""Which JSON schemas ringserve decodes under a grammar: the keywords it enforces, refuses and
drops, and the bounds that keep a grammar affordable (sans-I/O; no ``llama_cpp``).

The grammar itself is made in ``engine/gbnf.py`` by llama-cpp-python's bundled copy of
llama.cpp's ``examples/json-schema-to-grammar.py`` (``llama_cpp.llama_grammar.SchemaConverter``).
That converter silently ignores much of JSON Schema, so every schema is first checked here: a
keyword the converter would not enforce is refused with a 400 that names it (and where it is),
never decoded as if it were not there. The surfaces check a request's schemas with these
functions, in their own field names, before anything else sees them.

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

Checked schemas are cached (:data:`CHECKED_CACHE`, least recently used first out, at most
:data:`CACHE_BYTES`) keyed by their text.
"""

from __future__ import annotations

import heapq
import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ringserve.core.cache import ByteLRU
from ringserve.core.errors import invalid
from ringserve.core.events import GenerationRequest, OutputKind, ToolChoiceMode

__all__ = [
    "ANNOTATIONS",
    "CACHE_BYTES",
    "CHECKED_CACHE",
    "MAX_DEPTH",
    "MAX_GRAMMAR_BYTES",
    "MAX_NODES",
    "MAX_OPTIONAL_PROPERTIES",
    "MAX_OPTIONAL_REPEATS",
    "MAX_REPEAT_PRODUCT",
    "MAX_REPEATS",
    "REFUSED",
    "check_repeats",
    "check_schema",
    "cleaned",
    "enforced_schemas",
    "grammar_bytes",
    "least_values",
    "ref_target",
    "subschemas",
    "LeastValues",
]

CACHE_BYTES = 16 << 20
"""The most the checked schemas kept may hold: their texts, as given and cleaned (``sys.getsizeof``)."""

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

MAX_REPEAT_PRODUCT = 20_000
"""Most repetitions the least value of any node of a schema may hold (see :class:`LeastValues`).

Bounds multiply along the nesting (arrays of arrays of strings, or a ``$ref`` used by many
required properties), where the grammar adds them up: 1,000 x 1,000 x 200 (about 300 bytes
of JSON, 2,200 repetitions in the grammar) forces 200 million characters into every value,
which no reply can hold (issue 36: building one such value took the server to 3.19 GB).
Equal to :data:`MAX_REPEATS`: a value no single bound may force more than.
"""

MAX_DEPTH = 64
"""Most levels of nesting in one schema (a property, an item, an alternative, a definition is
one level deeper): the checks and the converter recurse once per level."""

MAX_NODES = 2000
"""Most schema nodes (objects, arrays, strings... each ``{...}`` a schema) one request's
enforced schemas may hold in all. The converter names each node's rule after its path and
resolves names that clash after escaping by trying one after another: 2,000 properties whose
names escape to one rule name took it 1.1 s."""

MAX_OPTIONAL_PROPERTIES = 128
"""Most optional properties (not in ``required``) of one object. The converter writes one rule
per run of them, in time that grows with the square of their number and recursion as deep
as their number: 500 took 0.43 s, 900 took 2.1 s, and about 1,000 exhaust Python's stack."""

MAX_GRAMMAR_BYTES = 1 << 20
"""Most bytes the grammar of one request's enforced schemas may hold, as :func:`grammar_bytes`
estimates it before it is made (never below the size made: ``tests/engine/test_gbnf.py``).

Rule names are the nodes' paths, so a long property name is written once per node below it:
a 100 KB name over 100 properties made a 60 MB grammar in 6.6 s. llama.cpp parses a grammar
on the decode thread while every stream waits, about 0.35 s and 60 MB per megabyte
(:data:`MAX_REPEATS`); a 1 MiB grammar is some 5,000 nodes of ordinary names.
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
        self.nodes = 0  # the schema nodes cleaned so far
        self.positions: set[tuple[str, ...]] = set()  # where a '$ref' may point: the nodes' key paths
        self.refs: list[tuple[str, str]] = []  # every '$ref' met, and where
        self._paths: list[tuple[str, ...] | None] = []  # the key path of each node being cleaned

    def clean(self, node: Any, where: str, step: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Clean ``node``, at ``where``; ``step``: the keys from its parent to it (None in a list)."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Refused("", f"the schema holds more than {MAX_NODES} schemas (each {{...}} below it is one),"
                               " over the limit for one request's grammar")
        if len(self._paths) >= MAX_DEPTH:
            raise _Refused("", "the schema is nested too deeply")
        parent = self._paths[-1] if self._paths else ()
        path = None if step is None or parent is None else parent + step
        if path is not None:
            self.positions.add(path)
        self._paths.append(path)
        try:
            return self._clean(node, where)
        finally:
            self._paths.pop()

    def check_refs(self) -> None:
        """Refuse a ``$ref`` that names no schema of the document (run once it is all cleaned)."""
        for ref, where in self.refs:
            if tuple(ref[2:].split("/")) in self.positions:
                continue
            target = _target(self.root, ref)
            if target is None:
                raise _Refused(where, f"'$ref' {ref!r} does not resolve")
            what = {list: "a list", str: "a string", bool: "a boolean", dict: "an object"}.get(type(target), "a value")
            raise _Refused(where, f"'$ref' {ref!r} names {what} that is not a schema (a keyword's value)")

    def _clean(self, node: Any, where: str) -> dict[str, Any]:
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
                out[key] = {k: self.clean(v, f"{where}.{key}.{k}", (key, k)) for k, v in defs.items()}
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
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#/") or "~" in ref or "%" in ref:
                raise _Refused(where, f"'$ref' {ref!r} is not supported (only '#/...' paths into the same schema)")
            self.refs.append((ref, where))
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
            "properties": {k: self.clean(v, f"{where}.properties.{k}", ("properties", k)) for k, v in props.items()}
        }
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _Refused(where, "'required' must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise _Refused(where, f"'required' names {missing[0]!r}, which is not in 'properties'")
        optional = len(set(props) - set(required))
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise _Refused(where, f"{optional} optional properties (in 'properties', not in 'required'),"
                                  f" over the limit of {MAX_OPTIONAL_PROPERTIES} for one object")
        additional = node.get("additionalProperties", False)
        if props and additional is not False:
            # The grammar's extra keys may repeat a listed one, whose value then escapes its schema.
            raise _Refused(where, "keyword 'additionalProperties' is supported next to 'properties' only as false")
        if isinstance(additional, dict):
            children["additionalProperties"] = self.clean(additional, f"{where}.additionalProperties", ("additionalProperties",))
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
        return {"type", "items", "minItems", "maxItems"}, {"items": self.clean(items, f"{where}.items", ("items",))}


# -- what a cleaned schema costs: its least value, its grammar's size -----------------------


def _children(node: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The schemas the converter visits below ``node`` (its ``$ref`` target aside), each with
    its path below ``node`` as the checker writes it."""
    out = [(v, f".properties.{k}") for k, v in node.get("properties", {}).items()]
    out += [(v, f".anyOf[{i}]") for i, v in enumerate(node.get("anyOf", ()))]
    for key in ("items", "prefixItems", "additionalProperties"):
        value = node.get(key)
        if isinstance(value, dict):
            out.append((value, f".{key}"))
        elif isinstance(value, list):
            out += [(v, f".{key}[{i}]") for i, v in enumerate(value)]
    return out


def _nodes(root: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every schema node of a cleaned schema, ``$defs`` / ``definitions`` included, with its
    path, in document order."""
    found: list[tuple[dict[str, Any], str]] = []
    stack = [(root, "")]
    while stack:
        node, where = stack.pop()
        found.append((node, where))
        below = [(d, f"{where}.{key}.{k}") for key in _DEFS for k, d in node.get(key, {}).items()]
        below += [(child, where + path) for child, path in _children(node)]
        stack += reversed(below)
    return found


def _target(root: Any, ref: str) -> Any:
    """What the ``#/...`` path ``ref`` names in ``root``, or None."""
    target = root
    for part in ref[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target


def ref_target(root: dict[str, Any], ref: str) -> dict[str, Any]:
    """The schema node a checked ``$ref`` of cleaned schema ``root`` names (every one names a node)."""
    target = _target(root, ref)
    assert isinstance(target, dict), ref
    return target


def subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The schema nodes right below a cleaned node: its definitions, properties, items,
    alternatives and ``additionalProperties`` schema (not a ``$ref``'s target)."""
    return [d for key in _DEFS for d in node.get(key, {}).values()] + [child for child, _ in _children(node)]


@attrs.frozen
class LeastValues:
    """The least value of each node of one cleaned schema (by the node's ``id``), and the
    choices that make it: what a reply under the schema must hold at the least.

    A value's size counts repetitions: a string's ``minLength`` characters (at least 1), an
    array's ``minItems`` times its item's size, an object the sizes of its required
    properties added up (at least 1), any other value 1. ``sizes`` lacks a node with no
    finite value (every value of it holds itself, through required properties or items).
    ``choices`` gives, for a ``$ref`` or ``anyOf`` node, the target or alternative of its
    least value; following choices, required properties and ``minItems`` items always ends.
    """

    sizes: Mapping[int, int]
    choices: Mapping[int, dict[str, Any]]


_Spec = tuple[str, int, list[dict[str, Any]]]


def _spec(root: dict[str, Any], node: dict[str, Any]) -> _Spec:
    """How the size of ``node``'s least value follows from others': ``("min", 0, deps)`` the
    least of its deps (a ``$ref``'s target, ``anyOf``), ``("sum", base, deps)`` base plus
    theirs, ``("product", n, [dep])`` n times its one dep's."""
    if "$ref" in node:
        return "min", 0, [ref_target(root, node["$ref"])]
    if "anyOf" in node:
        return "min", 0, node["anyOf"]
    if "properties" in node:
        props = node["properties"]
        return "sum", 0, [props[name] for name in dict.fromkeys(node.get("required", ()))]
    items = node.get("prefixItems", node.get("items"))
    if isinstance(items, list):
        return "sum", 0, items
    if isinstance(items, dict) and node.get("minItems", 0) > 0:
        return "product", node["minItems"], [items]
    if node.get("type") == "string" and "const" not in node and "enum" not in node:
        return "sum", max(1, node.get("minLength", 0)), []
    return "sum", 1, []


def least_values(root: dict[str, Any], cap: int) -> LeastValues:
    """The :class:`LeastValues` of cleaned schema ``root``, sizes above ``cap`` counted as ``cap``.

    Knuth's generalisation of Dijkstra's algorithm ("A generalization of Dijkstra's
    algorithm", Information Processing Letters 6(1), 1977) over the nodes: a size depends on
    those below it through sums and products that are never smaller than any of their
    arguments, or a least alternative, so the nodes settle from the smallest size up;
    ``O(n log n)`` for ``n`` nodes, ``$ref`` cycles included.
    """
    nodes = [node for node, _ in _nodes(root)]
    specs = {id(node): _spec(root, node) for node in nodes}
    parents: dict[int, list[dict[str, Any]]] = {}
    waiting: dict[int, int] = {}
    queue: list[tuple[int, int, dict[str, Any], dict[str, Any] | None]] = []
    order = itertools.count()
    for node in nodes:
        kind, base, deps = specs[id(node)]
        for dep in deps:
            parents.setdefault(id(dep), []).append(node)
        if kind == "sum" and not deps:
            heapq.heappush(queue, (min(cap, max(1, base)), next(order), node, None))
        elif kind != "min":
            waiting[id(node)] = len(deps)
    sizes: dict[int, int] = {}
    choices: dict[int, dict[str, Any]] = {}
    while queue:
        size, _, node, via = heapq.heappop(queue)
        if id(node) in sizes:
            continue
        sizes[id(node)] = size
        if via is not None:
            choices[id(node)] = via
        for parent in parents.get(id(node), ()):
            if id(parent) in sizes:
                continue
            kind, base, deps = specs[id(parent)]
            if kind == "min":
                heapq.heappush(queue, (size, next(order), parent, node))
                continue
            waiting[id(parent)] -= 1
            if waiting[id(parent)] == 0:
                total = base * sizes[id(deps[0])] if kind == "product" else base + sum(sizes[id(d)] for d in deps)
                heapq.heappush(queue, (min(cap, max(1, total)), next(order), parent, None))
    return LeastValues(sizes, choices)


def _check_values(root: dict[str, Any]) -> None:
    """Refuse a schema with a node the converter visits that has no finite value (its grammar
    could never be completed: llama.cpp decodes until ``max_tokens``), or whose least value
    holds more than :data:`MAX_REPEAT_PRODUCT` repetitions, naming the keyword that multiplies
    past it (a single bound past it is :func:`check_repeats`' to refuse)."""
    least = least_values(root, MAX_REPEAT_PRODUCT + 1)
    seen = {id(root)}
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) not in least.sizes:
            raise _Refused("", "the schema has no finite value (a '$ref' cycle through required properties)")
        below = [child for child, _ in _children(node)]
        if "$ref" in node:
            below.append(ref_target(root, node["$ref"]))
        for child in below:
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    for node, where in _nodes(root):
        kind, base, deps = _spec(root, node)
        if id(node) not in least.sizes or least.sizes[id(node)] <= MAX_REPEAT_PRODUCT or not deps or kind == "min":
            continue
        if any(least.sizes.get(id(d), 0) > MAX_REPEAT_PRODUCT for d in deps):
            continue  # past the limit below: that node is named
        if kind == "product":
            each = least.sizes[id(deps[0])]
            why = f"'minItems' {base} times the {each} repetitions each item holds at the least is {base * each}"
        else:
            total = sum(least.sizes[id(d)] for d in deps)
            keyword = "required" if "properties" in node else "prefixItems" if "prefixItems" in node else "items"
            why = f"the {len(deps)} values '{keyword}' asks for hold {total} repetitions at the least"
        raise _Refused(where, f"{why}, over the limit of {MAX_REPEAT_PRODUCT} for any value (bounds multiply"
                              " along the nesting)")


def _check_left_recursion(root: dict[str, Any]) -> None:
    """Refuse a ``$ref`` that leads back to itself through ``$ref`` and ``anyOf`` alone, before
    any character: a left-recursive grammar (``ref0 ::= ref0-0 | integer``), which llama.cpp's
    grammar parser refuses, so the engine could not start the request."""
    placed = _nodes(root)
    where = {id(node): at for node, at in placed}

    def first(node: dict[str, Any]) -> list[dict[str, Any]]:
        if "$ref" in node:
            return [ref_target(root, node["$ref"])]
        return list(node.get("anyOf", ()))

    state: dict[int, bool] = {}  # False while its descendants are walked, True once done
    for start, _ in placed:
        if id(start) in state:
            continue
        state[id(start)] = False
        path = [start]
        stack = [iter(first(start))]
        while stack:
            node = next(stack[-1], None)
            if node is None:
                state[id(path.pop())] = True
                stack.pop()
            elif id(node) not in state:
                state[id(node)] = False
                path.append(node)
                stack.append(iter(first(node)))
            elif not state[id(node)]:  # on the path: a cycle, which passes a $ref
                cycle = path[[id(n) for n in path].index(id(node)):]
                ref = next(n for n in cycle if "$ref" in n)
                raise _Refused(where[id(ref)], f"'$ref' {ref['$ref']!r} leads back to itself through '$ref' and"
                                               " 'anyOf' alone (left recursion, which llama.cpp's grammar parser refuses)")


_RULE_BYTES = 4
"""Times a node's rule name is written, at most: its rule, its parent's, an object's optional run."""

_FIXED_BYTES = 4096
"""What one grammar holds whatever its schemas: the primitive rules (``string``, ``number``,
``char``, the formats...) and the root rule (measured: under 2 KB)."""


def _estimate(root: dict[str, Any]) -> int:
    """An estimate, never below the size the converter makes (``engine/gbnf.py``), of the bytes
    the grammar of cleaned schema ``root`` holds: each node's rule name is its path (a
    property's name added to its parent's), written a few times; each property's key and each
    ``const`` / ``enum`` value is a literal; each repetition a bound writes names its item's rule.
    """
    total = 256  # a call's head and end around it, with its tool's name
    stack = [(root, 8)]  # a node and the length of its rule name ("s12", "ref3", then paths)
    while stack:
        node, name = stack.pop()
        total += _RULE_BYTES * (name + 8) + 16
        for key in _DEFS:
            stack += [(d, 8) for d in node.get(key, {}).values()]  # named "refN" where used
        for key, child in node.get("properties", {}).items():
            kv = name + len(key) + 12  # "<name>-<key>-kv", "<name>-<key>-rest"
            total += 2 * _RULE_BYTES * kv + 2 * len(json.dumps(key)) + 32
            stack.append((child, name + 1 + len(key)))
        for i, alt in enumerate(node.get("anyOf", ())):
            stack.append((alt, name + 2 + len(str(i))))
        for i, item in enumerate(node.get("prefixItems", ())):
            stack.append((item, name + 8 + len(str(i))))
        items = node.get("items")
        if isinstance(items, list):
            stack += [(item, name + 8 + len(str(i))) for i, item in enumerate(items)]
        elif isinstance(items, dict):
            stack.append((items, name + 6))
            total += (name + 32) * node.get("maxItems", node.get("minItems", 0))
        if isinstance(node.get("additionalProperties"), dict):
            stack.append((node["additionalProperties"], name + 18))
            total += _RULE_BYTES * (name + 24)
        total += 12 * node.get("maxLength", node.get("minLength", 0))
        values = node.get("enum", [node["const"]] if "const" in node else [])
        total += sum(2 * len(json.dumps(v)) + 16 for v in values)
    return total


def cleaned(text: str, where: str, param: str | None = None) -> dict[str, Any]:
    """The cleaned schema of ``text`` (annotations dropped), an object schema.

    Raises:
        RingserveError: as :func:`check_schema`.
    """
    try:
        return json.loads(_cached_clean(text).text)  # type: ignore[no-any-return]
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
    cleaned(text, where, param)


def grammar_bytes(schemas: Sequence[str]) -> int:
    """An estimate, never below the size made, of the bytes of the one grammar that enforces
    ``schemas`` (each passed :func:`check_schema`): what :func:`check_repeats` bounds."""
    return _FIXED_BYTES + sum(_cached_clean(text).grammar_bytes for text in schemas)


def check_repeats(schemas: Sequence[str], param: str) -> None:
    """Check that the schemas one request enforces (each already passed :func:`check_schema`)
    write at most :data:`MAX_REPEATS` repetitions into its grammars in all, hold at most
    :data:`MAX_NODES` schema nodes, and make a grammar of at most :data:`MAX_GRAMMAR_BYTES`.

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param``, giving the total.
    """
    checked = [_cached_clean(text) for text in schemas]
    total = sum(c.repeats for c in checked)
    if total > MAX_REPEATS:
        raise invalid(
            f"the schemas' minLength/maxLength/minItems/maxItems add up to {total} repetitions,"
            f" over the limit of {MAX_REPEATS} for one request's grammar",
            param,
        )
    nodes = sum(c.nodes for c in checked)
    if nodes > MAX_NODES:
        raise invalid(f"the schemas hold {nodes} schemas in all (each {{...}} in them is one),"
                      f" over the limit of {MAX_NODES} for one request's grammar", param)
    size = grammar_bytes(schemas)
    if size > MAX_GRAMMAR_BYTES:
        raise invalid(f"the schemas make a grammar of about {size} bytes (each rule is named after its"
                      f" property names, nested), over the limit of {MAX_GRAMMAR_BYTES} for one request", param)



@attrs.frozen
class _Checked:
    """A schema that passed the checks: its cleaned JSON ``text``, the ``repeats`` its bounds
    write into a grammar, its schema ``nodes`` and the estimated ``grammar_bytes``."""

    text: str
    repeats: int
    nodes: int
    grammar_bytes: int


CHECKED_CACHE: ByteLRU[_Checked] = ByteLRU(CACHE_BYTES, lambda text, checked: sys.getsizeof(text) + sys.getsizeof(checked.text))
"""Every schema that passed the checks, by its text (failures are not kept)."""


def _cached_clean(text: str) -> _Checked:
    """The checked schema of ``text`` (from :data:`CHECKED_CACHE`).

    Raises:
        _Refused: it does not pass.
    """
    return CHECKED_CACHE.get(text, lambda: _check(text))


def _check(text: str) -> _Checked:
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise _Refused("", f"the schema is not valid JSON ({exc})") from None
    checker = _Checker(schema)
    cleaned = checker.clean(schema, "", ())
    checker.check_refs()
    typ = cleaned.get("type")
    if typ != "object" and not (typ is None and ("properties" in cleaned or "additionalProperties" in cleaned)):
        raise _Refused("", 'the schema must be an object schema ("type": "object")')
    _check_values(cleaned)
    _check_left_recursion(cleaned)
    return _Checked(json.dumps(cleaned), checker.repeats, checker.nodes, _estimate(cleaned))


def enforced_schemas(request: GenerationRequest) -> list[tuple[int | None, str]]:
    """The schemas ``engine/gbnf.py`` ``constraint_for`` enforces or checks, as ``(tool index, schema text)``
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
