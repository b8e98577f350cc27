"""Each family's own calls: the canonical form its grammar forces parses back into the call,
the grammar refuses other tools and ill-typed arguments, and a thinking block may come first.

The examples are ours, written in each family's syntax (``bench/format_parsers.py``'s
``EXAMPLES``, which the benchmark parses too; llama.cpp's canned outputs are in
test_canned.py); Llama 3.x, Granite 3.3, SmolLM3 and Command R+ have no canned calls there.
"""

from __future__ import annotations

import pytest

from bench.format_parsers import EXAMPLES, TOOLS, WEATHER  # each family's call, as its grammar forces it
from ringserve.core.toolcalls import ToolCallError
from ringserve.formats.base import ToolRules
from ringserve.formats.families import FAMILIES
from tests.formats.support import call_gbnf, parse
from tests.support.gbnf import accepts

CALL = ("get_weather", {"city": "Paris", "days": 3})

NO_GRAMMAR = {"lfm2", "gemma-4"}
NOT_SERVED = {"minimax-m3", "kimi-k3"}


def test_every_family_has_an_example() -> None:
    assert set(FAMILIES) == set(EXAMPLES) | NOT_SERVED


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_the_example_parses_into_the_call(family: str) -> None:
    assert parse(FAMILIES[family], [EXAMPLES[family]], TOOLS) == ("", "", [CALL])
    assert parse(FAMILIES[family], list(EXAMPLES[family]), TOOLS) == ("", "", [CALL])


@pytest.mark.parametrize("family", sorted(set(EXAMPLES) - NO_GRAMMAR))
def test_the_family_writes_its_call_as_the_example(family: str) -> None:
    """write_call (the fake engine's replies) writes the canonical form, which is written by hand here."""
    assert FAMILIES[family].write_call(*CALL) == EXAMPLES[family]


@pytest.mark.parametrize("family", sorted(NO_GRAMMAR | NOT_SERVED))
def test_a_family_without_a_call_grammar_writes_no_call(family: str) -> None:
    with pytest.raises(NotImplementedError):
        FAMILIES[family].write_call(*CALL)


@pytest.mark.parametrize("family", sorted(set(EXAMPLES) - NO_GRAMMAR))
def test_the_forced_grammar_takes_the_example_and_refuses_other_calls(family: str) -> None:
    fmt = FAMILIES[family]
    gbnf = call_gbnf(fmt, TOOLS, parallel=False)
    example = EXAMPLES[family]
    if fmt.reasoning is not None and not fmt.reasoning.start:  # always inside the block first
        example = f"Thought.{fmt.reasoning.end}\n{example}"
    assert accepts(gbnf, example)
    assert not accepts(gbnf, example.replace("get_weather", "get_wether"))
    assert not accepts(gbnf, example.replace("3", "three"))
    assert not accepts(gbnf, example + example)


@pytest.mark.parametrize("family", sorted(set(EXAMPLES) - NO_GRAMMAR))
def test_the_forced_grammar_lets_the_thinking_block_come_first(family: str) -> None:
    fmt = FAMILIES[family]
    if fmt.reasoning is None:
        pytest.skip("no thinking block")
    start, end = fmt.reasoning.start, fmt.reasoning.end
    then = "<|start|>assistant" if family == "gpt-oss" else "\n\n"
    thought = f"Paris, 3 days.{end}{then}"
    if start:
        assert accepts(call_gbnf(fmt, TOOLS, parallel=False), start + thought + EXAMPLES[family])
    assert accepts(call_gbnf(fmt, TOOLS, parallel=False, reasoning_open=True), thought + EXAMPLES[family])
    assert not accepts(call_gbnf(fmt, TOOLS, parallel=False, reasoning_open=True), EXAMPLES[family])
    assert parse(fmt, [thought + EXAMPLES[family]], TOOLS, opened=True) == ("", "Paris, 3 days.", [CALL])


@pytest.mark.parametrize("family", ["generic", "hermes", "qwen3-coder", "glm-4.5", "mistral", "functionary-v3.1"])
def test_parallel_units_repeat(family: str) -> None:
    fmt = FAMILIES[family]
    cg_sep = {"mistral": "", "functionary-v3.1": ""}.get(family, "\n")
    two = EXAMPLES[family] + cg_sep + EXAMPLES[family]
    assert accepts(call_gbnf(fmt, TOOLS, parallel=True), two)
    assert not accepts(call_gbnf(fmt, TOOLS, parallel=False), two)
    assert parse(fmt, [two], TOOLS) == ("", "", [CALL, CALL])


@pytest.mark.parametrize("family", ["mistral-nemo", "granite-3", "deepseek-v3.2", "kimi-k2", "minimax-m2"])
def test_parallel_calls_inside_a_section(family: str) -> None:
    fmt = FAMILIES[family]
    two = {
        "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        "granite-3": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                     '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        "deepseek-v3.2": EXAMPLES["deepseek-v3.2"].replace(
            "</｜DSML｜invoke>\n", "</｜DSML｜invoke>\n" + EXAMPLES["deepseek-v3.2"].split("\n", 1)[1].rsplit("\n", 1)[0] + "\n"),
        "kimi-k2": EXAMPLES["kimi-k2"].replace(
            "<|tool_call_end|>", '<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
            '{"city": "Paris", "days": 3}<|tool_call_end|>'),
        "minimax-m2": EXAMPLES["minimax-m2"].replace(
            "</invoke>\n", '</invoke>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n'),
    }[family]
    assert accepts(call_gbnf(fmt, TOOLS, parallel=True), two)
    assert not accepts(call_gbnf(fmt, TOOLS, parallel=False), two)
    assert parse(fmt, [two], TOOLS) == ("", "", [CALL, CALL])


