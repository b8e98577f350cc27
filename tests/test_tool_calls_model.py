"""Tool calls and JSON output under the grammar on the real bundled model (SmolLM2-135M, greedy).

One LlamaEngine (4 slots x 1024 cells) for the module; each test runs its own Runner on it.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import jsonschema
import pytest
import trio

from bench.tool_calls import run_calls
from ringserve.config import EngineConfig
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
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.engine.modelfile import default_model_path
from ringserve.engine.runner import Runner

llama = pytest.importorskip("ringserve.engine.llama")

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
    eng = llama.LlamaEngine(default_model_path(), n_slots=4, n_ctx_slot=1024)
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
