"""The prompt-prefix cache end to end on the fake engine: cached tokens, prefill, slot choice, cancels.

The fake engine keeps each slot's KV cells as the tokens fed to it and picks
its reply from those cells (``echo:`` requests echo the last user message), so
a cell reused wrongly shows up as a wrong answer. One token per prompt byte.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    BlockDelta,
    ChatMessage,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
)
from ringserve.engine.fake import Begin, FakeEngine
from ringserve.engine.runner import Runner, RunnerStatistics
from tests.engine.test_runner import serving
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, prompt_tokens, sse_events
from tests.support.server import MODEL_THREADS, fake_config, running_server

REAL_GUARD = 180  # seconds: a hang guard on the real model, never a wait
SYSTEM = "You are a terse assistant who answers every question in one short line. " * 4


def req(messages: list[ChatMessage], max_tokens: int = 64) -> GenerationRequest:
    return GenerationRequest(tuple(messages), max_tokens, SamplingParams(temperature=0))


async def turn(runner: Runner, messages: list[ChatMessage], max_tokens: int = 64):
    """Run one request to its end: (text, terminal event, generation)."""
    prepared = await runner.prepare(req(messages, max_tokens))
    async with runner.submit(prepared) as gen:
        events = [e async for e in gen]
    return "".join(e.text for e in events if isinstance(e, BlockDelta)), events[-1], gen


def conversation(name: str, turns: int) -> list[ChatMessage]:
    out = [ChatMessage("system", SYSTEM)]
    for i in range(turns):
        out.append(ChatMessage("user", f"echo:{name} answer {i}"))
        if i < turns - 1:
            out.append(ChatMessage("assistant", f"{name} answer {i}"))
    return out


async def test_turn_two_reports_the_shared_prefix_and_prefills_only_the_rest():
    engine = FakeEngine(n_slots=2, piece_bytes=1)
    async with serving(engine, slots=2) as runner:
        first = conversation("a", 1)
        text1, last1, _ = await turn(runner, first)
        await runner.wait_idle()
        before = runner.statistics()
        prefilled_before = sum(engine.prefilled)
        second = conversation("a", 2)
        text2, last2, gen2 = await turn(runner, second)
        await runner.wait_idle()
        after = runner.statistics()
    n1 = len(prompt_tokens(engine, first))
    n2 = len(prompt_tokens(engine, second))
    # turn 1's cells are its prompt then its reply; turn 2's prompt has "<|assistant|>" where the
    # reply's cells start, so the shared prefix is exactly turn 1's prompt
    assert (text1, text2) == ("a answer 0", "a answer 1")
    assert last1.usage.cached_tokens == 0
    assert isinstance(last2, Finish) and last2.usage.input_tokens == n2
    assert last2.usage.cached_tokens == n1 == gen2.usage.cached_tokens
    assert sum(engine.prefilled) - prefilled_before == n2 - n1
    assert after.prompt_tokens_prefilled_total - before.prompt_tokens_prefilled_total == n2 - n1
    assert after.prefix_cache_hit_tokens_total == n1
    assert after.prefix_cache_lookup_tokens_total == n1 + n2
    assert engine.begins[-1] == Begin(gen2.slot, n1, None)


async def test_a_repeated_prompt_feeds_its_last_token_again():
    engine = FakeEngine(n_slots=1, piece_bytes=1)
    async with serving(engine, slots=1) as runner:
        messages = conversation("r", 1)
        text1, _, _ = await turn(runner, messages)
        text2, last2, _ = await turn(runner, messages)
    n = len(prompt_tokens(engine, messages))
    assert text1 == text2 == "r answer 0"
    assert last2.usage.cached_tokens == n - 1  # the last prompt token gives the first sample's logits
    assert engine.log[-len(text2) - 1].feeds[0].tokens == (prompt_tokens(engine, messages)[-1],)


async def test_two_conversations_alternating_on_two_slots_keep_their_own_slot():
    engine = FakeEngine(n_slots=2, piece_bytes=1)
    slots: dict[str, set[int]] = {"a": set(), "b": set()}
    async with serving(engine, slots=2) as runner:
        for i in range(1, 5):
            for name in ("a", "b"):
                text, last, gen = await turn(runner, conversation(name, i))
                assert text == f"{name} answer {i - 1}"
                slots[name].add(gen.slot)
                if i > 1:  # every later turn hits its own cache
                    assert last.usage.cached_tokens == len(prompt_tokens(engine, conversation(name, i - 1)))
    assert len(slots["a"]) == len(slots["b"]) == 1 and slots["a"] != slots["b"]
    # only b's first turn copied (a's system prompt), into the slot a was not in
    assert [b.source for b in engine.begins] == [None, *slots["a"], *[None] * 6]


async def test_a_new_conversation_copies_the_system_prompt_from_another_slot():
    engine = FakeEngine(n_slots=2, piece_bytes=1)
    async with serving(engine, slots=2) as runner:
        await turn(runner, conversation("a", 1))
        text, last, gen = await turn(runner, conversation("b", 1))
    shared = len(prompt_tokens(engine, [ChatMessage("system", SYSTEM)]))
    b_prompt = prompt_tokens(engine, conversation("b", 1))
    a_prompt = prompt_tokens(engine, conversation("a", 1))
    common = next(i for i, (x, y) in enumerate(zip(a_prompt, b_prompt, strict=False)) if x != y)
    assert common >= shared
    assert text == "b answer 0" and last.usage.cached_tokens == common
    assert engine.begins[-1] == Begin(gen.slot, common, 1 - gen.slot)  # a's slot kept its cache


async def test_a_cancelled_turn_then_the_same_conversation_gives_the_right_answer():
    reply = "z" * 80
    engine = FakeEngine(n_slots=1, piece_bytes=1)
    async with serving(engine, slots=1) as runner:
        # the fake echoes the user text it finds in the slot's cells: a wrong cell changes the answer
        messages = [ChatMessage("system", SYSTEM), ChatMessage("user", f"echo:{reply}")]
        prepared = await runner.prepare(req(messages, max_tokens=200))
        async with runner.submit(prepared) as gen:
            async for event in gen:
                if isinstance(event, BlockDelta) and gen.usage.output_tokens >= 10:
                    break  # the consumer leaves mid-generation
        await runner.wait_idle()
        cached_cells = runner.statistics().prefix_cache_cells
        text, last, gen2 = await turn(runner, messages, max_tokens=200)
        await runner.wait_idle()
        stats = runner.statistics()
    n = len(prompt_tokens(engine, messages))
    assert gen.cancelled and n <= cached_cells < n + gen.usage.output_tokens
    assert text == reply and last.stop_reason is StopReason.END
    assert last.usage.cached_tokens == n - 1
    assert stats.kv_cells_used == 0 and engine.kv_cells_used() == stats.prefix_cache_cells


async def test_a_failed_generation_leaves_nothing_to_reuse():
    engine = FakeEngine(n_slots=1, piece_bytes=1, fail_after_tokens=3)
    async with serving(engine, slots=1) as runner:
        messages = conversation("f", 1)
        _, last1, _ = await turn(runner, messages)
        await runner.wait_idle()
        assert runner.statistics().prefix_cache_cells == 0
        engine.fail_after_tokens = None
        text, last2, _ = await turn(runner, messages)
    assert last1.kind is ErrorKind.API_ERROR
    assert text == "f answer 0" and last2.usage.cached_tokens == 0


async def test_prefix_cache_off_is_todays_behaviour():
    engine = FakeEngine(n_slots=2, piece_bytes=1)
    async with serving(engine, slots=2, prefix_cache=False) as runner:
        for i in (1, 2, 3):
            text, last, gen = await turn(runner, conversation("o", i))
            assert text == f"o answer {i - 1}" and last.usage.cached_tokens == 0 and gen.slot == 0
        await runner.wait_idle()
        stats = runner.statistics()
    assert all(b.keep == 0 and b.source is None for b in engine.begins)
    assert engine.kv_cells_used() == 0 and not stats.prefix_cache
    assert stats.prefix_cache_lookup_tokens_total == stats.prefix_cache_hit_tokens_total == 0
    assert stats.prompt_tokens_prefilled_total == stats.prompt_tokens_total


# -- each surface's own usage fields, and the metrics ---------------------------------------


async def test_surfaces_report_cached_tokens_in_their_own_fields(tmp_path):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "echo:hi"}]
    async with running_server(fake_config(tmp_path)) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            first = (await client.post("/v1/chat/completions", json={**OPENAI_BODY, "messages": messages})).json()
            second = (await client.post("/v1/chat/completions", json={**OPENAI_BODY, "messages": messages})).json()
            body = {**ANTHROPIC_BODY, "system": SYSTEM, "messages": messages[1:]}
            full = (await client.post("/v1/messages", json=body)).json()
            _, events, _ = await sse_events(client, "POST", "/v1/messages", json={**body, "stream": True})
            # the terminal event is in the log before the runner's next step releases the slot
            with trio.fail_after(10):
                while state.hub.runner.statistics().slots_busy:
                    await trio.sleep(0.01)
            metrics = (await client.get("/metrics")).text
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens"] == n
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": n - 1}
    # Anthropic: input_tokens is the uncached part, the two add up to the prompt
    assert full["usage"]["input_tokens"] == 1 and full["usage"]["cache_read_input_tokens"] == n - 1
    delta = json.loads(next(e.data for e in events if e.event == "message_delta"))
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == n
    assert delta["usage"]["cache_read_input_tokens"] == n - 1

    def metric(name: str) -> float:
        return next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(name + " "))

    assert metric("ringserve_prefix_cache_lookup_tokens_total") == 4 * n
    assert metric("ringserve_prefix_cache_hit_tokens_total") == 3 * (n - 1)
    assert metric("ringserve_prompt_tokens_prefilled_total") == n + 3
    assert metric("ringserve_prefix_cache_cells") >= n
    assert metric("ringserve_kv_cells_used") == 0


# -- the real bundled model ------------------------------------------------------------------

REAL_SYSTEM = "You are a helpful assistant for a bicycle workshop. Answer briefly and politely. " * 12
REAL_QUESTIONS = ["When are you open?", "How much is a full service?", "Do you repair electric bikes?"]


@pytest.fixture(scope="module")
def llama_engine():
    llama = pytest.importorskip("ringserve.engine.llama")
    from ringserve.engine.modelfile import default_model_path

    # flash attention off (the default): see test_real_greedy_output_with_the_cache_equals_output_without
    eng = llama.LlamaEngine(default_model_path(), n_slots=2, n_ctx=2048, n_threads=MODEL_THREADS, kv_unified=False)
    yield eng
    eng.close()


async def chat(runner: Runner, questions: list[str], system: str = REAL_SYSTEM, max_tokens: int = 12):
    """A conversation, each turn sending the whole history: [(text, terminal, generation)] per turn."""
    history = [ChatMessage("system", system)]
    out = []
    for q in questions:
        history.append(ChatMessage("user", q))
        text, last, gen = await turn(runner, history, max_tokens)
        assert isinstance(last, Finish), last
        out.append((text, last, gen))
        history.append(ChatMessage("assistant", text))
    return out


@pytest.mark.model
async def test_real_turn_two_reports_the_shared_prefix_and_prefills_only_the_rest(llama_engine):
    from ringserve.core.scheduler import common_prefix

    eng = llama_engine
    async with serving(eng, REAL_GUARD, slots=2, ctx_per_slot=1024) as runner:
        ((text1, last1, _),) = await chat(runner, REAL_QUESTIONS[:1])
        await runner.wait_idle()
        before = runner.statistics()
        history = [ChatMessage("system", REAL_SYSTEM), ChatMessage("user", REAL_QUESTIONS[0]),
                   ChatMessage("assistant", text1), ChatMessage("user", REAL_QUESTIONS[1])]
        _, last2, _ = await turn(runner, history, 12)
        after = runner.statistics()
    prompt1 = prompt_tokens(eng, history[:2])
    prompt2 = prompt_tokens(eng, history)
    # turn 1's cells: its prompt, then its sampled tokens but the last (never fed); greedy SmolLM2
    # samples the tokens the tokenizer gives for its text
    cells1 = prompt1 + eng.tokenize(text1)[: last1.usage.output_tokens - 1]
    shared = common_prefix(prompt2, cells1)
    assert shared > len(prompt1)  # the prompt and (some of) the reply
    assert last2.usage.cached_tokens == shared
    assert last2.usage.input_tokens == len(prompt2)
    prefilled = after.prompt_tokens_prefilled_total - before.prompt_tokens_prefilled_total
    assert prefilled == len(prompt2) - shared


#: The replies without the cache (``prefix_cache_output`` means nothing then), made by the first of
#: the two cases below and compared against by both: one run of the conversations less.
_WITHOUT_CACHE: list[tuple[list[str], list[int], RunnerStatistics]] = []


@pytest.mark.model
@pytest.mark.parametrize("cache_output", [False, True], ids=["prompt-cells", "prompt-and-output-cells"])
async def test_real_greedy_output_with_the_cache_equals_output_without(llama_engine, cache_output):
    """Temperature 0, cache on against off: a conversation's two turns, its first prompt again (all
    but its last token cached), and a second conversation (its system prompt copied from the
    first one's slot, then a turn on its own history).

    With only prompt cells kept (``prefix_cache_output = false``) every reply is equal. With the
    cells of generated tokens kept too (the default), a turn that reuses them may differ: those
    cells were computed one token per decode step, and llama.cpp's CPU kernels sum a one-row batch
    in another order than a batched prefill of the same tokens (measured here: the second turn's
    reply diverged after a few words). Replies that reuse prompt cells only are equal either way.

    Both need flash attention off (the default): with it on, the attention of a token is summed in
    an order that depends on how many tokens of its sequence are in the batch, so even the rest of
    a prompt fed after a hit can round differently (measured on a 204-token prompt: a reply
    diverged at its 6th token for 1, 4, 32 or 48 re-fed tokens). docs/prefix-cache.md
    says so.
    """
    results = {}
    for cache in (False, True):
        if not cache and _WITHOUT_CACHE:
            results[cache] = _WITHOUT_CACHE[0]
            continue
        async with serving(llama_engine, REAL_GUARD, slots=2, ctx_per_slot=1024, prefix_cache=cache,
                           prefix_cache_output=cache_output) as runner:
            turns = [*await chat(runner, REAL_QUESTIONS[:2]), *await chat(runner, REAL_QUESTIONS[:1]),
                     *await chat(runner, REAL_QUESTIONS[1:])]
            await runner.wait_idle()
            results[cache] = ([t for t, _, _ in turns], [g.usage.cached_tokens for _, _, g in turns],
                              runner.statistics())
        if not cache:
            _WITHOUT_CACHE.append(results[cache])
    texts, cached, stats = results[True]
    assert results[False][1] == [0] * 5
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert stats.prefix_cache_hit_tokens_total == sum(cached)
    prompt_only = [0, 2, 3]  # a miss, a repeated prompt, a copied system prompt
    if cache_output:
        assert [texts[i] for i in prompt_only] == [results[False][0][i] for i in prompt_only]
    else:
        assert texts == results[False][0]


@pytest.mark.model
async def test_real_cancelled_turn_then_the_same_conversation_gives_the_right_answer(llama_engine):
    history = [ChatMessage("system", REAL_SYSTEM), ChatMessage("user", "Tell me a long story about a bicycle.")]
    async with serving(llama_engine, REAL_GUARD, slots=2, ctx_per_slot=1024, prefix_cache=False) as runner:
        expected, _, _ = await turn(runner, history, 24)
    async with serving(llama_engine, REAL_GUARD, slots=2, ctx_per_slot=1024) as runner:
        prepared = await runner.prepare(req(history, 200))
        async with runner.submit(prepared) as gen:
            async for event in gen:
                if isinstance(event, BlockDelta) and gen.usage.output_tokens >= 4:
                    break
        await runner.wait_idle()
        text, last, gen2 = await turn(runner, history, 24)
    assert gen.cancelled
    assert text == expected and last.usage.cached_tokens == len(prepared.prompt_tokens) - 1


async def test_a_stored_answer_keeps_the_cached_token_split(tmp_path):
    """An idempotent retry and GET answer with the usage the live answer had, cached part included."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "echo:hi"}]
    body = {**ANTHROPIC_BODY, "system": SYSTEM, "messages": messages[1:]}
    async with running_server(fake_config(tmp_path)) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            await client.post("/v1/messages", json=body)  # fills the prefix cache
            headers = {"Idempotency-Key": "k1"}
            live = (await client.post("/v1/messages", json=body, headers=headers)).json()
            retry = (await client.post("/v1/messages", json=body, headers=headers)).json()
            status = (await client.get(f"/v1/messages/{live['id']}")).json()
    assert live["usage"]["cache_read_input_tokens"] > 0
    assert retry["id"] == live["id"] and retry["usage"] == live["usage"]
    assert status["usage"]["input_tokens"] == live["usage"]["input_tokens"] + live["usage"]["cache_read_input_tokens"]
