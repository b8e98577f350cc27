"""engine/runner.py with tools and structured output on the FakeEngine: block events, stop
reasons, malformed calls, and a cancel during constrained decoding."""

from __future__ import annotations

import json
import threading
from contextlib import asynccontextmanager

import attrs
import jsonschema
import pytest
import trio

from ringserve.config import EngineConfig
from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    ContentBlock,
    Failure,
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
from ringserve.core.scheduler import SlotState
from ringserve.core.toolcalls import format_call
from ringserve.engine import examples, gbnf
from ringserve.engine import runner as runner_module
from ringserve.engine.gbnf import GrammarOff, GrammarOn, LazyCalls, constraint_for
from ringserve.engine.fake import FakeEngine, Switched
from ringserve.engine.runner import Runner

GUARD = 10

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
    },
    "required": ["city", "unit"],
}
WEATHER = ToolSpec("get_weather", "The weather in a city.", json.dumps(WEATHER_SCHEMA))
TIME = ToolSpec("get_time", "The time in a city.", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))


@asynccontextmanager
async def serving(engine, **config):
    runner = Runner(engine, EngineConfig(**config))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            yield runner
        nursery.cancel_scope.cancel()


def req(text="What is the weather in Paris?", *, tools=(WEATHER, TIME), choice=ToolChoice(), **kw):
    return GenerationRequest(
        (ChatMessage("user", text),), kw.pop("max_tokens", 400), SamplingParams(temperature=0),
        tools=tools, tool_choice=choice, **kw,
    )


async def run(engine, request):
    async with serving(engine) as runner:
        prepared = await runner.prepare(request)
        async with runner.submit(prepared) as gen:
            events = [e async for e in gen]
    return events


def blocks(events) -> list[ContentBlock]:
    out: list[ContentBlock] = []
    for e in events:
        if isinstance(e, BlockStart):
            out.append(ContentBlock(e.kind, "", e.name, e.call_id))
        elif isinstance(e, BlockDelta):
            out[-1] = ContentBlock(out[-1].kind, out[-1].text + e.text, out[-1].name, out[-1].call_id)
    return out


def check_order(events) -> None:
    """Blocks are sequential, numbered from 0, one open at a time; then one terminal event."""
    open_index, next_index = None, 0
    for e in events[:-1]:
        match e:
            case BlockStart():
                assert open_index is None and e.index == next_index
                open_index, next_index = e.index, next_index + 1
            case BlockDelta():
                assert e.index == open_index
            case BlockStop():
                assert e.index == open_index
                open_index = None
            case _:
                pytest.fail(f"unexpected {e!r}")
    assert isinstance(events[-1], Finish | Failure)
    if isinstance(events[-1], Finish):
        assert open_index is None


async def test_a_named_tool_is_one_call_streamed_in_fragments():
    engine = FakeEngine(piece_bytes=3)
    events = await run(engine, req(choice=ToolChoice(ToolChoiceMode.NAMED, "get_weather")))
    check_order(events)
    assert engine.begins[-1].constraint is not None and "get_weather" in engine.begins[-1].constraint.grammar
    start = events[0]
    assert start == BlockStart(0, BlockKind.TOOL_CALL, "get_weather", start.call_id)
    assert len(start.call_id) == 24 and int(start.call_id, 16) >= 0
    deltas = [e for e in events if isinstance(e, BlockDelta)]
    assert len(deltas) >= 2
    arguments = json.loads("".join(d.text for d in deltas))
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    assert events[-2:-1] == [BlockStop(0)]
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.stop_reason is StopReason.TOOL_USE
    assert sum(d.tokens for d in deltas) <= finish.usage.output_tokens


