"""Parity with llama-server beyond the template itself (issue 43 item 9): every corpus template
renders OpenAI Chat requests as the render routes render them (the Chat surface's parse, then
``render_request``, with the bundled model's BOS and EOS texts) into llama-server's
``/apply-template`` prompt for the same request. The requests of ``tests/data/templates/parity.json``
(recorded from llama-server by ``parity.py`` there): the thinking default, a tool result without the
tool's name, ``reasoning_effort``, and a continued (prefilled) final assistant turn in its thinking
block, with where llama-server's parser puts the continuation. The corpus conversations
(``expected.json``) go through the Chat surface too: the calls' arguments are the client's text.

The differences left are :func:`difference`'s, each checked to be what docs/model-formats.md says.
``tests/http/test_template_parity.py`` asks the render routes themselves.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ringserve.formats.detect import detect
from ringserve.formats.families import FAMILIES
from ringserve.formats.prompt import TOOLS_PROMPT_FAMILIES, Rendered, render_request
from ringserve.surfaces.base import read_request
from ringserve.surfaces.openai import OpenAISurface
from tests.formats.test_template_corpus import CONVERSATIONS, DATA, EXPECTED, NOW, template

PARITY: dict[str, Any] = json.loads((DATA / "parity.json").read_text())

KIMI_K2_NAMED = {"Kimi-K2-Instruct.jinja", "Kimi-K2-Thinking.jinja"}
"""The templates that write a tool result's ``name``: ringserve gives it the name of the call it
answers, as Moonshot's tool-call guide sends it (``docs/tool_call_guidance.md`` of
MoonshotAI/Kimi-K2: every ``tool`` message carries ``"name": tool_call_name``); llama-server gives
only the name a Chat client sent, none from the Anthropic and Responses APIs, and Kimi-K2 then
writes ``tool`` where the tool's name goes."""

NOT_SERVED = {"tencent-Hy3.jinja", "muse-glimmer.jinja"}
"""Templates with a thinking block that ringserve does not know (their family is generic: their
reasoning comes out as text, docs/formats.md): a continued turn's reasoning is not written, as
for any template without a block; llama-server writes it into their block."""

PHI_3_5 = "microsoft-Phi-3.5-mini-instruct.jinja"
"""llama-server continues a turn after the conversation rendered without the generation prompt,
which Phi-3.5's template ends with its EOS text; it then writes the part of the generation prompt
that differs (``assistant|>\\n``, after ``<|im_end|>``). ringserve keeps the rendering with the
generation prompt (``<|assistant|>\\n``)."""

RWKV_WORLD = "llama-cpp-rwkv-world.jinja"
"""llama.cpp's test template that writes its generation prompt (``Assistant: <think>``) whether
asked or not: llama-server opens a second block after it for a continued turn; ringserve finds
no block of its own in it and writes the turn's text after the template's."""

LFM2_WITHOUT_THINK = {"LFM2-8B-A1B.jinja", "LFM2.5-Instruct.jinja"}
"""LFM2 templates that never write ``<think>``: llama-server continues a turn in a ``<think>``
block all the same, but its LFM2 parser reads reasoning only for templates that hold ``<think>``
(``lfm2.cpp``), so the continuation comes back as text there; ringserve reads the block it
opened as reasoning, as for every LFM2 template."""

PREFILLS = ("prefill_reasoning", "prefill_reasoning_content", "prefill_content")


def difference(folder: Path, name: str, request: str) -> str | None:
    """Why ringserve's prompt for ``request`` differs from llama-server's on template ``name``."""
    if request == "tool_unnamed":
        if name in KIMI_K2_NAMED:
            return "kimi-k2 name"
        if _family(folder, name) in TOOLS_PROMPT_FAMILIES:
            return "generic tools prompt"
    if request in PREFILLS:
        if name == PHI_3_5:
            return "phi-3.5"
        if name == RWKV_WORLD:
            return "rwkv-world"
        if name in NOT_SERVED:
            return "not served"
    return None


@cache
def _family(folder: Path, name: str) -> str:
    return detect((folder / name).read_text()).name


def rendered(folder: Path, name: str, body: dict[str, Any]) -> Rendered:
    """``body``, an OpenAI Chat request, rendered as the render route renders it."""
    parsed = read_request(OpenAISurface().parse_request, {"model": "m", **body}, "")
    return render_request(template(folder, name), FAMILIES[_family(folder, name)], parsed.request, now=NOW)


