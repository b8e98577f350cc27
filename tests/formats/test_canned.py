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
import json
from typing import Any

import attrs
import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.core.events import ToolSpec
from ringserve.core.toolcalls import CallArgs, CallStart, Text, ToolCallError
from ringserve.formats.base import ChatFormat, Piece, Reasoning
from ringserve.formats.detect import detect
from tests.formats import canned
from tests.support import corpus, render

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
    root = corpus.llama_cpp()
    templates = corpus.templates()
    runs = []
    aside: dict[str, int] = {}
    for case in canned.cases(root / "tests" / "test-chat.cpp"):
        fmt = detect(templates[case.template])
        tools = [{"type": "function", "function": {"name": t.name, "description": "",
                                                   "parameters": json.loads(t.parameters)}} for t in case.tools]
        try:
            prompt = render.generation_prompt(templates[case.template], tools, case.enable_thinking)
        except jinja2.TemplateError:
            prompt = ""  # Firefunction v2's template needs llama.cpp's Jinja (and opens no block)
        opened = fmt.reasoning is not None and fmt.reasoning.opened_by(prompt)
        reason = _not_applicable(case, fmt, opened)
        if reason:
            aside[reason] = aside.get(reason, 0) + 1
            continue
        specs = tuple(ToolSpec(t.name, "", t.parameters) for t in case.tools) or None
        runs.append(Run(case, fmt, opened, specs))
    return tuple(runs), aside


def _not_applicable(case: canned.Case, fmt: ChatFormat, opened: bool) -> str:
    if case.error:
        return f"not read from the C++ source ({case.error})"
    if case.continuation:
        return "continues a prefilled assistant message (ringserve has no prefill)"
    if case.json_schema:
        return "a response format (ringserve decodes JSON answers under its own grammar)"
    markers = [] if fmt.reasoning is None else [m for m in (fmt.reasoning.start, fmt.reasoning.end) if m]
    if case.reasoning_format == "NONE" and (opened or any(m in case.input for m in markers)):
        return "reasoning_format none: llama.cpp leaves the thinking block in the content; ringserve always parses it"
    return ""


def _message(pieces: list[Piece]) -> tuple[str, str, list[tuple[str, Any]]]:
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
    return "".join(content).strip(), "".join(reasoning).strip(), [(n, _json(a)) for n, a in calls]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None  # a cut call's arguments, compared as llama.cpp does: not at all


def _expected(case: canned.Case) -> tuple[str, str, list[tuple[str, Any]]]:
    e = case.expect
    return e.content.strip(), e.reasoning.strip(), [(c.name, _json(c.arguments)) for c in e.calls]


def _parse(run: Run, chunks: list[str]) -> tuple[str, str, list[tuple[str, Any]]] | str:
    parser = run.format.parser(run.tools, reasoning_open=run.opened)
    pieces: list[Piece] = []
    try:
        for chunk in chunks:
            pieces += parser.feed(chunk)
        if not run.case.partial:
            pieces += parser.flush()
    except ToolCallError:
        return "ToolCallError"  # its message quotes what was buffered, which depends on the chunks
    return _message(pieces)


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
    runs, _ = _runs()
    run = data.draw(st.sampled_from([r for r in runs if _parse(r, [r.case.input]) != "ToolCallError"]), label="case")
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