async def test_required_calls_one_of_the_tools():
    engine = FakeEngine(piece_bytes=5)
    events = await run(engine, req(choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    check_order(events)
    (call,) = blocks(events)
    assert call.kind is BlockKind.TOOL_CALL and call.name == "get_weather"
    assert events[-1].stop_reason is StopReason.TOOL_USE


async def test_auto_text_then_two_calls_then_eog():
    reply = "Let me check." + format_call("get_weather", '{"city": "Paris", "unit": "celsius"}') + "\n" + format_call(
        "get_time", '{"city": "Paris"}'
    ) + "\n"
    engine = FakeEngine(piece_bytes=2, reply=reply)
    events = await run(engine, req())
    check_order(events)
    assert engine.begins[-1].constraint is None  # auto: the model decides, unconstrained
    got = blocks(events)
    assert [(b.kind, b.name) for b in got] == [
        (BlockKind.TEXT, ""), (BlockKind.TOOL_CALL, "get_weather"), (BlockKind.TOOL_CALL, "get_time")
    ]
    assert got[0].text == "Let me check."
    assert json.loads(got[1].text) == {"city": "Paris", "unit": "celsius"}
    assert got[1].call_id != got[2].call_id
    assert events[-1].stop_reason is StopReason.TOOL_USE


async def test_auto_without_parallel_ends_at_the_first_call():
    reply = format_call("get_time", '{"city": "Oslo"}') + "\n" + format_call("get_time", '{"city": "Rome"}')
    engine = FakeEngine(piece_bytes=4, reply=reply)
    events = await run(engine, req(choice=ToolChoice(ToolChoiceMode.AUTO, parallel=False)))
    check_order(events)
    assert [b.text for b in blocks(events)] == ['{"city": "Oslo"}']
    assert events[-1].stop_reason is StopReason.TOOL_USE
    assert events[-1].usage.output_tokens < FakeEngine(piece_bytes=4, reply=reply).reply_tokens("x")


async def test_auto_text_only_ends_with_end():
    engine = FakeEngine(piece_bytes=1, reply="No tool <tool needed.")
    events = await run(engine, req())
    assert blocks(events) == [ContentBlock(BlockKind.TEXT, "No tool <tool needed.")]
    assert events[-1].stop_reason is StopReason.END


async def test_choice_none_neither_renders_nor_parses():
    reply = format_call("get_time", "{}")
    engine = FakeEngine(piece_bytes=4, reply=reply)
    request = req(choice=ToolChoice(ToolChoiceMode.NONE))
    events = await run(engine, request)
    assert blocks(events) == [ContentBlock(BlockKind.TEXT, reply)]
    assert events[-1].stop_reason is StopReason.END
    assert engine.tokenize_chat(request) == engine.tokenize_chat(attrs.evolve(request, tools=()))


async def test_a_malformed_auto_call_fails_the_message():
    engine = FakeEngine(piece_bytes=3, reply='ok <tool_call>\n{"name": "get_time", "arguments": {"city": ]}\n</tool_call>')
    events = await run(engine, req())
    check_order(events)
    failure = events[-1]
    assert isinstance(failure, Failure) and failure.kind is ErrorKind.API_ERROR and not failure.retryable
    assert "malformed tool call" in failure.message


async def test_eog_inside_an_auto_call_fails_the_message():
    engine = FakeEngine(piece_bytes=3, reply='<tool_call>{"name": "get_time", "arguments": {"city": "x"')
    events = await run(engine, req())
    assert isinstance(events[-1], Failure) and "ended inside a tool call" in events[-1].message


async def test_max_tokens_inside_a_call_stops_the_block_with_max_tokens():
    engine = FakeEngine(piece_bytes=2)
    events = await run(engine, req(choice=ToolChoice(ToolChoiceMode.NAMED, "get_weather"), max_tokens=30))
    check_order(events)
    assert events[-1].stop_reason is StopReason.MAX_TOKENS
    assert [b.kind for b in blocks(events)] == [BlockKind.TOOL_CALL]


async def test_json_output_is_a_text_block_under_the_schema_grammar():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    engine = FakeEngine(piece_bytes=2)
    events = await run(engine, req(tools=(), output=OutputFormat(OutputKind.JSON_SCHEMA, json.dumps(schema))))
    (block,) = blocks(events)
    assert block.kind is BlockKind.TEXT
    jsonschema.validate(json.loads(block.text), schema)
    assert events[-1].stop_reason is StopReason.END


async def test_a_refused_schema_is_a_400_before_anything_is_queued():
    bad = ToolSpec("x", "", json.dumps({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}))
    async with serving(FakeEngine()) as runner:
        with pytest.raises(RingserveError) as info:
            await runner.prepare(req(tools=(bad,), choice=ToolChoice(ToolChoiceMode.REQUIRED)))
        assert runner.statistics().queue_depth == {} or sum(runner.statistics().queue_depth.values()) == 0
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert info.value.message == "tools[0].parameters.properties.n: keyword 'minimum' is not supported"


async def test_collect_returns_the_blocks():
    reply = "Hi." + format_call("get_time", '{"city": "Oslo"}')
    async with serving(FakeEngine(piece_bytes=3, reply=reply)) as runner:
        async with runner.submit(await runner.prepare(req())) as gen:
            content, finish = await gen.collect()
    assert content[0] == ContentBlock(BlockKind.TEXT, "Hi.")
    assert content[1].kind is BlockKind.TOOL_CALL and content[1].text == '{"city": "Oslo"}'
    assert finish.stop_reason is StopReason.TOOL_USE


async def test_cancel_during_constrained_decoding_frees_the_slot_within_a_step():
    long_string = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
    tool = ToolSpec("write", "", json.dumps(long_string))
    engine = FakeEngine(piece_bytes=1)
    async with serving(engine) as runner:
        prepared = await runner.prepare(req(tools=(tool,), choice=ToolChoice(ToolChoiceMode.REQUIRED), max_tokens=3000))
        assert prepared.constraint is not None
        async with runner.submit(prepared) as gen:
            seen = 0
            async for event in gen:
                seen += isinstance(event, BlockDelta)
                if seen == 5:
                    break
            calls_at_cancel = len(engine.log)
        assert gen.cancelled and gen.state is SlotState.CANCELLED
        await runner.wait_idle()
        stats = runner.statistics()
    assert stats.kv_cells_used == 0 and stats.slots_busy == 0 and stats.cancels == 1
    assert stats.tokens_after_cancel_total <= 1
    fed_after = [f for call in engine.log[calls_at_cancel:] for f in call.feeds if f.slot == gen.slot]
    assert len(fed_after) <= 1  # at most the step in flight at the cancel
    assert gen.usage.output_tokens < 100


STRICT_WEATHER = ToolSpec(WEATHER.name, WEATHER.description, WEATHER.parameters, strict=True)


async def test_strict_auto_decodes_each_call_under_the_grammar_from_its_marker():
    # The scripted model writes text, a call of the strict tool whose arguments do not
    # validate, text, and a call of the non-strict tool: the grammar goes on after each
    # marker and off after each call. Under it the fake writes the grammar's example, a
    # call of the first tool, so both calls come out as valid get_weather calls.
    bad = format_call("get_weather", '{"city": 5}')
    reply = "Let me check." + bad + "\nand " + format_call("get_time", '{"city": "Rome"}') + "\nDone."
    engine = FakeEngine(piece_bytes=3, reply=reply)
    events = await run(engine, req(tools=(STRICT_WEATHER, TIME)))
    check_order(events)
    assert engine.begins[-1].constraint == LazyCalls((STRICT_WEATHER, TIME))
    switches = engine.switches
    assert [type(s.switch) for s in switches] == [GrammarOn, GrammarOff, GrammarOn, GrammarOff]
    # On right after the sample that completes "<tool_call>" ("Let me check." is 13 bytes).
    assert switches[0].sample == -(-(13 + len("<tool_call>")) // 3)
    got = blocks(events)
    assert [(b.kind, b.name) for b in got] == [
        (BlockKind.TEXT, ""), (BlockKind.TOOL_CALL, "get_weather"), (BlockKind.TEXT, ""),
        (BlockKind.TOOL_CALL, "get_weather"), (BlockKind.TEXT, ""),
    ]
    assert got[0].text == "Let me check." and got[2].text == "and " and got[4].text == "Done."
    for call in (got[1], got[3]):
        jsonschema.validate(json.loads(call.text), WEATHER_SCHEMA)
    # Off on the sample that completes the call: the watch's parser saw its "</tool_call>".
    example = LazyCalls((STRICT_WEATHER, TIME)).after("")  # the marker ended a piece: nothing after it
    assert example is not None and switches[0].switch == GrammarOn(example)
    assert switches[1].sample == switches[0].sample + -(-len(examples.example(example)) // 3)
    assert events[-1].stop_reason is StopReason.TOOL_USE  # text after calls: still a tool-use turn


async def test_without_grammar_examples_the_scripted_calls_are_played_as_written_under_the_grammar():
    """The agents' tests script the calls an agent runs: under a lazy grammar they stay as written
    (the grammar still goes on and off at the same samples)."""
    good = format_call("get_weather", '{"city": "Rome"}')
    engine = FakeEngine(piece_bytes=3, reply="Let me check." + good + "\nDone.", grammar_examples=False)
    events = await run(engine, req(tools=(STRICT_WEATHER, TIME)))
    assert [type(s.switch) for s in engine.switches] == [GrammarOn, GrammarOff]
    assert json.loads(blocks(events)[1].text) == {"city": "Rome"}


async def test_auto_without_a_strict_tool_is_not_watched():
    engine = FakeEngine(piece_bytes=3, reply=format_call("get_weather", '{"city": 5}'))
    events = await run(engine, req())
    assert engine.begins[-1].constraint is None and engine.switches == []
    assert json.loads(blocks(events)[0].text) == {"city": 5}


async def test_cancel_inside_a_strict_auto_call_frees_the_slot():
    long_string = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
    tool = ToolSpec("write", "", json.dumps(long_string), strict=True)
    engine = FakeEngine(piece_bytes=1, reply="ok " + format_call("write", '{"text": "x"}'))
    async with serving(engine) as runner:
        prepared = await runner.prepare(req(tools=(tool,), max_tokens=3000))
        async with runner.submit(prepared) as gen:
            seen = 0
            async for event in gen:
                seen += isinstance(event, BlockDelta) and event.index == 1
                if seen == 5:
                    break
            calls_at_cancel = len(engine.log)
        await runner.wait_idle()
        stats = runner.statistics()
    assert [type(s.switch) for s in engine.switches] == [GrammarOn]
    assert stats.kv_cells_used == 0 and stats.slots_busy == 0 and stats.cancels == 1
    fed_after = [f for call in engine.log[calls_at_cancel:] for f in call.feeds if f.slot == gen.slot]
    assert len(fed_after) <= 1


async def test_the_byte_bound_before_tokenizing_counts_the_tools():
    # One token per byte: a tool description longer than the slot cannot fit, and is
    # refused without tokenizing, as message text is.
    tokenized = []
    engine = FakeEngine(n_ctx=256, tokenize_hook=lambda: tokenized.append(1))
    big = ToolSpec("big", "d" * 300, json.dumps({"type": "object"}))
    async with serving(engine) as runner:
        with pytest.raises(RingserveError, match="the messages and tools hold 3.. bytes of text") as info:
            await runner.prepare(req("hi", tools=(big,)))
        assert info.value.param == "messages" and tokenized == []
        # With tool choice none the tools are not rendered: the prompt fits.
        await runner.prepare(req("hi", tools=(big,), choice=ToolChoice(ToolChoiceMode.NONE)))
        assert tokenized == [1]


async def test_the_grammar_is_made_on_a_worker_thread(monkeypatch):
    """Its cost grows with the schemas' bounds: the event loop never waits on it."""
    made_on = []

    def spy(request, *format_and_prompt):
        made_on.append(threading.current_thread())
        return constraint_for(request, *format_and_prompt)

    monkeypatch.setattr(runner_module, "constraint_for", spy)
    async with serving(FakeEngine()) as runner:
        prepared = await runner.prepare(req(choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert prepared.constraint is not None and len(made_on) == 1
    assert made_on[0] is not threading.current_thread()


BROKEN = ToolSpec("broken", "", json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}), strict=True)


def _fail_for_broken(monkeypatch) -> None:
    """Making a grammar of BROKEN's schema fails (as the converter could on a schema the checks let through)."""
    convert = gbnf._convert

    def failing(schemas):
        if any(text == BROKEN.parameters for text, _ in schemas):
            raise invalid("tools[0].parameters: cannot be made", "tools[0].parameters")
        return convert(schemas)

    gbnf.GRAMMAR_CACHE.clear()
    monkeypatch.setattr(gbnf, "_convert", failing)


async def test_a_strict_tool_under_auto_whose_grammar_cannot_be_made_is_refused_as_if_forced(monkeypatch):
    """Was admitted, then failed at the engine's begin (the real engine: a 500 'the engine could not
    start'; the fake: during decoding, failing every active slot)."""
    _fail_for_broken(monkeypatch)
    engine = FakeEngine()
    async with serving(engine) as runner:
        errors = []
        for choice in (ToolChoice(ToolChoiceMode.REQUIRED), ToolChoice()):
            with pytest.raises(RingserveError) as info:
                await runner.prepare(req(tools=(BROKEN,), choice=choice))
            errors.append((info.value.kind, info.value.message, info.value.param))
    assert errors[0] == errors[1] == (ErrorKind.INVALID_REQUEST, "tools[0].parameters: cannot be made", "tools[0].parameters")
    assert engine.begins == []


async def test_a_grammar_that_fails_in_one_slot_leaves_the_other_slots_alone(monkeypatch):
    """Two requests decode together; the call grammar of one cannot be made when its call starts
    (injected once both are admitted). That call is left unconstrained and logged, as a grammar
    llama.cpp cannot parse is; the other request is untouched. (The fake engine raised out of
    decode, which failed every active slot.)"""
    after = gbnf.LazyCalls.after
    admitted = trio.Event()

    def failing_after(self, text):
        if admitted.is_set():
            raise invalid("injected", "tools")
        return after(self, text)

    monkeypatch.setattr(gbnf.LazyCalls, "after", failing_after)
    call = "Checking." + format_call("get_weather", '{"city": 5}')
    engine = FakeEngine(piece_bytes=4, reply=lambda text: call if "weather" in text else "A plain answer, " * 8)
    results: dict[str, list] = {}
    async with serving(engine) as runner:
        requests = {"call": req("What is the weather?", tools=(STRICT_WEATHER, TIME), choice=ToolChoice()),
                    "plain": req("Say something.", tools=())}
        prepared = {name: await runner.prepare(request) for name, request in requests.items()}
        admitted.set()

        async def one(name):
            async with runner.submit(prepared[name]) as gen:
                results[name] = [e async for e in gen]

        async with trio.open_nursery() as nursery:
            for name in prepared:
                nursery.start_soon(one, name)
    assert engine.switches == []  # no grammar went on
    assert isinstance(results["call"][-1], Finish) and results["call"][-1].stop_reason is StopReason.TOOL_USE
    assert json.loads(blocks(results["call"])[1].text) == {"city": 5}  # unconstrained
    assert isinstance(results["plain"][-1], Finish) and blocks(results["plain"])[0].text == "A plain answer, " * 8
    assert len({e.slot for e in engine.begins}) == 2  # they were decoded side by side
