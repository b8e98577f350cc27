"""A text each grammar accepts, made from the schema it enforces: the fake engine's reply to a
constrained request (``engine/fake.py``), and what the tests check grammars against.

Only the fake engine and tests build one, on the fake engine's decode thread: a request's
path never does (a value that must hold many repetitions costs as many to build; the schema
checks of ``core/schema.py`` bound it).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ringserve.core.schema import LeastValues, cleaned, least_values
from ringserve.engine.gbnf import Constraint
from ringserve.formats.families import FAMILIES

__all__ = ["EXPANDED_DEPTH", "example", "example_instance"]

EXPANDED_DEPTH = 3
"""Nesting down to which an example has every property and one item at least; below it, the
least value (required properties, ``minItems`` items, the least alternative), which always ends."""


def example(constraint: Constraint) -> str:
    """A text ``constraint.grammar`` accepts: :func:`example_instance` of its value's schema, in
    its frame; for calls, in a call of the model family's syntax
    (:meth:`~ringserve.formats.base.ChatFormat.write_call`)."""
    head, tail = constraint.frame
    value = example_instance(cleaned(constraint.value, "schema"))
    call = constraint.call
    if call is None:
        return head + json.dumps(value) + tail
    return head + FAMILIES[call.family].write_call(call.tool, value)[call.skip :] + tail


def example_instance(schema: dict[str, Any]) -> Any:
    """A value valid under a cleaned schema (``core/schema.py`` :func:`~ringserve.core.schema.cleaned`)
    whose JSON text (``json.dumps``) the schema's grammar accepts: down to :data:`EXPANDED_DEPTH`,
    the first alternative, every property (required ones first, as the grammar orders them)
    and the fewest array items allowed but 1; below it the least value; the first enum
    value, short strings."""
    return _instance(schema, least_values(schema, sys.maxsize), 0)


def _instance(schema: dict[str, Any], least: LeastValues, depth: int) -> Any:
    expanded = depth < EXPANDED_DEPTH
    if "$ref" in schema:
        return _instance(least.choices[id(schema)], least, depth + 1)
    if "anyOf" in schema:
        return _instance(schema["anyOf"][0] if expanded else least.choices[id(schema)], least, depth)
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
        optional = [k for k in props if k not in required] if expanded else []
        return {k: _instance(props[k], least, depth + 1) for k in required + optional}
    match typ:
        case "array":
            items = schema.get("items", schema.get("prefixItems", {}))
            if isinstance(items, list):
                return [_instance(s, least, depth + 1) for s in items]
            low = schema.get("minItems", 0)
            n = max(low, min(1, schema.get("maxItems", 1))) if expanded else low
            return [_instance(items, least, depth + 1) for _ in range(n)]
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
