"""Tool calls and JSON output under the grammar on the real bundled model (SmolLM2-135M, greedy).

One LlamaEngine (4 slots x 1024 cells) for the module; each test runs its own Runner on it.
"""

from __future__ import annotations

import ctypes
import json
import math
import random
from contextlib import asynccontextmanager

import jsonschema
import pytest
import trio

from bench.tool_calls import random_schema, run_calls
from ringserve.config import EngineConfig
from ringserve.core.batch import SlotFeed
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    ChatMessage,
    Finish,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    SamplingParams,
    StopReason,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.schema import MAX_OPTIONAL_REPEATS
from ringserve.engine import gbnf
from ringserve.engine.examples import example
from ringserve.engine.modelfile import default_model_path
from ringserve.engine.runner import Runner
from ringserve.formats.families import FAMILIES
from tests.engine.test_gbnf import ENFORCED
from tests.support.helpers import GREEDY, prompt_tokens

llama = pytest.importorskip("ringserve.engine.llama")
lc = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.model

GUARD = 900  # seconds; a hang guard on a loaded 2-core machine, never a wait

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = ToolSpec("get_weather", "Get the current weather in a city.", json.dumps(WEATHER_SCHEMA))


@pytest.fixture(scope="module")
def engine():
    eng = llama.LlamaEngine(default_model_path(), n_slots=4, n_ctx=4096)
    yield eng
    eng.close()


@asynccontextmanager
async def served(engine):
    runner = Runner(engine, EngineConfig(slots=4, queue_size=64))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            yield runner
            await runner.wait_idle()
        nursery.cancel_scope.cancel()


def weather(max_tokens: int = 120, **kw) -> GenerationRequest:
    return GenerationRequest(
        (ChatMessage("user", "What is the weather like in Paris today?"),),
        max_tokens,
        SamplingParams(temperature=0),
        tools=(WEATHER,),
        **kw,
    )


async def test_a_forced_call_parses_and_validates(engine):
    async with served(engine) as runner:
        prepared = await runner.prepare(weather(tool_choice=ToolChoice(ToolChoiceMode.NAMED, "get_weather")))
        async with runner.submit(prepared) as gen:
            events = [e async for e in gen]
    start = events[0]
    assert isinstance(start, BlockStart) and start.kind is BlockKind.TOOL_CALL and start.name == "get_weather"
    deltas = [e.text for e in events if isinstance(e, BlockDelta)]
    assert len(deltas) >= 2
    jsonschema.validate(json.loads("".join(deltas)), WEATHER_SCHEMA)
    assert isinstance(events[-1], Finish) and events[-1].stop_reason is StopReason.TOOL_USE


async def test_json_object_output_parses(engine):
    request = GenerationRequest(
        (ChatMessage("user", "Give me a JSON object describing a cat with a name and an age."),),
        80,
        SamplingParams(temperature=0),
        output=OutputFormat(OutputKind.JSON_OBJECT),
    )
    async with served(engine) as runner:
        async with runner.submit(await runner.prepare(request)) as gen:
            content, finish = await gen.collect()
    assert isinstance(finish, Finish) and finish.stop_reason is StopReason.END, finish
    assert isinstance(json.loads(content[0].text), dict)


async def test_cancel_during_constrained_decoding_frees_the_slot(engine):
    async with served(engine) as runner:
        prepared = await runner.prepare(weather(400, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
        async with runner.submit(prepared) as gen:
            async for event in gen:
                if isinstance(event, BlockDelta):
                    break
        await runner.wait_idle()
        stats = runner.statistics()
    assert gen.cancelled and stats.kv_cells_used == 0 and stats.slots_busy == 0
    assert stats.tokens_after_cancel_total <= 1


async def test_ten_random_schema_calls_all_parse_and_validate(engine):
    async with served(engine) as runner:
        result = await run_calls(runner, 10, seed=1, max_tokens=256)
    assert result["ok"] == 10, result["failures"]


def allowed(sampler, token: int) -> bool:
    """Whether the grammar sampler lets ``token`` come next (llama_sampler_apply on one candidate)."""
    data = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
    candidates = lc.llama_token_data_array(data, 1, -1, False)
    lc.llama_sampler_apply(sampler, ctypes.byref(candidates))
    return data[0].logit != -math.inf


def check_accepts_example(engine, constraint: gbnf.Constraint, first_rejected: str, then: str = "") -> None:
    """llama.cpp parses the grammar; it rejects ``first_rejected`` at the start, accepts the
    example token by token, is complete only at its end, and then allows ``then`` too."""
    vocab = engine._vocab  # the engine's llama_vocab: the grammar sampler needs it
    sampler = lc.llama_sampler_init_grammar(vocab, constraint.grammar.encode(), b"root")
    assert sampler, constraint.grammar
    try:
        assert not allowed(sampler, engine.tokenize(first_rejected)[0])
        eos = lc.llama_vocab_eos(vocab)
        for token in engine.tokenize(example(constraint)):
            assert not allowed(sampler, eos)  # not complete before the example is
            assert allowed(sampler, token), (example(constraint), engine.token_piece(token))
            lc.llama_sampler_accept(sampler, token)
        assert allowed(sampler, eos)
        if then:
            assert allowed(sampler, engine.tokenize(then)[0])
    finally:
        lc.llama_sampler_free(sampler)


@pytest.mark.parametrize("schema", ENFORCED + [random_schema(random.Random(i)) for i in range(20)])
def test_llama_parses_each_grammar_and_it_accepts_the_example(engine, schema):
    check_accepts_example(engine, gbnf.output_grammar(json.dumps(schema), "o"), "[")


def test_llama_parses_the_widest_bounds_the_checker_lets_through(engine):
    span = MAX_OPTIONAL_REPEATS
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": span},
            "a": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2 + span},
        },
        "required": ["s", "a"],
    }
    check_accepts_example(engine, gbnf.output_grammar(json.dumps(schema), "o"), "[")


