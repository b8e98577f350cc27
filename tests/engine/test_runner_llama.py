"""engine/runner.py on the real bundled model (SmolLM2-135M, greedy, <= 32 tokens each).

One LlamaEngine (4 slots x 512 cells) per module; each test runs its own
Runner on it. A runner releases every slot it used before it parks, keeping
only its prefix-cache cells, and a new runner knows no cache entries, so it
empties a slot when it begins it: tests do not see each other's KV cells.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio

from ringserve.config import EngineConfig
from ringserve.core.events import (
    BlockDelta,
    ChatMessage,
    Failure,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
)
from ringserve.engine.modelfile import default_model_path
from ringserve.engine.runner import Runner
from tests.engine.test_engine_llama import BUNDLED
from tests.support.helpers import prompt_tokens
from tests.support.server import MODEL_THREADS

llama = pytest.importorskip("ringserve.engine.llama")

pytestmark = pytest.mark.model

N_SLOTS = 4
N_CTX_SLOT = 512
MAX_TOKENS = 32
GUARD = 120  # seconds; a hang guard, never a wait
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "List three fruits and their colors.",
    "Describe a sunny day in a park.",
]


@pytest.fixture(scope="module")
def engine():
    eng = llama.LlamaEngine(default_model_path(), n_slots=N_SLOTS, n_ctx=N_SLOTS * N_CTX_SLOT, n_threads=MODEL_THREADS,
                            kv_unified=False)
    yield eng
    eng.close()


def req(text: str, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(
        (ChatMessage("user", text),), max_tokens, SamplingParams(temperature=0)
    )


@asynccontextmanager
async def Served(engine):  # noqa: N802 - reads like the class it replaces
    """A runner on ``engine`` in its own nursery; on the way out it drains, then stops.

    If the body fails (a timeout included), leaving the nursery cancels the
    runner, which waits for an in-flight decode to return (it never abandons
    the thread), so the module's engine is never closed under a running decode.
    """
    runner = Runner(engine, EngineConfig(slots=N_SLOTS, ctx_per_slot=N_CTX_SLOT))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        yield runner
        await runner.wait_idle()
        nursery.cancel_scope.cancel()


async def run_one(runner: Runner, text: str, log: list | None = None, tag: int = 0, started: trio.Event | None = None):
    """Generate to the end: (text, terminal event, generation, tokens per delta); ``started`` is
    set at the first delta."""
    prepared = await runner.prepare(req(text))
    parts = []
    async with runner.submit(prepared) as gen:
        async for event in gen:
            if isinstance(event, BlockDelta):
                if not parts and log is not None:
                    log.append(("first", tag))
                if started is not None:
                    started.set()
                parts.append(event.text)
            elif isinstance(event, Finish | Failure):
                if log is not None:
                    log.append(("end", tag))
                terminal = event
    return "".join(parts), terminal, gen


async def test_four_concurrent_generations_start_before_any_finishes(engine):
    """C8 on the real model: four generations submitted together all start before any ends,
    and they share decode steps (batching), counted in steps rather than timed."""
    order: list[tuple[str, int]] = []
    results = {}

    async def one(runner, i):
        results[i] = await run_one(runner, PROMPTS[i], order, i)

    with trio.fail_after(GUARD):
        async with Served(engine) as runner:
            await one(runner, 0)
            order.clear()
            steps_before = runner.statistics().steps
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, runner, i)
            four_steps = runner.statistics().steps - steps_before
    kinds = [k for k, _ in order]
    assert kinds.count("first") == 4
    assert max(i for i, k in enumerate(kinds) if k == "first") < kinds.index("end")
    for text, last, _ in results.values():
        assert text and isinstance(last, Finish)
    tokens = [r[2].usage.output_tokens for r in results.values()]
    print(f"\n4 streams: {sum(tokens)} tokens in {four_steps} decode steps")
    # C8: batching pays: the four share steps. One at a time would take sum(tokens) steps;
    # batched, the longest one's plus at most one prefill step per other stream.
    assert four_steps <= max(tokens) + 3 < sum(tokens)


async def test_greedy_output_alone_equals_output_under_concurrency(engine):
    """Batching does not change greedy output on this build.

    The request alone is decoded in batches of 1 token per step; under
    concurrency the same slot shares its batches with 3 others (and with their
    prompt chunks, once it started). llama.cpp's CPU kernels could in principle sum
    in a different order for a different batch shape and flip an argmax; with a
    per-sequence KV cache on this CPU build they do not (as also checked at the
    engine level in test_engine_llama.py), so the texts and usage are equal.
    """
    with trio.fail_after(GUARD):
        async with Served(engine) as runner:
            alone, alone_last, _ = await run_one(runner, PROMPTS[1])
            results = {}
            started = trio.Event()

            async def one(i, started=None):
                results[i] = await run_one(runner, PROMPTS[i], started=started)

            # PROMPTS[1] is admitted first, to the slot that holds its cached prompt: the prompts
            # share SmolLM2's default system prompt, so another one admitted first would take that
            # slot for the shared prefix.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 1, started)
                await started.wait()
                for i in (0, 2, 3):
                    nursery.start_soon(one, i)
    together, together_last, _ = results[1]
    assert together == alone
    assert together_last.stop_reason == alone_last.stop_reason
    assert together_last.usage.output_tokens == alone_last.usage.output_tokens
    # the second run of PROMPTS[1] found all but its last prompt token in the prefix cache
    assert (alone_last.usage.cached_tokens, together_last.usage.cached_tokens) == (
        0, together_last.usage.input_tokens - 1)


async def test_cancel_mid_generation_frees_the_kv_cells(engine):
    with trio.fail_after(GUARD):
        async with Served(engine) as runner:
            prepared = await runner.prepare(req(PROMPTS[0], max_tokens=400))
            async with runner.submit(prepared) as gen:
                seen = 0
                async for event in gen:
                    seen += isinstance(event, BlockDelta)
                    if seen == 3:
                        break
            await runner.wait_idle()
            stats = runner.statistics()
            # the runner is parked: reading the engine from here cannot race a decode
            cells = engine.kv_cells_used(gen.slot)
            cells_all = engine.kv_cells_used()
    # no request holds cells; the slot keeps the committed ones as its prefix-cache entry
    assert gen.cancelled and cells == cells_all == stats.prefix_cache_cells
    assert len(prepared.prompt_tokens) <= cells < len(prepared.prompt_tokens) + gen.usage.output_tokens
    assert stats.kv_cells_used == 0 and stats.slots_busy == 0
    assert stats.cancels == 1 and stats.tokens_after_cancel_total <= 1
    assert 3 <= gen.usage.output_tokens < 400
    assert stats.last_cancel_to_free_seconds is not None
    print(f"\ncancel -> KV freed: {stats.last_cancel_to_free_seconds * 1000:.2f} ms")


async def test_usage_counts(engine):
    with trio.fail_after(GUARD):
        async with Served(engine) as runner:
            text, last, gen = await run_one(runner, PROMPTS[2])
            stats = runner.statistics()
    prompt = prompt_tokens(engine, req(PROMPTS[2]).messages)
    assert last.usage == gen.usage
    assert last.usage.input_tokens == len(prompt)
    assert 1 <= last.usage.output_tokens <= MAX_TOKENS
    if last.stop_reason is StopReason.MAX_TOKENS:
        assert last.usage.output_tokens == MAX_TOKENS
    assert stats.generated_tokens_total == last.usage.output_tokens
    assert stats.prompt_tokens_total == len(prompt)
    assert text


async def test_render_is_llama_servers_prompt(engine):
    """The runner's render of a request: llama-server's /apply-template and /tokenize for the bundled
    model (tests/data/templates/bundled.json), SmolLM2's default system prompt included."""
    case = BUNDLED["user"]
    with trio.fail_after(GUARD):
        async with Served(engine) as runner:
            rendered = await runner.render(req(case["messages"][0]["content"]))
    assert rendered.text == case["prompt"]
    assert list(rendered.tokens) == [int(t) for t in case["tokens"].split()] and len(rendered.tokens) == 37
