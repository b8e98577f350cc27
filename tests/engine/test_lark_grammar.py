"""The GBNF of ringserve.core.lark under llama.cpp's grammar sampler: it parses, and it accepts
exactly what the Lark grammar derives.

Texts are fed token by token (the bundled model's vocabulary, loaded vocab-only): a text is accepted
when the sampler allows each of its tokens in turn and then end-of-generation.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Iterator

import pytest

from ringserve.core import llama_grammar
from ringserve.core.lark import json_string, lark_to_gbnf
from ringserve.engine.modelfile import default_model_path

from tests.core.test_lark import BAD_PATCHES, GOOD_PATCHES, apply_patch_grammar

native = pytest.importorskip("ringserve.engine._native")
lc = native.llama_cpp

pytestmark = pytest.mark.model

@pytest.fixture(scope="module")
def vocab_model() -> Iterator[object]:
    model = lc.Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)
    yield model
    model.close()


def allowed(sampler: object, token: int) -> bool:
    """Whether the grammar sampler lets ``token`` come next (llama_sampler_apply on one candidate)."""
    data = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
    candidates = lc.llama_token_data_array(data, 1, -1, False)
    lc.llama_sampler_apply(sampler, ctypes.byref(candidates))
    return bool(data[0].logit != -math.inf)


def accepts(model, gbnf: str, text: str) -> bool:
    """llama.cpp parses ``gbnf`` (else the test fails) and allows ``text`` token by token, then the end."""
    vocab = model._model.vocab
    sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    assert sampler, gbnf
    try:
        for token in model.tokenize(text.encode(), add_bos=False, special=False):
            if not allowed(sampler, token):
                return False
            lc.llama_sampler_accept(sampler, token)
        return allowed(sampler, lc.llama_vocab_eos(vocab))
    finally:
        lc.llama_sampler_free(sampler)


@pytest.mark.parametrize("patch", GOOD_PATCHES)
def test_apply_patch_grammar_accepts_real_patches(vocab_model, patch):
    assert accepts(vocab_model, lark_to_gbnf(apply_patch_grammar()), patch)


@pytest.mark.parametrize("patch", BAD_PATCHES)
def test_apply_patch_grammar_refuses_malformed_patches(vocab_model, patch):
    assert not accepts(vocab_model, lark_to_gbnf(apply_patch_grammar()), patch)


@pytest.mark.parametrize("patch", GOOD_PATCHES[:2] + BAD_PATCHES[:2])
def test_apply_patch_as_a_json_string_under_llama_cpp(vocab_model, patch):
    """The JSON-string form (``json_string``: a freeform input written as a JSON string argument)
    parses in llama.cpp and takes a patch as json.dumps writes it, token by token, iff it is good."""
    gbnf = json_string(lark_to_gbnf(apply_patch_grammar()))
    assert accepts(vocab_model, gbnf, json.dumps(patch)[1:-1]) == (patch in GOOD_PATCHES)


@pytest.mark.parametrize("family", ["generic", "hermes", "qwen3-coder"])
def test_a_freeform_call_under_llama_cpp_in_a_familys_syntax(vocab_model, family):
    """The call grammar of Codex's apply_patch (``engine/gbnf.py``: its input under its Lark grammar, a
    JSON string in JSON families, raw text in XML-style ones) parses in llama.cpp and takes the
    family's call of a good patch token by token, and not of a bad one."""
    from ringserve.engine import gbnf
    from ringserve.formats.families import FAMILIES
    from tests.engine.test_format_grammars import _freeform_tool

    fmt = FAMILIES[family]
    grammar = gbnf.calls_grammar((_freeform_tool(),), False, fmt).grammar
    for patch in (GOOD_PATCHES[0], BAD_PATCHES[1]):
        assert accepts(vocab_model, grammar, fmt.write_call("apply_patch", {"input": patch})) == (patch in GOOD_PATCHES)


REGEX_CASES = [
    (r"[a-z_][a-z0-9_-]*", ["x", "a-b_9", "_", "9a", "a b", "", "A"]),
    (r"(?:ab|c)+x{2,3}\d", ["abx x1", "abcxx1", "cxxx0", "cxxxx0", "abxx", "xx1"]),
    (r"[^\]\\^-]+\/?", ["abc", "abc/", "a]b", "a\\b", "a^", "a-b", "/"]),
    (r"\w+\s\W", ["ab .", "ab  .", "ab a", "_9\t!"]),
    (r"(a|bc)?d*", ["", "a", "bcddd", "ad", "abd", "dd"]),
]