@pytest.mark.parametrize("family", ["generic", "hermes", "qwen3-coder", "mistral", "kimi-k2", "deepseek-v3.2"])
def test_a_lazy_grammar_goes_on_from_the_trigger(family: str) -> None:
    fmt = FAMILIES[family]
    example = EXAMPLES[family]
    trigger = fmt.triggers(TOOLS)[0]
    assert example.startswith(trigger)
    rest = example[len(trigger):]
    head_len = len(fmt.call_grammar([ToolRules(WEATHER.name, "tool0-args")], False).head)
    for cut in range(min(head_len, 3) + 1):
        head = rest[:cut]
        assert accepts(call_gbnf(fmt, TOOLS, parallel=False, lazy_after=head), rest[cut:])


def test_a_string_value_streams_with_its_newlines_trimmed() -> None:
    fmt = FAMILIES["qwen3-coder"]
    text = "<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n\n</parameter>\n</function>\n</tool_call>"
    parser = fmt.parser(TOOLS)
    args = []
    for c in text:
        args += [p.text for p in parser.feed(c) if type(p).__name__ == "CallArgs"]
    assert "".join(args) == '{"code": "print(1)\\n"}'
    assert len(args) > 5, "the value streams as it comes"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    "<tool_call>\nnot json\n</tool_call>",
])
def test_a_call_the_parser_cannot_read_raises(text: str) -> None:
    with pytest.raises(ToolCallError):
        parse(FAMILIES["hermes"], [text], TOOLS)


def test_an_unknown_tool_raises_in_each_family() -> None:
    for family, example in EXAMPLES.items():
        with pytest.raises(ToolCallError):
            parse(FAMILIES[family], [example.replace("get_weather", "get_wether")], TOOLS)


def test_markers_are_text_when_tools_are_not_parsed() -> None:
    assert parse(FAMILIES["hermes"], [EXAMPLES["hermes"]], None)[0] == EXAMPLES["hermes"]
    assert parse(FAMILIES["hermes"], ["<think>Hm.</think>Hi"], None) == ("Hi", "Hm.", [])


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_a_reply_cut_inside_a_call_stays_in_it(family: str) -> None:
    parser = FAMILIES[family].parser(TOOLS)
    cut = EXAMPLES[family][: EXAMPLES[family].index("Paris") + 3]
    parser.feed(cut)
    assert parser.in_call
    assert not [p for p in parser.flush() if type(p).__name__ == "CallEnd"]
    assert parser.in_call


def test_text_held_as_a_marker_start_is_released_at_the_end() -> None:
    assert parse(FAMILIES["hermes"], ["Hi <tool_ca"], TOOLS) == ("Hi <tool_ca", "", [])
    assert parse(FAMILIES["kimi-k2"], ["a <|tool_calls_sec"], TOOLS) == ("a <|tool_calls_sec", "", [])


# --- our canned outputs for families llama.cpp has none of -------------------------------


@pytest.mark.parametrize(("family", "text", "expected"), [
    ("llama-3", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     ("", "", [("get_weather", {"city": "Paris"})])),
    ("llama-3", '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
     ("", "", [("get_weather", {"city": "Paris"})])),
    ("llama-3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     ("", "", [("get_weather", {"city": "Paris"})])),
    ("llama-3", "<|python_tag|>python.call(code=\"print('hi')\")", ("", "", [("python", {"code": "print('hi')"})])),
    ("llama-3", "Let me run it.<|python_tag|>print('hi')", ("Let me run it.", "", [("python", {"code": "print('hi')"})])),
    ("llama-3", 'The JSON is {"name": "x"}.', ('The JSON is {"name": "x"}.', "", [])),
    ("granite-3", '<think>Weather.</think><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     ("", "Weather.", [("get_weather", {"city": "Paris"})])),
    ("granite-3", "<think>Easy.</think><response>Hello!</response>", ("Hello!", "Easy.", [])),
    ("hermes", '<think>\nSmolLM3 thinks.\n</think>\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n'
               "</tool_call>", ("", "SmolLM3 thinks.", [("python", {"code": "1"})])),
    ("command-r-plus", 'Action:\n```json\n[\n    {\n        "tool_name": "get_weather",\n        "parameters": '
                       '{"city": "Paris"}\n    }\n]\n```', ("", "", [("get_weather", {"city": "Paris"})])),
    ("gpt-oss", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}<|call|>',
     ("Checking.", "Need weather.", [("get_weather", {"city": "Paris"})])),
])
def test_our_canned_outputs(family: str, text: str, expected: tuple[str, str, list[object]]) -> None:
    assert parse(FAMILIES[family], [text], TOOLS) == expected
    assert parse(FAMILIES[family], list(text), TOOLS) == expected
