"""The runner reads each reply with the model format's parser (the fake engine given a family):
thinking blocks become REASONING blocks, reasoning tokens are counted, a reply cut inside its
thinking ends cleanly, a reasoning budget forces the block's end, and every family's replies
come out as their blocks."""

from __future__ import annotations

import json
import random

import attrs
import pytest

from bench.format_parsers import EXAMPLES, TOOLS
from bench.format_parsers import reply as bench_reply
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    BlockKind,
    ChatMessage,
    ContentBlock,
    Finish,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    ReasoningConfig,
    SamplingParams,
    StopReason,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.engine.fake import FakeEngine
from ringserve.formats.families import FAMILIES
from tests.engine.test_runner import serving

THINK = "<think>I should greet them back politely.</think>\n\nHello there!"


def req(text: str = "hi", max_tokens: int | None = 256, **fields: object) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", text),), max_tokens, SamplingParams(temperature=0), **fields)  # type: ignore[arg-type]


async def collect(engine: FakeEngine, request: GenerationRequest) -> tuple[tuple[ContentBlock, ...], Finish]:
    async with serving(engine) as runner:
        prepared = await runner.prepare(request)
        async with runner.submit(prepared) as gen:
            blocks, terminal = await gen.collect()
    assert isinstance(terminal, Finish)
    return blocks, terminal


