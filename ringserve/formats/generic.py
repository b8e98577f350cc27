"""ringserve's own tool-call format, for templates that do not spell one (today's behaviour).

The prompt that teaches it and its parser live in :mod:`ringserve.core.toolcalls`
(``<tool_call>`` + ``{"name": ..., "arguments": ...}`` + ``</tool_call>``); this is that
format behind the :class:`~ringserve.formats.base.ChatFormat` interface, unchanged: the same
parser (whitespace and all), and the grammar ``engine/gbnf.py`` builds today
(``CALL_OPEN`` + ``{"name": NAME, "arguments": ARGS}`` + ``CALL_CLOSE``). It has no thinking
block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import CALL_CLOSE, CALL_OPEN, OPEN_MARK, PlainText, ToolCallParser, format_call
from ringserve.formats.base import CallGrammar, ReasoningMarkers, ToolRules
from ringserve.formats.gbnf import alternatives, literal

__all__ = ["GENERIC", "GenericFormat"]


@attrs.frozen
class GenericFormat:
    """See the module docstring."""

    name: str = "generic"
    reasoning: ReasoningMarkers | None = None

    def parser(self, tools: Sequence[ToolSpec] | None, *, reasoning_open: bool = False) -> ToolCallParser | PlainText:
        if tools is None:
            return PlainText()
        return ToolCallParser(frozenset(t.name for t in tools))

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return (OPEN_MARK,)

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return format_call(name, json.dumps(arguments, ensure_ascii=False))

    def call_grammar(self, tools: Sequence[ToolRules], parallel: bool) -> CallGrammar:
        head = CALL_OPEN[len(OPEN_MARK) :] + "{" + json.dumps("name") + ": "
        alts = [f"{literal(json.dumps(t.name) + ', ' + json.dumps('arguments') + ': ')} {t.arguments}" for t in tools]
        one = f"( {alternatives(alts)} ) {literal('}' + CALL_CLOSE)}"
        return CallGrammar((), OPEN_MARK, head, one, repeat=parallel)


GENERIC = GenericFormat()
