"""ringserve.core.lark: Lark grammars to GBNF, the text it writes and what it refuses.

That llama.cpp parses the GBNF and accepts what the Lark grammar derives is in
``tests/engine/test_lark_grammar.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringserve.core.lark import LarkGrammarError, lark_to_gbnf

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "agents" / "codex_gpt55.jsonl"


def apply_patch_grammar() -> str:
    """The Lark grammar of Codex CLI's freeform ``apply_patch`` tool, as Codex sent it."""
    first = json.loads(CAPTURE.read_text().splitlines()[0])
    (tool,) = [t for t in first["body"]["tools"] if t.get("name") == "apply_patch"]
    assert tool["type"] == "custom" and tool["format"]["syntax"] == "lark"
    return str(tool["format"]["definition"])


def test_apply_patch_grammar_translates_rule_by_rule():
    assert lark_to_gbnf(apply_patch_grammar()) == "\n".join([
        "root ::= start",
        "start ::= begin-patch hunk+ end-patch",
        'begin-patch ::= "*** Begin Patch" LF',
        'end-patch ::= "*** End Patch" LF?',
        "hunk ::= add-hunk | delete-hunk | update-hunk",
        'add-hunk ::= "*** Add File: " filename LF add-line+',
        'delete-hunk ::= "*** Delete File: " filename LF',
        'update-hunk ::= "*** Update File: " filename LF change-move? change?',
        r"filename ::= [^\n]+",
        r'add-line ::= "+" [^\n]* LF',
        'change-move ::= "*** Move to: " filename LF',
        "change ::= (change-context | change-line)+ eof-line?",
        r'change-context ::= ("@@" | "@@ " [^\n]+) LF',
        r'change-line ::= ("+" | "-" | " ") [^\n]* LF',
        'eof-line ::= "*** End of File" LF',
        r'LF ::= "\n"',
    ]) + "\n"


@pytest.mark.parametrize(
    ("lark", "gbnf"),
    [
        # optional, repetition counts, ranges, case-insensitive literals, escapes
        ('start: ["a"] "b"~3 "c"~1..2', 'root ::= start\nstart ::= ("a")? "b"{3} "c"{1,2}\n'),
        ('start: "a".."f"+', "root ::= start\nstart ::= [a-f]+\n"),
        ('start: "Ok"i', 'root ::= start\nstart ::= ([oO] [kK])\n'),
        (r'start: "say \"hi\"\t\\"', 'root ::= start\nstart ::= "say \\"hi\\"\\t\\\\"\n'),
        # alternatives on continuation lines, aliases, modifiers, priorities, comments
        ("?start: a\n  | b -> bee // a comment\na: \"x\"\nb.2: \"y\"\n",
         'root ::= start\nstart ::= a | b\na ::= "x"\nb ::= "y"\n'),
        # terminals, private rules, %import common
        ("start: _item+\n_item: WORD WS_INLINE?\n%import common (WORD, WS_INLINE)",
         "root ::= start\nstart ::= -item+\n-item ::= WORD WS-INLINE?\nWORD ::= [a-zA-Z]+\nWS-INLINE ::= [ \\t]+\n"),
        # a rule called root keeps its name out of the way
        ('start: root\nroot: "r"', 'root ::= start\nstart ::= lark-root\nlark-root ::= "r"\n'),
        # regular expressions
        (r"start: /[a-z_][a-z0-9_-]*/", "root ::= start\nstart ::= ([a-z_] [a-z0-9_\\x2D]*)\n"),
        (r"start: /(?:ab|c)+?x{2,}\d\W/", 'root ::= start\nstart ::= (("a" "b" | "c")+ "x"{2,} [0-9] [^a-zA-Z0-9_])\n'),
        (r"start: /.\./s", 'root ::= start\nstart ::= ([\\x00-\\U0010FFFF] ".")\n'),
        (r"start: /[^\]\\^-]\//", 'root ::= start\nstart ::= ([^\\]\\\\\\x5E\\x2D] "/")\n'),
        # a quantified item quantified again keeps its own quantifier inside parentheses
        (r"start: /(a+)*/ /b?/?", 'root ::= start\nstart ::= ("a"+)* ("b"?)?\n'),
    ],
)
def test_constructs_translate(lark, gbnf):
    assert lark_to_gbnf(lark) == gbnf


@pytest.mark.parametrize(
    ("lark", "error"),
    [
        ('start: "a"\n%ignore " "', "line 2: %ignore is not supported"),
        ("start: x", "used but not defined: x"),
        ('begin: "a"', "the start rule 'start' is not defined"),
        ('start: "a"\nstart: "b"', "line 2: start is defined twice"),
        ("start: /^a/", "line 1: the anchor '^' is not supported"),
        ("start: /(?=a)b/", "line 1: a group of the form (?...) other than (?:...) is not supported"),
        (r"start: /(a)\1/", "line 1: the escape \\1 is not supported"),
        ("start: /a/i", "line 1: the regex flag 'i' is not supported"),
        ("start: /a**/", "a quantifier on a quantifier is not supported"),
        ("start: /[a/", "an unclosed class is not supported"),
        ("start: foo{x}\nfoo{p}: p", "line 1: templates (foo{...}) are not supported"),
        ("start: NUMBER\n%import common.NUMBER", "line 2: common.NUMBER is not one of the supported imports"),
        ("start: X\n%import other.X", "line 2: only '%import common.NAME'"),
        ('start "a"', "line 1: expected ':' after start"),
        ('start: ("a"', "line 1: the definition ends too soon"),
        ('start: "a".."bc"', "a range needs one character on each side"),
        ("start: @", "line 1: unexpected character '@'"),
    ],
)
def test_unsupported_constructs_are_refused_by_name(lark, error):
    with pytest.raises(LarkGrammarError) as raised:
        lark_to_gbnf(lark)
    assert error in str(raised.value)


def test_another_start_rule_can_be_named():
    assert lark_to_gbnf('patch: "p"', start="patch") == 'root ::= patch\npatch ::= "p"\n'