def cases() -> list[tuple[str, str]]:
    return [(name, request) for name in sorted(PARITY["templates"]) for request in PARITY["requests"]]


def test_the_reference_is_of_the_installed_llama_cpp(corpus: Path) -> None:
    assert PARITY["llama_cpp_python"] == EXPECTED["llama_cpp_python"] and PARITY["now"] == EXPECTED["now"]
    assert sorted(PARITY["templates"]) == sorted(EXPECTED["templates"])
    requests = ["default", "tool_unnamed", "effort_low", "effort_high", *PREFILLS]
    assert sorted(PARITY["requests"]) == sorted(requests)


@pytest.mark.parametrize(("name", "request_name"), cases())
def test_a_request_renders_as_llama_server_renders_it(corpus: Path, name: str, request_name: str) -> None:
    expected = PARITY["templates"][name][request_name]
    body = PARITY["requests"][request_name]
    why = difference(corpus, name, request_name)
    if "error" in expected and why is None:
        with pytest.raises(Exception, match="chat template"):
            rendered(corpus, name, body)
        return
    prompt = rendered(corpus, name, body).prompt.text
    match why:
        case None:
            assert prompt == expected["prompt"]
        case "kimi-k2 name":
            tool, named = "<|im_system|>tool<|im_middle|>", "<|im_system|>get_weather<|im_middle|>"
            assert prompt == expected["prompt"].replace(tool, named) != expected["prompt"]
        case "generic tools prompt":
            assert "You can call tools." in prompt
        case "phi-3.5":
            header = "<|end|>\n<|assistant|>"
            assert prompt == expected["prompt"].replace("<|end|>\n<|im_end|>assistant|>", header)
        case "rwkv-world":
            turn = body["messages"][-1]
            assert prompt.endswith("Assistant: <think>" + turn["content"])
            assert expected["prompt"].startswith(prompt.removesuffix(turn["content"]) + "<think>")
        case "not served":
            turn = body["messages"][-1]
            reasoning = turn.get("reasoning_content", "")
            assert prompt.endswith(turn["content"]) and (not reasoning or reasoning not in prompt)
            assert reasoning in expected["prompt"]
        case _:
            raise AssertionError(why)


def continued_in_reasoning(reply: dict[str, str], reasoning: str) -> bool:
    """Whether llama-server's parser read a continued turn of reasoning ``reasoning`` as the start of
    the reply's reasoning (it parses the continued turn with the reply): the continuation went on
    inside the thinking block."""
    return reply.get("reasoning_content", "").startswith(reasoning)


@pytest.mark.parametrize("name", sorted(PARITY["templates"]))
def test_a_turn_of_reasoning_only_is_continued_inside_its_thinking_block(corpus: Path, name: str) -> None:
    """``reasoning_open`` says where the continuation goes, as llama-server's parser does: inside the
    block after a turn of reasoning only, after it once the turn has text."""
    for request in PREFILLS:
        opened = rendered(corpus, name, PARITY["requests"][request]).reasoning_open
        in_reasoning = continued_in_reasoning(PARITY["templates"][name][request]["reply"], "Let me multiply.")
        if request != "prefill_reasoning":
            assert not opened
        elif name in LFM2_WITHOUT_THINK:
            assert opened and not in_reasoning
        elif difference(corpus, name, request) is None:
            assert opened == in_reasoning
        else:  # a turn ringserve does not write in a thinking block
            assert not opened


@pytest.mark.parametrize(("name", "conversation"), [
    (name, conversation) for name in sorted(EXPECTED["templates"]) for conversation in CONVERSATIONS
    if "error" not in EXPECTED["templates"][name]["renders"][conversation]
])
def test_the_corpus_conversations_render_through_the_chat_surface(
    corpus: Path, name: str, conversation: str
) -> None:
    """The arguments of a call go to the template as the client sent them (``{"location": "Paris",
    ...}``, spaces kept), as llama-server passes them."""
    if _family(corpus, name) in TOOLS_PROMPT_FAMILIES and "tools" in CONVERSATIONS[conversation]:
        pytest.skip("ringserve's generic tools prompt (docs/formats.md)")
    expected = EXPECTED["templates"][name]["renders"][conversation]["prompt"]
    assert rendered(corpus, name, CONVERSATIONS[conversation]).prompt.text == expected