async def test_a_thinking_block_is_a_reasoning_block_and_its_tokens_are_counted():
    engine = FakeEngine(chat_format="hermes", reply=THINK, piece_bytes=4)
    blocks, finish = await collect(engine, req())
    assert blocks == (
        ContentBlock(BlockKind.REASONING, "I should greet them back politely."),
        ContentBlock(BlockKind.TEXT, "Hello there!"),
    )
    assert finish.stop_reason is StopReason.END
    # Sampled inside the block: the tokens after the one that completes "<think>", up to the one
    # that completes "</think>".
    end = THINK.index("</think>") + len("</think>")
    assert finish.usage.reasoning_tokens == sum(len("<think>") <= start < end for start in range(0, len(THINK), 4))
    assert finish.usage.output_tokens == -(-len(THINK) // 4) + 1


async def test_the_generation_prompt_may_open_the_block():
    engine = FakeEngine(chat_format="hermes", generation_prompt="<think>\n", reply="Plan.</think>Done.", piece_bytes=2)
    blocks, finish = await collect(engine, req())
    assert blocks == (ContentBlock(BlockKind.REASONING, "Plan."), ContentBlock(BlockKind.TEXT, "Done."))
    assert finish.usage.reasoning_tokens == len("Plan.</think>") // 2 + 1


async def test_stop_strings_do_not_apply_to_reasoning():
    engine = FakeEngine(chat_format="hermes", reply=THINK)
    blocks, finish = await collect(engine, req(stop=("greet", "there")))
    assert blocks == (ContentBlock(BlockKind.REASONING, "I should greet them back politely."),
                      ContentBlock(BlockKind.TEXT, "Hello "))
    assert finish.stop_reason is StopReason.STOP_SEQUENCE and finish.stop_sequence == "there"


async def test_a_reply_cut_inside_its_thinking_ends_cleanly():
    engine = FakeEngine(chat_format="hermes", reply=THINK, piece_bytes=4)
    blocks, finish = await collect(engine, req(max_tokens=5))  # "<thi" "nk>I" " sho" "uld " "gree"
    assert blocks == (ContentBlock(BlockKind.REASONING, "I should gree"),)
    assert finish.stop_reason is StopReason.MAX_TOKENS
    assert finish.usage.reasoning_tokens == 3


async def test_a_spent_reasoning_budget_forces_the_end_of_the_block():
    engine = FakeEngine(chat_format="hermes", reply=THINK, piece_bytes=4)
    blocks, finish = await collect(engine, req(reasoning=ReasoningConfig(budget_tokens=3)))
    # Three tokens inside the block (" sho", "uld ", "gree"), then the forced "</think>"; the
    # model answers after it.
    assert blocks == (ContentBlock(BlockKind.REASONING, "I should gree"), ContentBlock(BlockKind.TEXT, "Hello there!"))
    assert finish.usage.reasoning_tokens == 4 and finish.stop_reason is StopReason.END
    forced = [f for call in engine.log for f in call.feeds if f.forced is not None]
    assert [f.forced for f in forced] == list(engine.reasoning_close)


async def test_a_budget_of_zero_closes_a_block_the_prompt_opened_at_once():
    engine = FakeEngine(chat_format="hermes", generation_prompt="<think>\n", reply="Plan.</think>Done.")
    blocks, finish = await collect(engine, req(reasoning=ReasoningConfig(budget_tokens=0)))
    assert blocks == (ContentBlock(BlockKind.TEXT, "Done."),)
    assert finish.usage.reasoning_tokens == 1  # the forced closing marker
    first_sample = next(f for call in engine.log for f in call.feeds if f.sample)
    assert first_sample.forced == engine.reasoning_close[0]


async def test_gpt_oss_budget_forces_the_final_channel():
    reply = ("<|channel|>analysis<|message|>The user greets. Greet back.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Hi!")
    engine = FakeEngine(chat_format="gpt-oss", reply=reply, piece_bytes=5)
    blocks, _ = await collect(engine, req(reasoning=ReasoningConfig(budget_tokens=2)))
    assert [b.kind for b in blocks] == [BlockKind.REASONING, BlockKind.TEXT]
    assert blocks[1].text == "Hi!" and len(blocks[0].text) < len("The user greets. Greet back.")


async def test_a_format_without_a_thinking_block_has_no_budget():
    engine = FakeEngine(chat_format="mistral-nemo", reply="<think>no markers here</think>ok")
    async with serving(engine) as runner:
        prepared = await runner.prepare(req(reasoning=ReasoningConfig(budget_tokens=1)))
    assert prepared.reasoning_budget is None and engine.reasoning_close == ()


async def test_a_template_that_refuses_the_request_is_a_400_naming_messages():
    source = "{% if messages[0].role != 'system' %}{{ raise_exception('A system turn comes first') }}{% endif %}"
    async with serving(FakeEngine(chat_template=source)) as runner:
        with pytest.raises(RingserveError) as refused:
            await runner.prepare(req())
    assert refused.value.kind is ErrorKind.INVALID_REQUEST and refused.value.param == "messages"
    assert "A system turn comes first" in str(refused.value)


def random_split(seed: int):
    """Cuts a reply's bytes into pieces of 1 to 6 bytes at random (markers and characters too)."""
    rng = random.Random(seed)

    def split(data: bytes) -> list[bytes]:
        pieces, i = [], 0
        while i < len(data):
            n = rng.randint(1, 6)
            pieces.append(data[i : i + n])
            i += n
        return pieces

    return split


@pytest.mark.parametrize("family", sorted(EXAMPLES))
@pytest.mark.parametrize("seed", range(3))
async def test_every_familys_reply_comes_out_as_its_blocks_whatever_the_token_splits(family, seed):
    """The fake engine plays a reply in the family's syntax (its thinking, text, then a call:
    bench/format_parsers.py's) cut into random tokens; the runner gives the reasoning, text and
    call blocks."""
    fmt = FAMILIES[family]
    engine = FakeEngine(chat_format=family, reply=bench_reply(family, fmt, 8), split=random_split(seed))
    blocks, finish = await collect(engine, req(tools=tuple(TOOLS)))
    kinds = [b.kind for b in blocks]
    expected = [BlockKind.TOOL_CALL]
    if family != "llama-3":
        expected = [BlockKind.TEXT, *expected]
    if fmt.reasoning is not None and family != "functionary-v3.2":
        expected = [BlockKind.REASONING, *expected]
    assert kinds == expected, [(b.kind, b.text[:40]) for b in blocks]
    words = "the weather in Paris depends on the season"  # bench_reply's 8 words
    assert all(b.text.strip() == words for b in blocks if b.kind is not BlockKind.TOOL_CALL)
    assert (blocks[-1].name, json.loads(blocks[-1].text)) == ("get_weather", {"city": "Paris", "days": 3})
    assert finish.stop_reason is StopReason.TOOL_USE
    assert (finish.usage.reasoning_tokens > 0) == (BlockKind.REASONING in kinds)


WEATHER = ToolSpec("get_weather", "", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
}))


@pytest.mark.parametrize(("family", "prompt"), [("qwen3-coder", ""), ("qwen3-coder", "<think>\n"), ("gpt-oss", ""),
                                                ("deepseek-v3.2", ""), ("mistral", "")])