@pytest.mark.parametrize(("pattern", "texts"), REGEX_CASES)
def test_regex_terminals_accept_what_python_re_matches(vocab_model, pattern, texts):
    gbnf = lark_to_gbnf(f"start: /{pattern}/")
    for text in texts:
        assert accepts(vocab_model, gbnf, text) == bool(re.fullmatch(pattern, text)), (pattern, text, gbnf)


def test_case_insensitive_literals_and_ranges(vocab_model):
    gbnf = lark_to_gbnf('start: "Begin"i " " "0".."9"~2')
    assert [accepts(vocab_model, gbnf, t) for t in ["begin 42", "BEGIN 07", "Begin 4", "Bgin 42"]] == [True, True, False, False]


#: GBNF grammars llama.cpp's parser takes or refuses (``llama_sampler_init_grammar`` gives NULL):
#: ``core/llama_grammar.py`` must decide each as it does.
LLAMA_CPP_DECIDES = [
    'root ::= start\nstart ::= start "a" | "a"\n',  # left recursion
    'root ::= a\na ::= b "x"\nb ::= a "y" | "z"\n',  # indirect
    'root ::= x\nx ::= y? x "b" | "c"\ny ::= "d"\n',  # behind an optional item (its rule has an empty alternative)
    'root ::= x\nx ::= x\n',
    'root ::= x\nx ::= "" | x "a"\n',
    'root ::= "a" | missing\n',
    'root ::= "a" # a comment\n  | "b"\n',  # an alternative on a line of its own, outside a group: a syntax error
    'root ::= "a"{2001}\n',
    'root ::= "a"{2000}\n',
    'root ::= ("a"{0,40}){0,50}\n',  # 41 rules, 50 times
    'root ::= ("a"{0,39}){0,51}\n',
    'root ::= ("a"{0,40}){0,49}\n',
    'root ::= (("a" | "b"){0,1000}){0,2}\n',
    'root ::= ("a" | "b"){0,2000}\n',
    'root ::= "a" root | "b"\n',
    'root ::= (("a")?)*\n',
    'root ::= x*\nx ::= "a"?\n',
    'root ::= [a-z]+ ("," [a-z]+)*\n',
    'root ::= "a"{3,5} "b"{0,} "c"{2,} [^\\n]* "\\x41\\u0042"\n',
    'root ::= s\ns ::= a s | "y"\na ::= "b"?\n',  # left recursion through a last item only: taken
]


@pytest.mark.parametrize("gbnf", LLAMA_CPP_DECIDES)
def test_the_grammar_check_decides_as_llama_cpps_parser(vocab_model, gbnf):
    sampler = lc.llama_sampler_init_grammar(vocab_model._model.vocab, gbnf.encode(), b"root")
    takes = bool(sampler)
    if sampler:
        lc.llama_sampler_free(sampler)
    try:
        llama_grammar.check(gbnf)
    except llama_grammar.GrammarError:
        assert not takes
    else:
        assert takes


def test_a_grammar_llama_cpp_takes_and_cannot_finish_is_refused(vocab_model):
    """llama.cpp takes a rule no finite text matches (the model could never end the tool's input);
    the check refuses it. (It also refuses ``s ::= a s "x" | "y"`` with ``a ::= "b"?``: llama.cpp's
    own check misses that left recursion, and its sampler then never returns, so no test runs it.)"""
    gbnf = 'root ::= s\ns ::= "a" s\n'
    sampler = lc.llama_sampler_init_grammar(vocab_model._model.vocab, gbnf.encode(), b"root")
    assert sampler
    lc.llama_sampler_free(sampler)
    with pytest.raises(llama_grammar.GrammarError, match="no finite text"):
        llama_grammar.check(gbnf)


def test_left_recursion_through_a_last_item_is_decoded(vocab_model):
    """A rule that leads back to itself only as the last item of an alternative (``a`` may be
    empty) does not grow llama.cpp's stacks: taken by the check, and the sampler takes its texts."""
    gbnf = 'root ::= s\ns ::= a s | "y"\na ::= "b"?\n'
    llama_grammar.check(gbnf)
    assert accepts(vocab_model, gbnf, "bby") and not accepts(vocab_model, gbnf, "bbx")
