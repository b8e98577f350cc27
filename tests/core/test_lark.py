"""ringserve.core.lark: Lark grammars to GBNF, the text it writes and what it refuses.

That llama.cpp parses the GBNF and accepts what the Lark grammar derives is in
``tests/engine/test_lark_grammar.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core.lark import LarkGrammarError, check, json_string, lark_to_gbnf

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "agents" / "codex_gpt55.jsonl"


#: Patches Codex's apply_patch tool takes (its format: codex-rs/apply-patch in openai/codex).
GOOD_PATCHES = [
    "*** Begin Patch\n*** Add File: g.txt\n+written by apply_patch\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: a/b c.py\n+def f():\n+    return 1\n+\n*** Delete File: old.txt\n*** End Patch",
    "*** Begin Patch\n*** Update File: src/app.py\n*** Move to: src/main.py\n@@ def main():\n-    print('hi')\n+    print('hello')\n"
    "     return 0\n*** End of File\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: x\n@@\n context\n*** End Patch\n",
]
BAD_PATCHES = [
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: g.txt\nwritten without a plus\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: g.txt\n+line\n",  # no end
    "*** Begin Patch\n*** Add File: \n+line\n*** End Patch\n",  # no file name
    "--- a/g.txt\n+++ b/g.txt\n@@ -0,0 +1 @@\n+hi\n",  # a unified diff is not this format
    "*** Begin Patch\n*** Update File: x\n*** End of File\n*** End Patch\n",  # end of file without a change
]


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


# -- what a request's grammar must pass (issue 43) -------------------------------------------------

#: Each was a 500 (a RecursionError; "llama.cpp could not parse the grammar"), an endless decode,
#: or a hung engine (the left recursion behind an optional rule: llama.cpp's own check misses it,
#: and its sampler grows its stack without end); the rule or construct the refusal names.
REFUSED = {
    "left recursion": ('start: start "a" | "a"', "start: leads back to itself before it matches any text"),
    "indirect left recursion": ('start: a\na: b "x"\nb: a "y" | "z"', "a: leads back to itself"),
    "left recursion behind an optional rule": ('start: a start "x" | "y"\na: "b"?', "start: leads back to itself"),
    "no finite text": ('start: "a" start', "start: no finite text matches it"),
    "no finite text, through another rule": ('start: "a" | x\nx: "(" x ")"', "x: no finite text matches it"),
    "5,000 nested parentheses": ("start: " + "(" * 5000 + '"a"' + ")" * 5000, "nested deeper than 64"),
    "5,000 nested regex groups": ("start: /" + "(" * 5000 + "a" + ")" * 5000 + "/", "nested deeper than 64"),
    "a repetition over llama.cpp's 2,000": ('start: "a" ~ 2001', "repeated more than 2,000 times"),
    "repetitions that multiply over 2,000": ('start: ("a" ~ 0..40) ~ 0..50', "50 times an item of 41 rules"),
    "over 2,000 only inside a JSON string": ('start: (/[ab"]/ /[cd"]/ /[ef"]/) ~ 0..700',
                                              "(written inside a JSON string)"),
    "a long literal 2,000 times": ('start: "' + "a" * 1000 + '" ~ 2000', "expand it to more than 50,000 rules or"),
    "0.9 MB": ('start: "a"\n' + "// a comment\n" * 70_000, "longer than 65,536 characters"),
}


@pytest.mark.parametrize("lark, says", REFUSED.values(), ids=REFUSED)
def test_a_grammar_llama_cpp_refuses_or_cannot_finish_is_refused_naming_why(lark, says):
    with pytest.raises(LarkGrammarError) as raised:
        check(lark)
    assert says in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("lark", [
    'start: ("a"?)*',  # left recursion through the last item only: llama.cpp takes it, and ends
    'start: a start | "y"\na: "b"?',
    'start: "a"+ ("," "b" ~ 1..3)* | "c"',
    'start: /(a|b){0,1000}/',
])
def test_grammars_llama_cpp_takes_pass(lark):
    check(lark)
    check(apply_patch_grammar())


# -- the same language inside a JSON string ------------------------------------------------------


def test_apply_patch_inside_a_json_string_takes_each_patch_as_json_writes_it():
    """The grammar a model writing apply_patch's input as a JSON string argument is decoded under:
    it takes each good patch as ``json.dumps`` writes it (non-ASCII raw, or escaped as \\u only
    where JSON must), and no bad one, nor the raw text of one that holds a newline."""
    from tests.support.gbnf import accepts

    plain = lark_to_gbnf(apply_patch_grammar())
    quoted = json_string(plain)
    odd = '*** Begin Patch\n*** Add File: q"\\.txt\n+a "quoted" \\ back\x01slash\té😀\n*** End Patch\n'
    for patch in [*GOOD_PATCHES, odd]:
        assert accepts(plain, patch)
        assert accepts(quoted, json.dumps(patch, ensure_ascii=False)[1:-1]), patch
        assert not accepts(quoted, patch)
    for patch in BAD_PATCHES:
        assert not accepts(quoted, json.dumps(patch, ensure_ascii=False)[1:-1]), patch
    assert not accepts(quoted, json.dumps(GOOD_PATCHES[0])[1:-1].replace("\\n", "\\u000a"))  # canonical escapes only


@pytest.mark.parametrize("gbnf", [
    r'root ::= [^\n]* "\n"',
    r'root ::= ["\\a-c\x01\t] [^a]',
    r'root ::= ("x" | [\x00-\x1F]){1,3} "\"\\"',
    r'root ::= [^\x00-\U0010FFFF] | "ok"',
])
@given(text=st.text(alphabet=st.sampled_from('ab"\\\n\t\x01\x1f\x7fé😀'), max_size=6))
@settings(max_examples=150, deadline=None)
def test_a_string_is_in_the_json_grammar_as_json_writes_it_when_it_is_in_the_grammar(gbnf, text):
    from tests.support.gbnf import accepts

    assert accepts(json_string(gbnf), json.dumps(text, ensure_ascii=False)[1:-1]) == accepts(gbnf, text)
