"""The runner and a request's samplers and log probabilities, on the fake engine (issue 40).

The runner resolves a request's sampler settings over the defaults and hands them, the prompt
and the logprobs asked for to the engine's ``begin``; each token's log probabilities ride on
the text delta that holds its text (``engine/generation.py`` ``Generation._carry``).
"""

from __future__ import annotations

import math

import pytest

from ringserve.core.errors import RingserveError
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    ChatMessage,
    GenerationRequest,
    LogitBias,
    SamplingParams,
    StopReason,
    ToolSpec,
)
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling
from ringserve.engine.fake import FakeEngine, fake_logprob
from tests.engine.test_runner import serving


def request(text: str, *, logprobs: int | None = 2, stop: tuple[str, ...] = (), **kw) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", text),), 256, kw.pop("sampling", SamplingParams()), stop,
                             logprobs=logprobs, **kw)


async def run(engine: FakeEngine, req: GenerationRequest):
    async with serving(engine) as runner:
        prepared = await runner.prepare(req)
        async with runner.submit(prepared) as gen:
            events = [e async for e in gen]
    return prepared, events


def pieces(delta: BlockDelta) -> bytes:
    return b"".join(lp.piece for lp in delta.logprobs)


async def test_a_request_without_samplers_is_decoded_with_llama_servers_defaults_and_its_prompt():
    engine = FakeEngine()
    prepared, _ = await run(engine, request("hi", logprobs=None))
    begin = engine.begins[-1]
    assert begin.sampling == prepared.sampling == resolve_sampling(SamplingParams(), LLAMA_SERVER_DEFAULTS)
    assert begin.sampling.temperature == 0.8 and begin.prompt_tokens == len(prepared.prompt_tokens)
    prepared, _ = await run(engine, request("hi", sampling=SamplingParams(temperature=0, logit_bias=(
        LogitBias("ab", 1.0), LogitBias(300, -math.inf)))))
    assert engine.begins[-1].sampling == prepared.sampling
    assert prepared.sampling.temperature == 0 and prepared.sampling.top_k == 40
    assert prepared.sampling.logit_bias == (LogitBias(97, 1.0), LogitBias(98, 1.0), LogitBias(300, -math.inf))


async def test_a_logit_bias_token_out_of_the_vocabulary_is_refused_before_anything_is_enqueued():
    engine = FakeEngine()
    async with serving(engine) as runner:
        with pytest.raises(RingserveError) as err:
            outside = SamplingParams(logit_bias=(LogitBias(1 << 16, 1.0),))
            await runner.prepare(request("hi", sampling=outside))
    assert err.value.param == "logit_bias" and "ids 0..65535" in err.value.message
    assert engine.begins == []


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 5])
async def test_each_text_delta_carries_the_log_probabilities_of_the_tokens_whose_text_it_holds(piece_bytes):
    """Cut into tokens of 1 to 5 bytes, "é" and "👋" fall across tokens: a delta carries the tokens
    whose bytes its text completes (a token's bytes may hold the start of the next character: they
    are at most 3 bytes ahead of the text), and all of them the reply's, once each, in order."""
    reply = "Héllo 👋 wörld"
    engine = FakeEngine(reply=reply, piece_bytes=piece_bytes)
    _, events = await run(engine, request("hi", logprobs=3))
    deltas = [e for e in events if isinstance(e, BlockDelta)]
    text = carried_bytes = b""
    for delta in deltas:
        text, carried_bytes = text + delta.text.encode(), carried_bytes + pieces(delta)
        assert carried_bytes.startswith(text) and len(carried_bytes) - len(text) < 4
    carried = [lp for d in deltas for lp in d.logprobs]
    assert [lp.piece for lp in carried] == [reply.encode()[i:i + piece_bytes]
                                            for i in range(0, len(reply.encode()), piece_bytes)]
    assert carried == [fake_logprob(lp.piece, i, 3) for i, lp in enumerate(carried)]
    assert all(len(lp.top) == 3 for lp in carried)
    _, plain = await run(engine, request("hi", logprobs=None))
    assert all(not e.logprobs for e in plain if isinstance(e, BlockDelta))


async def test_a_stop_strings_tokens_and_the_end_carry_nothing_and_held_text_carries_its_tokens():
    engine = FakeEngine(reply="one two STOP three", piece_bytes=2)
    _, events = await run(engine, request("hi", stop=("STOP",)))
    deltas = [e for e in events if isinstance(e, BlockDelta)]
    assert "".join(d.text for d in deltas) == "one two "
    assert b"".join(pieces(d) for d in deltas) == b"one two "  # "ST", "OP": held, then the stop: none
    assert events[-1].stop_reason is StopReason.STOP_SEQUENCE
    engine = FakeEngine(reply="one S", piece_bytes=1)
    _, events = await run(engine, request("hi", stop=("STOP",)))
    deltas = [e for e in events if isinstance(e, BlockDelta)]
    assert deltas[-1].text == "S" and pieces(deltas[-1]) == b"S"  # released at the end, with its token


async def test_reasoning_and_tool_call_tokens_carry_nothing():
    """The thinking, a call's arguments and the markers around them are no text: only the answer's
    tokens are carried (with the blank line the parser drops before it, which they hold)."""
    reply = '<think>Plan it.</think>\n\nSure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    engine = FakeEngine(chat_format="hermes", reply=reply, piece_bytes=3)
    tool = ToolSpec("f", "", '{"type": "object", "properties": {}}')
    _, events = await run(engine, request("hi", tools=(tool,)))
    kinds = {e.index: e.kind for e in events if isinstance(e, BlockStart)}
    assert sorted(kinds.values()) == sorted([BlockKind.REASONING, BlockKind.TEXT, BlockKind.TOOL_CALL])
    carried = [e for e in events if isinstance(e, BlockDelta) and e.logprobs]
    assert all(kinds[d.index] is BlockKind.TEXT for d in carried)
    # tokens of 3 bytes: "k>\n" ends the block, "\nSu" starts the answer, "<to" opens the call
    assert b"".join(pieces(d) for d in carried) == b"\nSure."
