"""The request's tools as the parsers need them: their names, and the JSON types of each property.

XML-style parameter syntaxes (Qwen3-Coder, GLM, MiniMax, DeepSeek's DSML...) write each
argument's value as raw text; whether that text is a string or JSON comes from the tool's
schema, as llama.cpp decides it (``common/chat-peg-parser.cpp``, ``common/parsers/qwen3-coder.cpp``:
a property whose types do not include ``string`` is JSON; one that is only ``string`` is the
text; a union with ``string`` is JSON when the text parses as one of the other types, else the
text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ringserve.core.events import ToolSpec
from ringserve.formats.base import unknown_tool

__all__ = ["ANY", "Tools", "raw_param", "raw_value"]

ANY: frozenset[str] = frozenset()
"""The types of a property whose schema says none (or that is not in the schema)."""

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array",
               dict: "object"}


def _types(schema: Any) -> frozenset[str]:
    """The JSON type names a schema allows (:data:`ANY` when it does not say)."""
    if not isinstance(schema, dict):
        return ANY
    typ = schema.get("type")
    if isinstance(typ, str):
        return frozenset({typ})
    if isinstance(typ, list):
        return frozenset(t for t in typ if isinstance(t, str))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return frozenset(_JSON_TYPES.get(type(v), "string") for v in values)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            branches = [_types(b) for b in schema[key]]
            return ANY if ANY in branches else frozenset().union(*branches)
    return ANY


@attrs.frozen
class Tools:
    """Names and property types of the tools a reply may call."""

    types: Mapping[str, Mapping[str, frozenset[str]]]
    """Tool name → property name → JSON types."""

    @classmethod
    def of(cls, specs: Sequence[ToolSpec]) -> Tools:
        """From the request's tools (a schema that is not JSON types nothing)."""
        types: dict[str, dict[str, frozenset[str]]] = {}
        for spec in specs:
            try:
                schema = json.loads(spec.parameters)
            except ValueError:
                schema = {}
            props = schema.get("properties") if isinstance(schema, dict) else None
            types[spec.name] = {k: _types(v) for k, v in props.items()} if isinstance(props, dict) else {}
        return cls(types)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.types)

    def check(self, name: str) -> str:
        """``name`` if it is one of the tools.

        Raises:
            ToolCallError: it is not.
        """
        if name not in self.types:
            raise unknown_tool(name)
        return name

    def param_types(self, tool: str, param: str) -> frozenset[str]:
        return self.types.get(tool, {}).get(param, ANY)


def raw_param(schema: Any) -> bool:
    """Whether a property of this schema is written as raw text in XML-style syntaxes (and so
    matched by the raw-text rule of a call grammar, :class:`~ringserve.formats.base.ParamRule`):
    its types include ``string``, or it has none."""
    types = _types(schema)
    return not types or "string" in types


def raw_value(text: str, types: frozenset[str]) -> str:
    """The JSON text of a raw parameter value of a property of ``types`` (see the module
    docstring; a value that fits none of the property's types is kept as a string, as the
    tool's own validation is better placed to answer it than a failed reply)."""
    if types == frozenset({"string"}):
        return json.dumps(text, ensure_ascii=False)
    try:
        value = json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    kind = _JSON_TYPES.get(type(value), "string")
    allowed = types - {"string"}
    fits = not types or kind in allowed or (kind == "integer" and "number" in allowed)
    if isinstance(value, str) or not fits:
        return json.dumps(text, ensure_ascii=False)
    return text.strip()
