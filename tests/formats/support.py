"""Helpers of the formats tests: a parsed message, and a family's whole call grammar.

:func:`call_gbnf` assembles a forced-call grammar as ``engine/gbnf.py`` is to: the
arguments' rules from the bundled JSON-schema converter (``_Converter``), one rule per
property for the XML-style syntaxes, then the family's :class:`~ringserve.formats.base.CallGrammar`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ringserve.core import schema as core_schema
from ringserve.engine import gbnf as grammar
from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import CallArgs, CallStart, Text
from ringserve.formats.base import ChatFormat, ParamRule, Piece, Reasoning, ToolRules
from ringserve.formats.tools import raw_param

Message = tuple[str, str, list[tuple[str, Any]]]


def message(pieces: Sequence[Piece]) -> Message:
    """Content and reasoning (without outer whitespace) and the calls (name, arguments as JSON
    values; None for arguments that do not parse) of ``pieces``."""
    content, reasoning, calls = [], [], []
    for piece in pieces:
        match piece:
            case Text():
                content.append(piece.text)
            case Reasoning():
                reasoning.append(piece.text)
            case CallStart():
                calls.append([piece.name, ""])
            case CallArgs():
                calls[-1][1] += piece.text
    return "".join(content).strip(), "".join(reasoning).strip(), [(n, json_value(a)) for n, a in calls]


def json_value(text: str) -> Any:
    """The JSON value of ``text``; None when it is not JSON (a cut call's arguments, which
    are compared as llama.cpp compares them: not at all)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(fmt: ChatFormat, chunks: Sequence[str], tools: Sequence[ToolSpec] | None, opened: bool = False) -> Message:
    parser = fmt.parser(tools, reasoning_open=opened)
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    return message(pieces + parser.flush())


def tool_rules(conv: Any, tools: Sequence[ToolSpec]) -> list[ToolRules]:
    """The :class:`ToolRules` of ``tools``, their rules added to ``conv``."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}].parameters"
        schema = core_schema.cleaned(tool.parameters, where)
        args = conv.add(schema, where, f"tool{i}-args")
        params = []
        for name, prop in schema.get("properties", {}).items():
            value = conv.add(prop, where, f"tool{i}-{name}")
            params.append(ParamRule(name, value, raw_param(prop), name in schema.get("required", ())))
        out.append(ToolRules(tool.name, args, tuple(params)))
    return out


def call_gbnf(fmt: ChatFormat, tools: Sequence[ToolSpec], parallel: bool, *, max_units: int = 4,
              reasoning_open: bool = False, lazy_after: str | None = None) -> str:
    """The whole GBNF of calls of ``tools`` in ``fmt``'s syntax: forced, or with ``lazy_after``
    the rest of a unit after its trigger and that text."""
    conv = grammar._Converter()
    rules = tool_rules(conv, tools)
    cg = fmt.call_grammar(rules, parallel)
    for name, body in cg.rules:
        conv.rule(name, body)
    if lazy_after is None:
        root = cg.forced(max_units, reasoning_open)
    else:
        after = cg.after(lazy_after)
        assert after is not None
        root = after
    conv.rule("root", root)
    return str(conv.grammar())
