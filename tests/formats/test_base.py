"""The interface's own pieces: the generic format is today's, ``opened_by``, the GBNF helpers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import Text, ToolCallError, ToolCallParser, format_call
from ringserve.formats.base import ReasoningMarkers
from ringserve.formats.gbnf import literal, raw_text
from ringserve.formats.generic import GENERIC
from tests.formats.support import call_gbnf
from tests.support.gbnf import accepts

TOOL = ToolSpec("f", "", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
CALL = format_call("f", '{"a": 1}')


@given(st.lists(st.sampled_from(["Hi ", "<tool", "_call>", "\n", '{"name": "f", ', '"arguments": {"a": 1}}',
                                 "</tool_call>", "\n<", "x"]), max_size=12))
def test_the_generic_parser_is_todays(chunks: list[str]) -> None:
    ours, today = GENERIC.parser([TOOL]), ToolCallParser(frozenset({"f"}))
    for chunk in chunks:
        try:
            expected = today.feed(chunk)
        except ToolCallError:
            with pytest.raises(ToolCallError):
                ours.feed(chunk)
            return
        assert ours.feed(chunk) == expected
        assert ours.in_call == today.in_call
    assert ours.flush() == today.flush()
    assert not ours.in_reasoning


def test_without_tools_the_generic_reply_is_its_text() -> None:
    parser = GENERIC.parser(None)
    assert parser.feed("a <tool_call> b ") == [Text("a <tool_call> b ")]
    assert parser.flush() == []


@pytest.mark.parametrize(("text", "parallel", "accepted"), [
    (CALL, False, True), (CALL, True, True), ("\n".join([CALL] * 4), True, True), ("\n".join([CALL] * 5), True, False),
    ("\n".join([CALL] * 2), False, False), (format_call("f", '{"a": "x"}'), False, False),
    (format_call("g", '{"a": 1}'), False, False),
])
def test_the_generic_grammar_takes_what_the_grammar_before_the_formats_took(text: str, parallel: bool, accepted: bool) -> None:
    """(What core/grammar.py's calls grammar accepted before the formats were wired.)"""
    assert accepts(call_gbnf(GENERIC, [TOOL], parallel), text) is accepted


@pytest.mark.parametrize("tail", ["", "\n", '\n{"name": ', '\n{"na'])
def test_the_generic_lazy_grammar_takes_the_rest_of_a_call(tail: str) -> None:
    rest = CALL[len("<tool_call>") + len(tail):]
    assert accepts(call_gbnf(GENERIC, [TOOL], False, lazy_after=tail), rest)
    assert not accepts(call_gbnf(GENERIC, [TOOL], False, lazy_after=tail), rest.replace('"a": 1', '"a": "x"'))


@pytest.mark.parametrize(("markers", "prompt", "opened"), [
    (ReasoningMarkers("<think>", "</think>"), "<|im_start|>assistant\n<think>\n", True),
    (ReasoningMarkers("<think>", "</think>"), "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    (ReasoningMarkers("<think>", "</think>"), "<|im_start|>assistant\n", False),
    (ReasoningMarkers("<think>", "</think>"), "<think>\nsomething the template wrote", False),
    (ReasoningMarkers("[THINK]", "[/THINK]"), "[INST]hi[/INST]", False),
    (ReasoningMarkers("", "[BEGIN FINAL RESPONSE]"), "<|assistant|>\nHere are my reasoning steps:\n", True),
])
def test_opened_by(markers: ReasoningMarkers, prompt: str, opened: bool) -> None:
    assert markers.opened_by(prompt) is opened


def test_literal_escapes() -> None:
    assert literal('a"b\\c\n\x01') == '"a\\"b\\\\c\\n\\x01"'
    assert accepts(f"root ::= {literal(chr(10) + 'x' + chr(34))}", '\nx"')


@given(st.text(alphabet="ab<>/\n", max_size=30), st.sampled_from(["</a>", "\n</a>", "aab", "<<a"]))
def test_raw_text_is_any_text_without_the_delimiter(text: str, delimiter: str) -> None:
    rules = "\n".join(f"{name} ::= {body}" for name, body in raw_text(delimiter, "r"))
    assert accepts(f"root ::= r-0\n{rules}", text) is (delimiter not in text)
