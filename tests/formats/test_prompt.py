"""ringserve.formats.prompt: where the tools go, the reasoning switches, prefill, and whether the
prompt opened the thinking block (small templates of our own, and the corpus for the last)."""

from __future__ import annotations

import datetime as dt
import functools
import json

import pytest

from ringserve.core.events import (
    ChatMessage,
    Effort,
    GenerationRequest,
    ReasoningConfig,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.toolcalls import TOOLS_PROMPT
from ringserve.formats.base import ChatFormat
from ringserve.formats.detect import detect
from ringserve.formats.families import FAMILIES
from ringserve.formats.prompt import render_request
from ringserve.formats.template import ChatTemplate, TemplateRenderError
from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_templates

NOW = dt.datetime(2025, 3, 14, 12, 0, 0)
TOOL = ToolSpec("get_time", "Local time.", '{"type": "object", "properties": {}}')

#: A template with tools and a thinking switch: what it got, one line per variable.
PROBE = ChatTemplate(
    "tools={{ tools | map(attribute='function.name') | list if tools is defined else none }}\n"
    "thinking={{ enable_thinking }} effort={{ reasoning_effort | default('') }} extra={{ extra | default('') }}\n"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def request(*messages: ChatMessage, **fields: object) -> GenerationRequest:
    return GenerationRequest(messages or (ChatMessage("user", "Hi"),), None, **fields)  # type: ignore[arg-type]


def render(family: str, req: GenerationRequest, template: ChatTemplate = PROBE) -> tuple[str, bool]:
    rendered = render_request(template, FAMILIES[family], req, now=NOW)
    return rendered.prompt.text, rendered.reasoning_open


def test_a_family_with_its_own_call_syntax_gets_the_tools_from_the_template() -> None:
    text, _ = render("hermes", request(tools=(TOOL,)))
    assert "tools=['get_time']" in text and "You can call tools" not in text
    # With tool choice none too, as llama-server renders them.
    text, _ = render("hermes", request(tools=(TOOL,), tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    assert "tools=['get_time']" in text


def test_the_generic_families_get_ringserves_tools_prompt_and_turns() -> None:
    history = (
        ChatMessage("user", "Time?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_time", "{}"),)),
        ChatMessage("tool", "12:00", tool_call_id="c1"),
    )
    for family in ("generic", "generic-think"):
        text, _ = render(family, request(*history, tools=(TOOL,)))
        assert "tools=None" in text
        assert "<system>" + TOOLS_PROMPT.split("\n")[0] in text
        assert '<user><tool_response>\n{"call_id": "c1", "name": "get_time", "content": "12:00"}' in text


def test_thinking_is_on_by_default_only_for_a_format_with_a_thinking_block() -> None:
    assert render("hermes", request()) == (
        "tools=None\nthinking=True effort= extra=\n<user>Hi\n<assistant><think>\n", True
    )
    assert render("generic", request())[0].endswith("thinking=False effort= extra=\n<user>Hi\n<assistant>")
    assert render("generic", request())[1] is False
    # but Apertus', whose template llama-server finds no thinking in
    assert render("apertus", request())[0].startswith("tools=None\nthinking=False ")


def test_the_requests_reasoning_controls_are_the_templates_switches() -> None:
    # the effort reaches the template whether thinking is on or not, as llama-server passes it
    off, opened = render("hermes", request(reasoning=ReasoningConfig(enabled=False, effort=Effort.HIGH)))
    assert "thinking=False effort=high " in off and not opened
    assert "thinking=False effort=low " in render("generic", request(reasoning=ReasoningConfig(effort=Effort.LOW)))[0]
    on, opened = render("generic", request(reasoning=ReasoningConfig(enabled=True, effort=Effort.LOW)))
    assert "thinking=True effort=low " in on  # the generic format has no markers: nothing opened
    assert not opened
    # chat_template_kwargs go over both: enable_thinking among them, any other variable too.
    kwargs = json.dumps({"enable_thinking": False, "extra": "x<y"})
    text, opened = render("hermes", request(template_kwargs=kwargs))
    assert "thinking=False effort= extra=x<y\n" in text and not opened


def test_a_final_assistant_turn_is_continued_in_the_templates_thinking_block() -> None:
    """As llama-server continues it: after the conversation, the generation prompt up to where it
    opens the block, the block with the turn's reasoning, left open for a turn of reasoning only."""
    question = ChatMessage("user", "Count.")
    cases = {
        ChatMessage("assistant", "1, 2,"): ("<assistant><think></think>1, 2,", False),
        ChatMessage("assistant", "1, 2,", reasoning="Easy."): ("<assistant><think>Easy.</think>1, 2,", False),
        ChatMessage("assistant", "", reasoning="Count up."): ("<assistant><think>Count up.", True),
    }
    for turn, (end, opened) in cases.items():
        rendered = render_request(PROBE, FAMILIES["hermes"], request(question, turn), now=NOW)
        text = rendered.prompt.text
        assert text.endswith("<user>Count.\n" + end) and "thinking=True" in text
        assert rendered.reasoning_open is opened
        # the turn's reasoning and text are the request's: literal
        literal = [text[start:stop] for start, stop in rendered.prompt.literal_spans]
        assert literal == [t for t in (turn.reasoning, turn.content) if t]
    # a family without a thinking block gets the generation prompt and the text
    rendered = render_request(PROBE, FAMILIES["generic"], request(question, ChatMessage("assistant", "1, 2,")), now=NOW)
    assert rendered.prompt.text.endswith("<user>Count.\n<assistant>1, 2,") and not rendered.reasoning_open
    with_calls = request(ChatMessage("user", "Time?"),
                         ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_time", "{}"),)))
    with pytest.raises(TemplateRenderError, match="cannot be continued"):
        render_request(PROBE, FAMILIES["hermes"], with_calls, now=NOW)


def test_special_token_text_of_a_continued_turn_stays_text() -> None:
    template = ChatTemplate(PROBE.source, special_tokens=PROBE.special_tokens)
    req = request(ChatMessage("user", "Hi"), ChatMessage("assistant", "<think>"))
    rendered = render_request(template, FAMILIES["hermes"], req, now=NOW)
    start, end = rendered.prompt.literal_spans[-1]
    assert rendered.prompt.text[start:end] == "<think>"


#: Where the rendered prompt says more than the generation prompt: RWKV World's template adds
#: its generation prompt whether asked or not (``add_generation_prompt`` undefined is true), so
#: the difference of the two renderings is empty, while the prompt does end in ``<think>``.
OPENED_WITHOUT_GENERATION_PROMPT = {"llama-cpp-rwkv-world.jinja"}


@functools.cache
def _reasoning_templates() -> tuple[tuple[str, ChatFormat, ChatTemplate], ...]:
    """(file name, format, template) of every corpus template of a family with markers, loaded once
    for both cases below."""
    try:
        folder = llama_cpp_templates()
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's template corpus is not available: {e}")
    found = []
    for path in sorted(folder.glob("*.jinja")):
        source = path.read_text()
        fmt = detect(source)
        if fmt.reasoning is not None:
            found.append((path.name, fmt, ChatTemplate(source)))
    return tuple(found)


@pytest.mark.parametrize("thinking", [True, False])
def test_the_whole_prompt_opens_the_thinking_block_as_its_generation_prompt_does(thinking: bool) -> None:
    """render_request reads the rendered prompt's end instead of rendering twice more for the
    generation prompt: the same answer for every corpus template of a family with markers
    (but :data:`OPENED_WITHOUT_GENERATION_PROMPT`)."""
    history = (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello.", reasoning="Greet back."),
               ChatMessage("user", "Time?"))
    req = GenerationRequest(history, None, reasoning=ReasoningConfig(enabled=thinking))
    checked = 0
    for name, fmt, template in _reasoning_templates():
        assert fmt.reasoning is not None
        try:
            rendered = render_request(template, fmt, req, now=NOW)
        except TemplateRenderError:
            continue
        generation = template.generation_prompt(history, enable_thinking=thinking, now=NOW)
        expected = fmt.reasoning.opened_by(generation) or (thinking and name in OPENED_WITHOUT_GENERATION_PROMPT)
        assert rendered.reasoning_open == expected, name
        checked += 1
    assert checked > 30


def test_the_request_holds_only_a_json_object_of_kwargs_and_a_budget_of_zero_or_more() -> None:
    for bad in ("[1]", "{", "null"):
        with pytest.raises(ValueError, match="template_kwargs"):
            request(template_kwargs=bad)
    with pytest.raises(ValueError, match="budget_tokens"):
        ReasoningConfig(budget_tokens=-1)