def test_llama_parses_a_calls_grammar_of_two_tools(engine):
    other = ToolSpec("record", "", json.dumps(random_schema(random.Random(7))))
    check_accepts_example(engine, gbnf.calls_grammar([WEATHER, other], True), "{", then="\n")


@pytest.mark.parametrize("tail", ["", "\n", '{"'])
def test_llama_parses_a_call_grammar_after_the_marker_and_it_accepts_the_example(engine, tail):
    other = ToolSpec("record", "", json.dumps(random_schema(random.Random(7))), strict=True)
    loose = ToolSpec("loose", "", json.dumps({"type": "object", "properties": {"n": {"minimum": 1}}}))
    constraint = gbnf.LazyCalls((other, WEATHER, loose)).after(tail)
    assert constraint is not None
    check_accepts_example(engine, constraint, "x")


def test_llama_tokenize_chat_renders_tool_turns(engine):
    history = (
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("toolu_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),)),
        ChatMessage("tool", "18 C and sunny", tool_call_id="toolu_1"),
    )
    tokens = prompt_tokens(engine, history, (WEATHER,))
    text = "".join(engine.token_piece(t).decode("utf-8", "replace") for t in tokens)
    assert "You can call tools." in text and '"name": "get_weather"' in text
    assert '<tool_response>\n{"call_id": "toolu_1", "name": "get_weather", "content": "18 C and sunny"}' in text
    assert len(tokens) < len(prompt_tokens(engine, history, (WEATHER,), ToolChoice(ToolChoiceMode.AUTO))) + 1


async def test_a_strict_tool_under_auto_is_called_under_its_grammar(engine):
    # The bundled model opens a call by itself for this prompt (greedy); from the token
    # after its <tool_call> marker the arguments are decoded under the strict tool's schema.
    strict = ToolSpec(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    request = GenerationRequest(
        (ChatMessage("system", "You must call a tool."), ChatMessage("user", "Weather in Rome?")),
        100,
        SamplingParams(temperature=0),
        tools=(strict,),
    )
    async with served(engine) as runner:
        prepared = await runner.prepare(request)
        assert isinstance(prepared.constraint, gbnf.LazyCalls)
        async with runner.submit(prepared) as gen:
            content, finish = await gen.collect()
    calls = [b for b in content if b.kind is BlockKind.TOOL_CALL]
    assert [c.name for c in calls] == ["get_weather"], content
    jsonschema.validate(json.loads(calls[0].text), WEATHER_SCHEMA)
    # Free text again after the call: the model goes on (here until max_tokens).
    assert content[-1].kind is BlockKind.TEXT and isinstance(finish, Finish), (content, finish)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"lfm2", "gemma-4", "minimax-m3", "kimi-k3"}))
def test_llama_cpp_takes_every_familys_call_grammars(engine, family):
    """Forced calls (a thinking block first or not), a JSON answer after the thinking block and a
    lazy call's rest, in each family's syntax: llama.cpp parses them at begin (it would refuse the
    slot with an EngineError) and a greedy slot decodes under them."""
    fmt = FAMILIES[family]
    weather = ToolSpec(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)
    constraints = [gbnf.calls_grammar([weather], True, fmt, opened) for opened in (False, True)]
    constraints.append(gbnf.output_grammar(json.dumps(WEATHER_SCHEMA), "output.schema", fmt, True))
    lazy = gbnf.LazyCalls((weather,), fmt)
    prompt = tuple(prompt_tokens(engine, [ChatMessage("user", "Weather in Paris?")]))
    try:
        for constraint in [*constraints, lazy]:
            engine.begin(0, GREEDY, constraint=constraint)
            [sampled] = engine.decode([SlotFeed(0, prompt, 0, True)])
            assert not sampled.eog
            engine.release(0)
    finally:
        engine.release(0)


def test_a_forced_end_of_thinking_goes_through_a_forced_calls_grammar(engine):
    """A reasoning budget forces the block's closing marker under a forced call's grammar that
    the prompt opened the block for: llama.cpp's grammar takes each forced token (a token it
    did not take would abort the process), and the reply goes on with the call."""
    weather = ToolSpec(WEATHER.name, WEATHER.description, WEATHER.parameters)
    constraint = gbnf.calls_grammar([weather], False, FAMILIES["hermes"], reasoning_open=True)
    close = engine.tokenize("</think>", parse_special=True)
    prompt = tuple(prompt_tokens(engine, [ChatMessage("user", "Weather in Paris?")]))
    try:
        engine.begin(0, GREEDY, constraint=constraint)
        [first] = engine.decode([SlotFeed(0, prompt, 0, True)])  # thinking, as the grammar lets it
        pos, fed, text = len(prompt), first.token, first.piece
        for token in close:
            [sampled] = engine.decode([SlotFeed(0, (fed,), pos, True, token)])
            assert sampled.token == token
            pos, fed, text = pos + 1, token, text + sampled.piece
        for _ in range(40):
            [sampled] = engine.decode([SlotFeed(0, (fed,), pos, True)])
            if sampled.eog:
                break
            pos, fed, text = pos + 1, sampled.token, text + sampled.piece
        assert b"</think>" in text and b'<tool_call>\n{"name": "get_weather", "arguments": {' in text
    finally:
        engine.release(0)
