"""engine/gbnf.py in each model family's syntax: forced calls, a JSON answer after the thinking
block, lazy calls from the family's trigger, the call watch, and the fake engine's examples."""

from __future__ import annotations

import json

import pytest

from bench.format_parsers import EXAMPLES, TOOLS  # each family's call, as its grammar forces it
from ringserve.core.errors import RingserveError
from ringserve.core.events import ChatMessage, GenerationRequest, OutputFormat, OutputKind, ToolChoice, ToolChoiceMode
from ringserve.engine import gbnf
from ringserve.engine.examples import example
from ringserve.formats.families import FAMILIES
from tests.formats.support import parse
from tests.support.gbnf import accepts

CALL = ("get_weather", {"city": "Paris", "days": 3})
NO_GRAMMAR = {"lfm2", "gemma-4", "minimax-m3", "kimi-k3"}
GRAMMAR_FAMILIES = sorted(set(FAMILIES) - NO_GRAMMAR)
STRICT = tuple(t.__class__(t.name, t.description, t.parameters, strict=True) for t in TOOLS)


def request(**fields: object) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", "hi"),), 10, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"minimax-m3", "kimi-k3"} - {"lfm2", "gemma-4"}))
def test_a_family_writes_the_call_its_grammar_forces(family: str) -> None:
    """write_call is the canonical form (bench/format_parsers.py's EXAMPLES, written by hand)."""
    assert FAMILIES[family].write_call(*CALL) == EXAMPLES[family]


@pytest.mark.parametrize("family", GRAMMAR_FAMILIES)
@pytest.mark.parametrize("opened", [False, True])
def test_the_fake_engines_reply_to_a_forced_call_is_the_familys_call(family: str, opened: bool) -> None:
    fmt = FAMILIES[family]
    if opened and fmt.reasoning is None:
        pytest.skip("no thinking block")
    constraint = gbnf.calls_grammar(TOOLS, False, fmt, opened)
    text = example(constraint)
    assert accepts(constraint.grammar, text)
    content, reasoning, calls = parse(fmt, [text], TOOLS, opened=opened)
    assert (content, reasoning) == ("", "") and [name for name, _ in calls] == ["get_weather"]
    assert calls[0][1] == {"city": "example", "days": 1}


@pytest.mark.parametrize("family", GRAMMAR_FAMILIES)
def test_a_lazy_grammar_takes_the_rest_of_the_call_after_its_trigger(family: str) -> None:
    fmt = FAMILIES[family]
    calls = gbnf.LazyCalls(STRICT, fmt)
    if not calls.trigger:
        pytest.skip("no trigger: the calls stay free")
    unit = fmt.write_call(*CALL)
    assert unit.startswith(calls.trigger)
    for cut in range(len(calls.trigger), len(unit) + 1):
        constraint = calls.after(unit[len(calls.trigger) : cut])
        if constraint is None:
            break
        assert accepts(constraint.grammar, unit[cut:]), unit[cut:]
        assert not accepts(constraint.grammar, unit[cut:].replace("3", "three"))
        written = unit[:cut] + example(constraint)
        assert [name for name, _ in parse(fmt, [written], STRICT)[2]] == ["get_weather"]
    assert calls.after("") is not None


@pytest.mark.parametrize(("family", "opened", "before"), [
    ("generic", False, ""),
    ("hermes", False, ""),
    ("hermes", False, "<think>A thought.</think>\n\n"),
    ("hermes", True, "A thought.</think>\n\n"),
    ("apriel", False, "A thought.[BEGIN FINAL RESPONSE]"),
    ("gpt-oss", False, "<|channel|>analysis<|message|>A thought.<|end|><|start|>assistant<|channel|>final<|message|>"),
])
def test_a_json_answer_may_follow_the_thinking_block(family: str, opened: bool, before: str) -> None:
    fmt = FAMILIES[family]
    constraint = gbnf.output_grammar("", "output", fmt, opened)
    assert accepts(constraint.grammar, before + '{"a": 1}')
    text = example(constraint)
    assert accepts(constraint.grammar, text)
    assert parse(fmt, [text], None, opened=opened) == ("{}", "", [])
    if before:  # the block is required: the answer alone is not taken
        required = opened or not fmt.reasoning.start or fmt.reasoning.close  # type: ignore[union-attr]
        assert accepts(constraint.grammar, '{"a": 1}') != bool(required)


def test_a_forced_call_of_a_family_without_a_grammar_is_a_400_and_its_strict_calls_stay_free() -> None:
    with pytest.raises(RingserveError, match="cannot be forced") as refused:
        gbnf.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)), FAMILIES["lfm2"])
    assert refused.value.param == "tool_choice"
    assert gbnf.constraint_for(request(tools=STRICT), FAMILIES["lfm2"]) is None
    assert gbnf.constraint_for(request(tools=STRICT), FAMILIES["functionary-v3.2"]) is None  # no trigger
    assert gbnf.constraint_for(request(tools=STRICT), FAMILIES["qwen3-coder"]) == gbnf.LazyCalls(
        STRICT, FAMILIES["qwen3-coder"])


