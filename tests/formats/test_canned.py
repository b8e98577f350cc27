"""llama.cpp's canned model outputs (``tests/test-chat.cpp``) parse into the same content,
reasoning and tool calls: whole, one character at a time, and in random chunks.

Each case runs the family :func:`~ringserve.formats.detect.detect` picks for its template,
with the thinking block opened when the template's generation prompt opens it (rendered
with the case's tools and thinking switch). Content and reasoning are compared without
their outer whitespace and the arguments as JSON values, as llama.cpp's test compares them
(``assert_msg_equals`` with ``ignore_whitespace_differences``, ``renormalize_json``); call
ids are not compared (ringserve makes its own).

Cases that do not apply to ringserve are set aside with the reason (:func:`_not_applicable`);
the cases ringserve parses differently are listed in :data:`KNOWN` with the reason. Every
other case must pass.
"""

from __future__ import annotations

import functools

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.core.events import ChatMessage, ToolSpec
from ringserve.core.toolcalls import ToolCallError
from ringserve.formats.base import ChatFormat, Piece
from ringserve.formats.detect import detect
from ringserve.formats.template import ChatTemplate
from tests.formats import canned
from tests.formats.support import Message, json_value, message
from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_chat_tests, llama_cpp_templates

KNOWN: dict[tuple[str, int], str] = {
    ("Apriel-1.6-15b-Thinker-fixed", 6211): "llama.cpp puts the generation prompt's 'Here are my reasoning steps:' "
    "into the reasoning; ringserve's reasoning is the model's text only",
    ("Apriel-1.6-15b-Thinker-fixed", 6219): "the same",
    ("LFM2-8B-A1B", 2116): "a cut pythonic call: its name comes out only with the whole call",
    ("LFM2.5-Instruct", 2116): "the same",
    ("LFM2.5-8B-A1B", 2116): "the same",
    ("openbmb-MiniCPM5-1B", 6903): "a CDATA section in a parameter's value is not read as such",
    ("Kimi-K3", 4907): "Kimi-K3's calls are not served (its reasoning and text are)",
    **{("muse-glimmer", line): "Muse Glimmer's recipient format is not served"
       for line in (6365, 6372, 6380, 6391, 6414)},
    **{("MiniMax-M3", line): "MiniMax-M3's nested XML calls are not served (its reasoning is)"
       for line in (5511, 5526, 5541, 5555, 5576, 5596, 5614, 5632, 5650, 5669, 5690, 5717, 5738, 5755,
                    5775, 5793, 5813, 5834)},
}
"""Cases ringserve parses differently from llama.cpp, by (template, line), and why."""


@attrs.frozen
class Run:
    case: canned.Case
    format: ChatFormat
    opened: bool
    tools: tuple[ToolSpec, ...] | None


@functools.cache
def _runs() -> tuple[tuple[Run, ...], dict[str, int]]:
    """The applicable cases, and how many were set aside for each reason."""
    try:
        folder, chat_tests = llama_cpp_templates(), llama_cpp_chat_tests()
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's sdist is not available: {e}")
    runs = []
    aside: dict[str, int] = {}
    templates: dict[str, ChatTemplate] = {}
    for case in canned.cases(chat_tests):
        if case.template not in templates:
            templates[case.template] = ChatTemplate((folder / f"{case.template}.jinja").read_text(encoding="utf-8"))
        template = templates[case.template]
        fmt = detect(template.source)
        specs = tuple(ToolSpec(t.name, "", t.parameters) for t in case.tools)
        prompt = template.generation_prompt([ChatMessage("user", "Hey there!")], tools=specs,
                                            enable_thinking=case.enable_thinking)
        opened = fmt.reasoning is not None and fmt.reasoning.opened_by(prompt)
        reason = _not_applicable(case, fmt, opened)
        if reason:
            aside[reason] = aside.get(reason, 0) + 1
            continue
        runs.append(Run(case, fmt, opened, specs or None))
    return tuple(runs), aside


@functools.cache
def _readable() -> list[Run]:
    """The applicable cases whose whole output parses without error."""
    return [r for r in _runs()[0] if _parse(r, [r.case.input]) != "ToolCallError"]