async def test_a_forced_call_is_decoded_in_the_familys_syntax(family, prompt):
    """The fake engine writes what the family's call grammar forces (its example); the runner
    reads it with the family's parser into a call block."""
    engine = FakeEngine(chat_format=family, generation_prompt=prompt, piece_bytes=3)
    request = req(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))
    blocks, finish = await collect(engine, request)
    assert engine.begins[-1].constraint.call.family == family
    assert [(b.kind, b.name, json.loads(b.text)) for b in blocks] == [
        (BlockKind.TOOL_CALL, "get_weather", {"city": "example", "days": 1})]
    assert finish.stop_reason is StopReason.TOOL_USE


async def test_strict_calls_are_decoded_under_the_grammar_from_the_familys_trigger():
    """The call after the thinking block is decoded under the grammar from its trigger (the fake
    writes the grammar's example over the scripted invalid arguments), and the text after the
    call is the script's."""
    strict = attrs.evolve(WEATHER, strict=True)
    reply = ('<think>maybe a call</think>Checking.<tool_call>\n<function=get_weather>\n'
             '<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call> Done.')
    engine = FakeEngine(chat_format="qwen3-coder", reply=reply, piece_bytes=1)  # the marker's last byte ends a token
    blocks, finish = await collect(engine, req(tools=(strict,)))
    assert [b.kind for b in blocks] == [BlockKind.REASONING, BlockKind.TEXT, BlockKind.TOOL_CALL, BlockKind.TEXT]
    assert blocks[0].text == "maybe a call" and blocks[1].text == "Checking."
    assert json.loads(blocks[2].text) == {"city": "example", "days": 1} and blocks[3].text == "Done."
    assert [type(s.switch).__name__ for s in engine.switches] == ["GrammarOn", "GrammarOff"]
    assert finish.stop_reason is StopReason.TOOL_USE


async def test_a_json_answer_may_follow_the_thinking_block_the_prompt_opened():
    engine = FakeEngine(chat_format="hermes", generation_prompt="<think>\n")
    blocks, _ = await collect(engine, req(output=OutputFormat(OutputKind.JSON_OBJECT)))
    assert blocks == (ContentBlock(BlockKind.TEXT, "{}"),)
    assert engine.begins[-1].constraint.frame == ("</think>", "")


async def test_a_forced_call_of_a_family_without_a_call_grammar_is_refused():
    async with serving(FakeEngine(chat_format="lfm2")) as runner:
        with pytest.raises(RingserveError, match="cannot be forced") as refused:
            await runner.prepare(req(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert refused.value.param == "tool_choice"


async def test_render_gives_the_prompt_text_and_tokens_prepare_decodes():
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>{{ '<think>' if enable_thinking }}"
    engine = FakeEngine(chat_template=source, chat_format="hermes")
    request = req("What <think>?", tools=(WEATHER,))
    async with serving(engine) as runner:
        rendered = await runner.render(request)
        prepared = await runner.prepare(request)
        off = await runner.render(attrs.evolve(request, reasoning=ReasoningConfig(enabled=False)))
        with pytest.raises(RingserveError) as refused:
            await runner.render(req(template_kwargs='{"messages": 1}'))
    assert rendered.text == "<user>What <think>?<assistant><think>" and rendered.reasoning_open
    assert rendered.tokens == prepared.prompt_tokens == tuple(rendered.text.encode())
    assert off.text == "<user>What <think>?<assistant>" and not off.reasoning_open
    assert refused.value.param == "messages" and "cannot be rendered" in refused.value.message


@pytest.mark.parametrize(("family", "budget"), [("hermes", 5), ("gpt-oss", None)])
async def test_a_forced_calls_budget_is_kept_where_the_closing_text_goes_on_to_the_calls(family, budget):
    """gpt-oss's closing text opens its final channel, which a forced call's grammar does not take."""
    engine = FakeEngine(chat_format=family)
    request = req(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
                  reasoning=ReasoningConfig(budget_tokens=5))
    async with serving(engine) as runner:
        assert (await runner.prepare(request)).reasoning_budget == budget
        assert (await runner.prepare(attrs.evolve(request, tools=(), tool_choice=ToolChoice()))).reasoning_budget == 5