def test_grammars_are_kept_per_format_and_thinking() -> None:
    hermes, coder = FAMILIES["hermes"], FAMILIES["qwen3-coder"]
    assert gbnf.calls_grammar(TOOLS, True, hermes) is gbnf.calls_grammar(TOOLS, True, hermes)
    assert gbnf.calls_grammar(TOOLS, True, hermes) != gbnf.calls_grammar(TOOLS, True, coder)
    assert gbnf.calls_grammar(TOOLS, True, hermes) != gbnf.calls_grammar(TOOLS, True, hermes, True)
    json_schema = request(output=OutputFormat(OutputKind.JSON_SCHEMA, json.dumps({"type": "object"})))
    assert gbnf.constraint_for(json_schema, hermes, True) == gbnf.output_grammar('{"type": "object"}', "output.schema",
                                                                                 hermes, True)


def test_the_watch_skips_a_trigger_inside_the_thinking_block_and_follows_the_familys_calls() -> None:
    fmt = FAMILIES["hermes"]
    calls = gbnf.LazyCalls(STRICT, fmt)
    watch = gbnf.CallWatch(calls)
    unit = fmt.write_call(*CALL)
    fed = [
        (b"<think>I could write <tool_call> here", None),  # thinking, not a call
        (b"</think>\n\nChecking. <tool_", None),
        (b"call>\n", gbnf.GrammarOn(calls.after("\n"))),  # type: ignore[arg-type]
        (unit[len("<tool_call>\n"):-len("}\n</tool_call>")].encode(), None),
        (b"}", gbnf.GrammarOff()),  # the call is complete: its closing marker is free
        (b"\n</tool_call> Done. <tool_call>", gbnf.GrammarOn(calls.after(""))),  # type: ignore[arg-type]
    ]
    assert [watch.feed(piece) for piece, _ in fed] == [switch for _, switch in fed]


def test_a_trigger_that_ends_the_thinking_block_is_a_call() -> None:
    """Qwen3-Coder's call marker inside the thinking block ends it (the model went on to call)."""
    calls = gbnf.LazyCalls(STRICT, FAMILIES["qwen3-coder"], reasoning_open=True)
    watch = gbnf.CallWatch(calls)
    assert watch.feed(b"I will check.\n<tool_call>") == gbnf.GrammarOn(calls.after(""))  # type: ignore[arg-type]


def test_a_section_of_parallel_calls_keeps_its_grammar_to_the_end() -> None:
    """Mistral Nemo writes its parallel calls in one [TOOL_CALLS][...] list: the grammar stays
    on after the first call (the unit goes on), as llama-server's lazy grammar."""
    fmt = FAMILIES["mistral-nemo"]
    calls = gbnf.LazyCalls(STRICT, fmt)
    assert not calls.one_call_units and gbnf.LazyCalls(STRICT, fmt, parallel=False).one_call_units
    watch = gbnf.CallWatch(calls)
    unit = fmt.write_call(*CALL)
    assert watch.feed(b"[TOOL_CALLS]") == gbnf.GrammarOn(calls.after(""))  # type: ignore[arg-type]
    assert watch.feed(unit[len("[TOOL_CALLS]"):].encode()) is None


def _freeform_tool() -> object:
    from ringserve.core.events import ToolSpec
    from ringserve.surfaces.responses import freeform_parameters
    from tests.core.test_lark import apply_patch_grammar

    grammar = apply_patch_grammar()
    return ToolSpec("apply_patch", "Edit files.", freeform_parameters(grammar), strict=True, grammar=grammar)


@pytest.mark.parametrize("family", GRAMMAR_FAMILIES)
def test_a_freeform_tools_call_is_decoded_under_its_grammar_in_the_familys_syntax(family: str) -> None:
    """Codex's apply_patch (a ``custom`` tool: its Lark grammar) in every family with a call grammar:
    its input is the one argument, raw text in XML-style families, a JSON string in JSON ones;
    the forced grammar and the lazy one from the trigger take a good patch as the family writes
    the call and refuse a bad one, and the family's parser reads the input back."""
    from tests.core.test_lark import BAD_PATCHES, GOOD_PATCHES

    fmt, tool = FAMILIES[family], _freeform_tool()
    forced = gbnf.calls_grammar((tool,), False, fmt)
    lazy = gbnf.LazyCalls((tool,), fmt)
    for patch in GOOD_PATCHES[:2] + BAD_PATCHES[:2]:
        unit = fmt.write_call("apply_patch", {"input": patch})
        good = patch in GOOD_PATCHES
        assert accepts(forced.grammar, forced.frame[0] + unit) == good, unit  # (after a thinking block's end)
        if lazy.trigger:
            after = lazy.after("")
            assert after is not None and accepts(after.grammar, unit[len(lazy.trigger):]) == good, unit
        if good:
            [(name, arguments)] = parse(fmt, [unit], (tool,))[2]
            assert (name, arguments) == ("apply_patch", {"input": patch})