def _not_applicable(case: canned.Case, fmt: ChatFormat, opened: bool) -> str:
    if case.error:
        return f"not read from the C++ source ({case.error})"
    if case.continuation:
        return ("continues a prefilled assistant message: the expected message holds the prefilled turn's"
                " text, ringserve's parser reads the continuation only (from inside the block where the"
                " turn left it open: reasoning_open)")
    if case.json_schema:
        return "a response format (ringserve decodes JSON answers under its own grammar)"
    markers = [] if fmt.reasoning is None else [m for m in (fmt.reasoning.start, fmt.reasoning.end) if m]
    if case.reasoning_format == "NONE" and (opened or any(m in case.input for m in markers)):
        return "reasoning_format none: llama.cpp leaves the thinking block in the content; ringserve always parses it"
    return ""


def _expected(case: canned.Case) -> Message:
    e = case.expect
    return e.content.strip(), e.reasoning.strip(), [(c.name, json_value(c.arguments)) for c in e.calls]


def _parse(run: Run, chunks: list[str]) -> Message | str:
    parser = run.format.parser(run.tools, reasoning_open=run.opened)
    pieces: list[Piece] = []
    try:
        for chunk in chunks:
            pieces += parser.feed(chunk)
        if not run.case.partial:
            pieces += parser.flush()
    except ToolCallError:
        return "ToolCallError"  # its message quotes what was buffered, which depends on the chunks
    return message(pieces)


def _id(run: Run) -> str:
    return f"{run.case.template}:{run.case.line}"


def test_the_cases_are_read_and_counted() -> None:
    runs, aside = _runs()
    with_tools = [r for r in runs if r.case.tools]
    assert len(with_tools) >= 250, "the C++ reader lost cases"
    assert sum(aside.values()) + len(runs) >= 460
    assert not [reason for reason in aside if reason.startswith("not read")]


def test_every_canned_output_parses_as_llama_cpp_expects_but_the_known_ones() -> None:
    runs, _ = _runs()
    wrong = {}
    for run in runs:
        got = _parse(run, [run.case.input])
        if got != _expected(run.case):
            wrong[(run.case.template, run.case.line)] = (got, _expected(run.case))
    unexplained = {k: v for k, v in wrong.items() if k not in KNOWN}
    assert not unexplained
    fixed = [k for k in KNOWN if k not in wrong and k in {(r.case.template, r.case.line) for r in runs}]
    assert not fixed, "a known difference is gone: take it out of KNOWN"


def test_one_character_at_a_time_gives_the_same_message() -> None:
    runs, _ = _runs()
    for run in runs:
        whole = _parse(run, [run.case.input])
        assert _parse(run, list(run.case.input)) == whole, _id(run)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_chunks_give_the_same_message(data: st.DataObject) -> None:
    runs, _ = _runs()
    run = data.draw(st.sampled_from(runs), label="case")
    text = run.case.input
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12), label="cuts"))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _parse(run, chunks) == _parse(run, [text]), _id(run)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_reply_cut_anywhere_ends_without_error(data: st.DataObject) -> None:
    """What the parser gives at the end of a cut reply (the token budget) is no error: a
    cut call stays open (``in_call``), and a cut marker after a complete one is dropped."""
    run = data.draw(st.sampled_from(_readable()), label="case")
    cut = data.draw(st.integers(0, len(run.case.input)), label="cut")
    parser = run.format.parser(run.tools, reasoning_open=run.opened)
    parser.feed(run.case.input[:cut])
    parser.flush()


@pytest.mark.parametrize("family", ["hermes", "qwen3-coder", "glm-4.5", "mistral", "mistral-nemo", "deepseek-r1",
                                    "deepseek-v3.2", "gpt-oss", "kimi-k2", "command-r7b", "functionary-v3.1",
                                    "functionary-v3.2"])
def test_the_issue_families_have_canned_calls(family: str) -> None:
    """The families the issue names have llama.cpp's canned calls (Llama 3.x, Granite 3 and
    SmolLM3 have none there: tests/formats/test_families.py has ours)."""
    runs, _ = _runs()
    assert family in {r.format.name for r in runs if r.case.expect.calls}
