"""Helpers of the formats tests: a parsed message, and a family's whole call grammar
(:func:`call_gbnf`, ``engine/gbnf.py``'s)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import CallArgs, CallStart, Text
from ringserve.engine import gbnf as grammar
from ringserve.formats.base import ChatFormat, Piece, Reasoning

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


def call_gbnf(fmt: ChatFormat, tools: Sequence[ToolSpec], parallel: bool, *,
              reasoning_open: bool = False, lazy_after: str | None = None) -> str:
    """The whole GBNF of calls of ``tools`` in ``fmt``'s syntax, as ``engine/gbnf.py`` makes it:
    forced, or with ``lazy_after`` the rest of a unit after its trigger and that text (every
    tool strict)."""
    if lazy_after is None:
        return grammar.calls_grammar(tools, parallel, fmt, reasoning_open).grammar
    strict = tuple(attrs.evolve(t, strict=True) for t in tools)
    after = grammar.LazyCalls(strict, fmt, reasoning_open, parallel).after(lazy_after)
    assert after is not None
    return after.grammar
