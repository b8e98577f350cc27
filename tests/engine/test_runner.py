"""engine/runner.py on the FakeEngine: streaming, stops, concurrency, cancels, failures.

No test sleeps to "let it run". Tests wait on facts: a generation's events,
``Runner.wait_idle()``, or a hook that the fake engine calls (on the Trio
thread, while its decode call is still in flight) to order things exactly.
Fake decode steps take no time, so the real clock is used; ``trio.fail_after``
bounds are a guard against hangs, not a wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio

import ringserve.engine.runner as runner_module
from ringserve.config import EngineConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    Failure,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
)
from ringserve.core.scheduler import SlotState
from ringserve.engine.fake import DEFAULT_REPLY, DecodeCall, FakeEngine
from ringserve.engine.runner import Runner, RunnerStatistics
from tests.support.helpers import prompt_tokens
from tests.support.wait import wait_until

GUARD = 10  # seconds: no test should come near this

Hook = Callable[[DecodeCall], Awaitable[None]]


class HookedEngine(FakeEngine):
    """FakeEngine that runs an async hook on the Trio thread at the end of each decode call.

    The worker thread waits for the hook, so whatever the hook does happens
    while that decode step is in flight. It also records which threads called
    the engine (``threads``: begin, decode, release) and which tokenized
    (``tokenize_threads``); ``tokenize_seconds`` makes each tokenization take
    that long on its thread.
    """

    def __init__(self, *, hook: Hook | None = None, tokenize_seconds: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hook = hook
        self._trio_token = trio.lowlevel.current_trio_token()  # engine calls run on the runner's own thread
        self.tokenize_seconds = tokenize_seconds
        self.threads: set[int] = set()
        self.tokenize_threads: set[int] = set()

    def tokenize_chat(self, request):
        self.tokenize_threads.add(threading.get_ident())
        time.sleep(self.tokenize_seconds)
        return super().tokenize_chat(request)

    def begin(self, slot, sampling, keep=0, source=None, constraint=None, **kwargs):
        self.threads.add(threading.get_ident())
        return super().begin(slot, sampling, keep, source, constraint, **kwargs)

    def release(self, slot, keep=0):
        self.threads.add(threading.get_ident())
        return super().release(slot, keep)

    def decode(self, feeds):
        self.threads.add(threading.get_ident())
        try:
            return super().decode(feeds)
        finally:
            if self.hook is not None:
                trio.from_thread.run(self.hook, self.log[-1], trio_token=self._trio_token)


def req(text: str, max_tokens: int | None = 256, *, stop=(), priority=0) -> GenerationRequest:
    return GenerationRequest(
        (ChatMessage("user", text),),
        max_tokens,
        SamplingParams(temperature=0),
        tuple(stop),
        priority,
    )


@asynccontextmanager
async def serving(engine, guard: float = GUARD, **config):
    runner = Runner(engine, EngineConfig(**config))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(guard):
            yield runner
        nursery.cancel_scope.cancel()


async def generate(runner: Runner, request: GenerationRequest):
    """Run one request to the end: (events, text, terminal, generation)."""
    prepared = await runner.prepare(request)
    async with runner.submit(prepared) as gen:
        events = [e async for e in gen]
    text = "".join(e.text for e in events if isinstance(e, BlockDelta))
    return events, text, events[-1], gen


async def collect_text(gen):
    """``gen.collect()`` for a text reply: (its text, the terminal event)."""
    blocks, terminal = await gen.collect()
    assert all(b.kind is BlockKind.TEXT for b in blocks)
    return "".join(b.text for b in blocks), terminal


def sample_feeds(engine: FakeEngine, slot: int, after: int = -1) -> int:
    """Successful sampling feeds for ``slot`` in decode calls with index > ``after``."""
    return sum(
        1
        for call in engine.log
        if call.error is None and call.index > after
        for f in call.feeds
        if f.slot == slot and f.sample
    )


# -- text and usage ----------------------------------------------------------


async def test_text_equals_fake_reply_and_usage_counts_tokens_sampled():
    engine = HookedEngine(piece_bytes=3)
    async with serving(engine) as runner:
        events, text, last, gen = await generate(runner, req("hello"))
        await runner.wait_idle()
    threads = engine.threads | engine.tokenize_threads
    assert text == DEFAULT_REPLY
    assert events[0] == BlockStart(0, BlockKind.TEXT) and events[-2] == BlockStop(0)
    assert all(isinstance(e, BlockDelta) and e.index == 0 and e.text for e in events[1:-2])
    expected_tokens = engine.reply_tokens("hello")  # pieces + EOG
    assert last == Finish(StopReason.END, gen.usage)
    assert gen.usage.input_tokens == len(prompt_tokens(engine, [ChatMessage("user", "hello")]))
    assert gen.usage.output_tokens == expected_tokens == sample_feeds(engine, gen.slot)
    assert sum(e.tokens for e in events[1:-2]) <= expected_tokens
    stats = runner.statistics()
    assert stats.generated_tokens_total == expected_tokens
    assert stats.prompt_tokens_total == gen.usage.input_tokens
    # no request holds cells; the slot keeps its prompt and fed-back samples (not the EOG) as a cache entry
    assert stats.kv_cells_used == 0
    assert engine.kv_cells_used() == stats.prefix_cache_cells == gen.usage.input_tokens + expected_tokens - 1
    assert stats.slots_busy == 0 and stats.queue_depth == {}
    # every engine call ran on a worker thread, never on the Trio thread
    assert threads and threading.get_ident() not in threads


async def test_every_begin_decode_and_release_runs_on_one_thread_while_prompts_are_tokenized_beside():
    """Issue 19: llama.cpp's OpenMP keeps a thread team per calling thread; a second one slows every decode.

    Tokenizations that end while the loop is between steps left an idle
    worker thread that ``trio.to_thread`` handed the next step to.
    """
    engine = HookedEngine(piece_bytes=1, tokenize_seconds=0.003, reply="x" * 300)
    async with serving(engine) as runner:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate, runner, req("long"))
            for i in range(20):
                await runner.prepare(req(f"beside {i}"))
            await generate(runner, req("after"))
        await runner.wait_idle()
    assert len(engine.threads) == 1, engine.threads
    assert not engine.threads & ({threading.get_ident()} | engine.tokenize_threads)
    assert len(engine.log) > 20  # the generation was decoding while the prompts were tokenized


async def test_the_engine_thread_ends_when_the_runner_is_idle_and_the_next_request_brings_one(monkeypatch):
    """The thread, and llama.cpp's spinning OpenMP team with it, ends after ENGINE_IDLE_SECONDS without a call."""
    monkeypatch.setattr(runner_module, "ENGINE_IDLE_SECONDS", 0.05)
    engine = HookedEngine(piece_bytes=1)
    async with serving(engine) as runner:
        _, first, _, _ = await generate(runner, req("hello"))
        while runner.engine_thread_alive:
            await trio.sleep(0.01)
        _, again, last, _ = await generate(runner, req("hello"))
        assert runner.engine_thread_alive  # a new thread decoded the second request
    assert again == first and isinstance(last, Finish)


async def test_echo_and_max_tokens():
    engine = FakeEngine(piece_bytes=1)
    async with serving(engine) as runner:
        _, text, last, gen = await generate(runner, req("echo:0123456789", max_tokens=4))
        _, text2, last2, _ = await generate(runner, req("echo:ab"))
    assert (text, last.stop_reason, gen.usage.output_tokens) == ("0123", StopReason.MAX_TOKENS, 4)
    assert (text2, last2.stop_reason, last2.usage.output_tokens) == ("ab", StopReason.END, 3)


@pytest.mark.parametrize("max_tokens", [None, 10_000, 1_000_000])
async def test_max_tokens_none_or_over_the_context_ends_when_the_context_is_full(max_tokens):
    """Issue 22: a budget larger than the context left is served up to the context."""
    engine = FakeEngine(n_ctx=64, piece_bytes=1, reply="z" * 200)
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("hi", max_tokens=max_tokens))
        n_prompt = len(prepared.prompt_tokens)
        assert (prepared.max_tokens, prepared.context_bound) == (64 - n_prompt, True)
        async with runner.submit(prepared) as gen:
            text, last = await collect_text(gen)
        await runner.wait_idle()
        stats = runner.statistics()
    assert text == "z" * (64 - n_prompt)
    assert last == Finish(StopReason.CONTEXT_FULL, gen.usage)
    assert gen.usage.output_tokens == 64 - n_prompt
    # no request holds cells; the slot's cache entry is all of it but the last sample (never fed)
    assert stats.kv_cells_used == 0 and engine.kv_cells_used() == stats.prefix_cache_cells == 63


async def test_max_tokens_exactly_the_context_left_is_max_tokens():
    engine = FakeEngine(n_ctx=64, piece_bytes=1, reply="z" * 200)
    async with serving(engine) as runner:
        n_prompt = len((await runner.prepare(req("hi", max_tokens=None))).prompt_tokens)
        prepared = await runner.prepare(req("hi", max_tokens=64 - n_prompt))
        assert not prepared.context_bound
        async with runner.submit(prepared) as gen:
            text, last = await collect_text(gen)
    assert (len(text), last.stop_reason) == (64 - n_prompt, StopReason.MAX_TOKENS)


async def test_context_bound_generation_that_ends_first_is_end_of_turn():
    engine = FakeEngine(n_ctx=64, piece_bytes=1, reply="short")
    async with serving(engine) as runner:
        _, text, last, gen = await generate(runner, req("hi", max_tokens=16384))
    assert (text, last.stop_reason, gen.usage.output_tokens) == ("short", StopReason.END, 6)


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 4, 5])
async def test_split_multibyte_characters_never_give_replacement_chars(piece_bytes):
    """C6 on the fake: emoji, skin tone, CJK, a flag, Cyrillic and ½ cut at every width."""
    reply = "👍🏽 你好 🇯🇵 Привет ½"
    engine = FakeEngine(piece_bytes=piece_bytes, reply=reply)
    async with serving(engine) as runner:
        events, text, last, _ = await generate(runner, req("repeat"))
    assert "\ufffd" not in text
    assert text == reply
    assert last.stop_reason is StopReason.END
    assert all("\ufffd" not in e.text for e in events if isinstance(e, BlockDelta))


@pytest.mark.parametrize("piece_bytes", [1, 2, 3])
async def test_max_tokens_cutting_a_character_drops_its_bytes(piece_bytes):
    """Issue 12: a reply cut inside a character ends before it; usage counts every token."""
    reply = "👍🏽 你好 🇯🇵 Привет ½"
    n_tokens = -(-len(reply.encode()) // piece_bytes)
    engine = FakeEngine(piece_bytes=piece_bytes, reply=reply)
    answers = []
    async with serving(engine) as runner:
        for max_tokens in range(1, n_tokens + 1):
            events, text, last, gen = await generate(runner, req("repeat", max_tokens=max_tokens))
            assert last == Finish(StopReason.MAX_TOKENS, gen.usage)
            assert gen.usage.output_tokens == max_tokens
            assert all(e.text for e in events if isinstance(e, BlockDelta))  # no empty delta for dropped bytes
            answers.append(text)
    data = reply.encode()
    # each answer is the whole characters of the bytes sampled, the cut one dropped
    assert answers == [data[: n * piece_bytes].decode("utf-8", "ignore") for n in range(1, n_tokens + 1)]
    assert answers[-1] == reply
    assert not any("\ufffd" in a for a in answers)
    for shorter, longer in zip(answers, answers[1:]):
        assert longer.startswith(shorter)
    # cuts inside a character really occur in this sweep
    assert any(len(a.encode()) < min(n * piece_bytes, len(data)) for n, a in enumerate(answers, 1))


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 5, 7])
async def test_stop_sequence_split_across_tokens_does_not_leak(piece_bytes):
    """C7: nothing of "beta gamma" is ever streamed, whatever the token split."""
    engine = FakeEngine(piece_bytes=piece_bytes, reply="alpha beta gamma delta")
    async with serving(engine) as runner:
        events, text, last, gen = await generate(runner, req("go", stop=["beta gamma"]))
    assert text == "alpha "
    assert "b" not in "".join(e.text for e in events if isinstance(e, BlockDelta))
    assert last == Finish(StopReason.STOP_SEQUENCE, gen.usage, "beta gamma")
    # generation stopped at the match: no token of " delta" was sampled
    assert gen.usage.output_tokens == -(-len("alpha beta gamma") // piece_bytes)


async def test_held_back_stop_prefix_is_released_at_the_end():
    engine = FakeEngine(piece_bytes=2, reply="alpha beta gam")
    async with serving(engine) as runner:
        _, text, last, _ = await generate(runner, req("go", stop=["beta gamma"]))
    assert text == "alpha beta gam"
    assert last.stop_reason is StopReason.END and last.stop_sequence is None


async def test_generation_never_waits_for_its_consumer():
    engine = FakeEngine(piece_bytes=1, reply="x" * 300)
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("go", max_tokens=400))
        async with runner.submit(prepared) as gen:
            await runner.wait_idle()  # read nothing until it is all done
            assert isinstance(gen.outcome, Finish)
            stats = runner.statistics()
            assert stats.kv_cells_used == 0 and engine.kv_cells_used() == stats.prefix_cache_cells
            text, last = await collect_text(gen)
    assert text == "x" * 300 and last.stop_reason is StopReason.END


async def test_a_consumer_that_comes_after_the_first_steps_gets_their_events_at_once():
    """``live/produce.py`` writes the message's row (a worker thread's await) between ``submit`` and
    ``consume``: the events made meanwhile reach the consumer, in order, the terminal one too."""
    engine = FakeEngine(piece_bytes=1, reply="x" * 50)
    calls: list[list[object]] = []
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("go", max_tokens=100))
        async with runner.submit(prepared) as gen:
            await runner.wait_idle()  # every event is made before the consumer comes
            gen.consume(calls.append)
    events = [event for call in calls for event in call]
    assert len(calls) == 1 and events[0] == BlockStart(0, BlockKind.TEXT)
    assert "".join(e.text for e in events if isinstance(e, BlockDelta)) == "x" * 50
    assert isinstance(events[-1], Finish) and events[-1].stop_reason is StopReason.END


# -- concurrency and batching ------------------------------------------------


async def test_four_concurrent_generations_all_start_before_any_finishes():
    """C8: one batch serves all four; every first delta comes before the first Finish."""
    engine = FakeEngine(n_slots=4, piece_bytes=2)
    order: list[tuple[str, int]] = []

    async def one(runner: Runner, i: int) -> None:
        prepared = await runner.prepare(req(f"user {i}"))
        async with runner.submit(prepared) as gen:
            first = True
            async for event in gen:
                if isinstance(event, BlockDelta) and first:
                    order.append(("first", i))
                    first = False
                elif isinstance(event, Finish):
                    order.append(("finish", i))

    async with serving(engine) as runner:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, runner, i)
        stats = runner.statistics()
    kinds = [k for k, _ in order]
    assert kinds.count("first") == 4 and kinds.count("finish") == 4
    assert kinds.index("finish") > max(i for i, k in enumerate(kinds) if k == "first")
    # they were decoded together: some batch fed all four slots
    assert max(len(call.feeds) for call in engine.log) == 4
    assert stats.steps < 4 * engine.reply_tokens("user 0")


async def test_long_prompt_does_not_stall_a_decoding_slot():
    engine = HookedEngine(n_slots=2, piece_bytes=1, reply="y" * 80)
    started = trio.Event()

    async def hook(call: DecodeCall) -> None:
        if call.index == 0:
            started.set()

    engine.hook = hook
    async with serving(engine, prefill_chunk=16) as runner:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate, runner, req("short"))
            await started.wait()
            nursery.start_soon(generate, runner, req("L" * 300))
    # while the long prompt was being fed, every batch still carried slot 0's token
    prefill_calls = [c for c in engine.log if any(f.slot == 1 and not f.sample for f in c.feeds)]
    assert len(prefill_calls) >= 300 // 16
    for call in prefill_calls:
        sizes = {f.slot: len(f.tokens) for f in call.feeds}
        assert sizes[1] <= 16
        if call.index < 80:  # slot 0 still generating its 80 + 1 tokens
            assert sizes.get(0) == 1


async def test_priority_then_fifo_admission():
    engine = HookedEngine(n_slots=1, piece_bytes=1, reply="r" * 5)
    gate = trio.Event()
    queued = trio.Event()
    finished: list[str] = []

    async def hook(call: DecodeCall) -> None:
        if call.index == 0:
            gate.set()
            await queued.wait()  # keep "first" in flight until the others are queued

    engine.hook = hook

    async def one(runner, name, prepared):
        async with runner.submit(prepared) as gen:
            await collect_text(gen)
        finished.append(name)

    async with serving(engine, queue_size=8) as runner:
        prepared = {
            name: await runner.prepare(req(name, priority=prio))
            for name, prio in [("first", 0), ("a", 1), ("b", 0), ("c", 1), ("d", 0)]
        }
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, runner, "first", prepared["first"])
            await gate.wait()
            for name in "abcd":
                await one_started(nursery, one, runner, name, prepared[name])
            assert runner.statistics().queue_depth == {0: 2, 1: 2}
            queued.set()
    assert finished == ["first", "b", "d", "a", "c"]


async def one_started(nursery, fn, runner, name, prepared):
    """Start fn and wait until its request is in the queue (queue depth grew)."""
    before = sum(runner.statistics().queue_depth.values())
    nursery.start_soon(fn, runner, name, prepared)
    while sum(runner.statistics().queue_depth.values()) == before:
        await trio.testing.wait_all_tasks_blocked()


# -- admission errors ----------------------------------------------------------


async def test_queue_full_is_overloaded_at_once():
    engine = FakeEngine(n_slots=1, piece_bytes=1, reply="w" * 50)
    async with serving(engine, queue_size=1) as runner:
        p = await runner.prepare(req("x"))
        async with runner.submit(p) as a, runner.submit(p) as b:
            with pytest.raises(RingserveError) as info:
                async with runner.submit(p):
                    pytest.fail("entered a full queue")
            err = info.value
            assert err.kind is ErrorKind.OVERLOADED and err.status == 529
            assert err.retryable and err.retry_after and err.retry_after > 0
            # one request per slot plus queue_size may wait
            assert sum(runner.statistics().queue_depth.values()) == 2
            await collect_text(a)
            await collect_text(b)


async def test_prompt_too_long_is_invalid_before_anything_is_enqueued():
    tokenized = []
    engine = FakeEngine(n_ctx=64, tokenize_hook=lambda: tokenized.append(1))
    async with serving(engine) as runner:
        with pytest.raises(RingserveError) as info:
            await runner.prepare(req("p" * 60, max_tokens=8))  # "<|user|>" + 60 + "\n"
        assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.status == 400
        assert info.value.param == "messages"
        assert "69 tokens" in info.value.message and "64 tokens" in info.value.message
        assert tokenized == [1]
        # text that cannot fit (more bytes than ctx * max_token_bytes) is refused without tokenizing it
        with pytest.raises(RingserveError) as info:
            await runner.prepare(req("é" * 40, max_tokens=8))  # 80 bytes, 1 byte per token at most
        assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.param == "messages"
        assert "80 bytes" in info.value.message and "at least 80 tokens" in info.value.message
        assert "64 tokens" in info.value.message
        assert tokenized == [1]

        with pytest.raises(RingserveError) as info:
            await runner.prepare(req("p" * 55, max_tokens=8))  # 64 tokens: none left to generate
        assert info.value.param == "messages" and "64 tokens" in info.value.message

        stats = runner.statistics()
    assert stats.queue_depth == {} and stats.steps == 0 and engine.log == []


async def test_a_slow_tokenizer_does_not_hold_up_decode_steps():
    """Tokenizing runs beside the decode loop (its own limiter), not under the decode limiter."""
    gate, calls = threading.Event(), []

    def hook() -> None:  # the second prompt's tokenizer is stuck until the gate opens
        calls.append(threading.get_ident())
        if len(calls) == 2:
            assert gate.wait(GUARD)

    engine = FakeEngine(piece_bytes=1, reply="d" * 3000, tokenize_hook=hook)
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("go", max_tokens=None))
        async with runner.submit(prepared) as gen, trio.open_nursery() as nursery:
            await anext(gen.__aiter__())  # streaming
            slow: list = []

            async def prepare_slowly() -> None:
                slow.append(await runner.prepare(req("slow")))

            nursery.start_soon(prepare_slowly)
            with trio.fail_after(5):
                while len(calls) < 2:
                    await trio.sleep(0.001)
                stuck_at = runner.statistics().steps
                while runner.statistics().steps < stuck_at + 20:  # decode steps go on meanwhile
                    await trio.sleep(0.001)
            assert not slow and gen.outcome is None
            gate.set()
        assert len(slow) == 1 and slow[0].prompt_tokens
        assert threading.get_ident() not in calls


async def test_counts_do_not_wait_behind_a_prepare_and_give_its_prompt():
    """count() tokenizes under a limiter of its own: with a generation's prepare stuck in the
    tokenizer, counts go on and give the prompt's size prepare gives; one longer than a slot is
    counted where prepare refuses it."""
    gate, stuck = threading.Event(), []

    def hook() -> None:  # the first prompt's tokenizer is stuck until the gate opens
        stuck.append(1)
        if len(stuck) == 1:
            assert gate.wait(GUARD)

    engine = FakeEngine(tokenize_hook=hook)
    async with serving(engine) as runner, trio.open_nursery() as nursery:
        prepared: list = []

        async def prepare() -> None:
            prepared.append(await runner.prepare(req("prepared first")))

        nursery.start_soon(prepare)
        with trio.fail_after(5):
            while not stuck:
                await trio.sleep(0.001)
            counts = [await runner.count(req(f"count {i}")) for i in range(5)]
        assert not prepared
        assert [c.input_tokens for c in counts] == [len(f"<|user|>count {i}\n") for i in range(5)]
        gate.set()
    assert len(prepared[0].prompt_tokens) == len("<|user|>prepared first\n")
    async with serving(FakeEngine(n_ctx=4096)) as runner:
        assert (await runner.count(req("same"))).input_tokens == len((await runner.prepare(req("same"))).prompt_tokens)
        assert (await runner.count(req("x" * 5000))).input_tokens == len("<|user|>\n") + 5000
        with pytest.raises(RingserveError, match="but the context is 4096 tokens"):
            await runner.prepare(req("x" * 5000))


async def test_submit_without_a_running_loop_is_unavailable():
    engine = FakeEngine()
    runner = Runner(engine, EngineConfig())
    prepared = await runner.prepare(req("x"))
    with pytest.raises(RingserveError) as info:
        async with runner.submit(prepared):
            pass
    assert info.value.kind is ErrorKind.UNAVAILABLE


# -- cancellation (C1/C2) -------------------------------------------------------


async def test_cancel_mid_generation_frees_the_slot_within_one_step():
    engine = FakeEngine(piece_bytes=1, reply="c" * 3000)
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("long", max_tokens=4000))
        async with runner.submit(prepared) as gen:
            seen = 0
            async for event in gen:
                assert isinstance(event, BlockStart | BlockDelta)
                seen += isinstance(event, BlockDelta)
                if seen == 3:
                    break
            calls_at_cancel = len(engine.log)
        assert gen.cancelled and gen.state is SlotState.CANCELLED
        await runner.wait_idle()
        stats = runner.statistics()
    slot = gen.slot
    assert engine.kv_cells_used(slot) == stats.prefix_cache_cells and stats.kv_cells_used == 0
    assert stats.slots_busy == 0 and stats.cancels == 1
    assert stats.tokens_after_cancel_total == gen.tokens_after_cancel <= 1
    # at most the step in flight at the cancel was decoded for it, nothing after
    assert sample_feeds(engine, slot, after=calls_at_cancel - 1) <= 1
    assert stats.last_cancel_to_free_seconds is not None and stats.last_cancel_to_free_seconds >= 0
    assert gen.usage.output_tokens >= 3
    assert gen.usage.output_tokens < 4000


async def test_cancel_while_a_step_is_in_flight_counts_one_token_after_cancel():
    engine = HookedEngine(piece_bytes=1, reply="d" * 500)
    in_flight = trio.Event()
    left = trio.Event()

    async def hook(call: DecodeCall) -> None:
        if call.index == 5:
            in_flight.set()
            await left.wait()  # the decode call returns only after the consumer left

    engine.hook = hook
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("x", max_tokens=600))
        async with runner.submit(prepared) as gen:
            await in_flight.wait()
        left.set()
        await runner.wait_idle()
        stats = runner.statistics()
    assert gen.tokens_after_cancel == 1 and stats.tokens_after_cancel_total == 1
    assert gen.usage.output_tokens == 5  # calls 0..4 delivered; call 5's token came too late
    assert len(engine.log) == 6  # no decode call after the cancelled one
    # the cells kept are those committed: the prompt and samples 0..3; call 5's cell (sample 4) is cut
    assert engine.kv_cells_used(gen.slot) == len(prepared.prompt_tokens) + 4 == stats.prefix_cache_cells


async def test_cancel_while_prefilling():
    engine = HookedEngine(piece_bytes=1)
    in_flight = trio.Event()

    async def hook(call: DecodeCall) -> None:
        if call.index == 1:
            in_flight.set()

    engine.hook = hook
    async with serving(engine, prefill_chunk=8) as runner:
        prepared = await runner.prepare(req("P" * 200))
        async with runner.submit(prepared) as gen:
            await in_flight.wait()
            assert gen.state is SlotState.PREFILL
        await runner.wait_idle()
        stats = runner.statistics()
    assert gen.state is SlotState.CANCELLED and gen.usage.output_tokens == 0
    # only the chunk committed before the cancel stays cached; the one in flight is cut
    assert engine.kv_cells_used() == stats.prefix_cache_cells == 8 and stats.tokens_after_cancel_total == 0
    assert all(not f.sample for call in engine.log for f in call.feeds)
    assert len(engine.log) <= 3


async def test_cancel_while_queued():
    engine = FakeEngine(n_slots=1, piece_bytes=1, reply="q" * 40)
    async with serving(engine) as runner:
        p = await runner.prepare(req("first"))
        q = await runner.prepare(req("second"))
        async with runner.submit(p) as a:
            first = await a.__anext__()  # "first" holds the only slot now
            async with runner.submit(q) as b:
                assert b.state is SlotState.QUEUED
            assert b.state is SlotState.CANCELLED and b.slot is None
            assert runner.statistics().queue_depth == {}
            rest = [e async for e in a]
        await runner.wait_idle()
    assert first == BlockStart(0, BlockKind.TEXT)
    text, last = "".join(e.text for e in rest if isinstance(e, BlockDelta)), rest[-1]
    assert text == "q" * 40 and last.stop_reason is StopReason.END
    assert {f.slot for call in engine.log for f in call.feeds} == {0}
    assert len({call.feeds[0].tokens[:3] for call in engine.log if call.feeds[0].pos == 0}) == 1


async def test_the_runner_forgets_a_generation_once_it_holds_no_slot_or_queue_place():
    engine = FakeEngine(n_slots=1, piece_bytes=1, reply="f" * 40)
    async with serving(engine) as runner:
        async with runner.submit(await runner.prepare(req("first"))) as a:
            await a.__anext__()  # holds the only slot
            async with runner.submit(await runner.prepare(req("queued"))):
                assert len(runner._generations) == 2
            assert len(runner._generations) == 1  # the queued one left at its cancel
        await runner.wait_idle()  # the live one's slot released
        assert runner._generations == {}
        await generate(runner, req("echo:done"))
        await runner.wait_idle()
        assert runner._generations == {}


async def test_trio_cancellation_of_the_consumer_cancels_the_generation():
    engine = HookedEngine(piece_bytes=1, reply="t" * 500)
    consumer_scope = trio.CancelScope()

    async def hook(call: DecodeCall) -> None:
        if call.index == 10:
            consumer_scope.cancel()

    engine.hook = hook
    async with serving(engine) as runner:
        prepared = await runner.prepare(req("x", max_tokens=600))
        with consumer_scope:
            async with runner.submit(prepared) as gen:
                async for _ in gen:
                    pass
        assert consumer_scope.cancelled_caught
        await runner.wait_idle()
        stats = runner.statistics()
    assert gen.cancelled and stats.cancels == 1
    assert engine.kv_cells_used() == stats.prefix_cache_cells and stats.tokens_after_cancel_total <= 1
    assert len(engine.log) <= 12


async def test_cancelled_slot_is_reused_by_the_next_request():
    engine = FakeEngine(n_slots=1, piece_bytes=1, reply="u" * 100)
    async with serving(engine) as runner:
        p = await runner.prepare(req("x"))
        async with runner.submit(p) as gen:
            await gen.__anext__()
        _, text, _, gen2 = await generate(runner, req("echo:again"))
    assert text == "again" and gen2.slot == gen.slot == 0


# -- failures (C3/C12) ---------------------------------------------------------


async def test_engine_error_fails_only_its_generation_and_the_batch_is_retried():
    engine = HookedEngine(n_slots=2, piece_bytes=1, fail_after_tokens=5)
    go_b = trio.Event()
    b_in = trio.Event()

    async def hook(call: DecodeCall) -> None:
        if call.index == 2:
            go_b.set()
            await b_in.wait()

    engine.hook = hook
    results = {}

    async def a(runner):
        results["a"] = await generate(runner, req("echo:" + "a" * 30))

    async def b(runner):
        prepared = await runner.prepare(req("echo:bcd"))  # before the hook holds the limiter
        await go_b.wait()
        async with runner.submit(prepared) as gen:
            b_in.set()
            results["b"] = (await collect_text(gen), gen)

    async with serving(engine) as runner:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a, runner)
            nursery.start_soon(b, runner)
        await runner.wait_idle()
        stats = runner.statistics()

    _, text_a, last_a, gen_a = results["a"]
    assert text_a == "aaaaa"
    assert isinstance(last_a, Failure)
    assert (last_a.kind, last_a.retryable) == (ErrorKind.API_ERROR, True)
    assert last_a.usage.output_tokens == 5 == gen_a.usage.output_tokens

    (text_b, last_b), gen_b = results["b"]
    assert text_b == "bcd" and last_b == Finish(StopReason.END, gen_b.usage)
    # the failing call carried b's feed too; b was fed again at the next step
    failed = [call for call in engine.log if call.error]
    assert len(failed) == 1 and gen_b.slot in failed[0].slots and gen_a.slot in failed[0].slots
    # the failed generation's cells are gone, not cached; b's are its slot's cache entry
    assert stats.failed_steps == 1 and engine.kv_cells_used(gen_a.slot) == 0
    assert engine.kv_cells_used() == engine.kv_cells_used(gen_b.slot) == stats.prefix_cache_cells > 0


async def test_kv_cache_full_is_overloaded_for_that_slot():
    class FullEngine(FakeEngine):
        def decode(self, feeds):
            if any(f.slot == 1 and f.pos > 0 and f.sample for f in feeds):
                from ringserve.engine.protocol import KVCacheFull

                self.log.append(DecodeCall(len(self.log), tuple(feeds), "KVCacheFull"))
                raise KVCacheFull("no room", [1])
            return super().decode(feeds)

    engine = FullEngine(n_slots=2, piece_bytes=1, reply="k" * 10)
    async with serving(engine) as runner:
        async with trio.open_nursery() as nursery:
            results = {}

            async def one(name):
                results[name] = await generate(runner, req(name))

            nursery.start_soon(one, "a")
            nursery.start_soon(one, "b")
    failures = [r for r in results.values() if isinstance(r[2], Failure)]
    finishes = [r for r in results.values() if isinstance(r[2], Finish)]
    assert len(failures) == 1 and len(finishes) == 1
    assert failures[0][2].kind is ErrorKind.OVERLOADED and failures[0][2].retryable
    assert finishes[0][1] == "k" * 10


async def test_decode_crash_fails_every_active_generation_and_serving_goes_on():
    """C12: a bug in decode ends every affected stream with a Failure, then new work succeeds."""
    engine = FakeEngine(n_slots=3, piece_bytes=1, reply="z" * 50, crash_after_steps=3)
    results = []

    async def one(runner, text):
        results.append(await generate(runner, req(text)))

    async with serving(engine, queue_size=4) as runner:
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, runner, f"victim {i}")
        calls_after_failure = len(engine.log)
        _, text, last, _ = await generate(runner, req("echo:after the crash"))
        await runner.wait_idle()
        stats = runner.statistics()
    assert len(results) == 2
    for _, _, last_event, gen in results:
        assert isinstance(last_event, Failure)
        assert (last_event.kind, last_event.retryable) == (ErrorKind.API_ERROR, True)
        assert last_event.usage == gen.usage and gen.usage.output_tokens <= 3
    # they failed at the crashed call itself (call 4), not after more steps
    assert calls_after_failure == 4 and engine.log[3].error == "RuntimeError"
    assert text == "after the crash" and last.stop_reason is StopReason.END
    # the victims' cells are gone (not cached); the last request's are its slot's cache entry
    assert stats.failed_steps == 1 and stats.running
    assert engine.kv_cells_used() == stats.prefix_cache_cells == last.usage.input_tokens + last.usage.output_tokens - 1


async def test_crash_in_the_loop_itself_fails_waiting_consumers():
    engine = FakeEngine(n_slots=1, piece_bytes=1, reply="b" * 20)
    runner = Runner(engine, EngineConfig(queue_size=4))
    results = []
    crashes = []

    def broken(gen, sampled):
        raise ZeroDivisionError("bug in token handling")

    runner._on_token = broken  # a bug inside the owner loop

    async def run_runner(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await runner.run(task_status=task_status)
        except ZeroDivisionError as exc:
            crashes.append(exc)

    async def consumer(prepared):
        async with runner.submit(prepared) as gen:
            results.append(await collect_text(gen))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_runner)
            p = await runner.prepare(req("x"))
            for _ in range(3):  # one active, two queued
                nursery.start_soon(consumer, p)
    assert len(crashes) == 1
    assert len(results) == 3
    for text, last in results:
        assert text == "" and isinstance(last, Failure)
        assert last.kind is ErrorKind.API_ERROR and last.retryable
    assert not runner.running
    with pytest.raises(RingserveError) as err:
        async with runner.submit(p):
            pass
    assert err.value.kind is ErrorKind.UNAVAILABLE


async def test_shutdown_fails_active_and_queued_generations_as_unavailable():
    engine = HookedEngine(n_slots=1, piece_bytes=1, reply="s" * 100)
    runner = Runner(engine, EngineConfig())
    results = []
    step = trio.Event()

    async def hook(call: DecodeCall) -> None:
        if call.index == 3:
            step.set()

    engine.hook = hook

    async def consumer(prepared):
        async with runner.submit(prepared) as gen:
            results.append(await collect_text(gen))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as inner:
                await inner.start(runner.run)
                p = await runner.prepare(req("x"))
                outer.start_soon(consumer, p)
                outer.start_soon(consumer, p)
                await step.wait()
                inner.cancel_scope.cancel()
    assert len(results) == 2
    for _, last in results:
        assert isinstance(last, Failure) and last.kind is ErrorKind.UNAVAILABLE and last.retryable


# -- statistics ----------------------------------------------------------------


async def test_statistics_is_a_frozen_snapshot_with_step_timing():
    engine = FakeEngine(piece_bytes=4)
    async with serving(engine) as runner:
        before = runner.statistics()
        _, _, _, gen = await generate(runner, req("hello"))
        await runner.wait_idle()
        after = runner.statistics()
    assert isinstance(after, RunnerStatistics)
    assert before.steps == 0 and before.running
    assert after.steps == gen.usage.output_tokens  # one step per token for a single short prompt
    assert after.slots_total == 4 and after.kv_cells_total == engine.n_ctx
    assert after.decode_seconds_total >= after.last_step_seconds >= 0
    assert after.last_step_tokens == 1
    assert after.step_tokens_total == gen.usage.input_tokens + gen.usage.output_tokens - 1
    with pytest.raises(AttributeError):
        after.steps = 0  # type: ignore[misc]


async def test_idle_runner_parks_without_polling(autojump_clock):
    engine = FakeEngine()
    runner = Runner(engine, EngineConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await trio.sleep(3600)  # an hour of virtual time: a polling loop would spin here
        await runner.wait_idle()
        assert runner._wake.statistics().tasks_waiting == 1
        assert runner.statistics().steps == 0 and engine.log == []
        p = await runner.prepare(req("echo:ok"))
        async with runner.submit(p) as gen:
            text, _ = await collect_text(gen)
        assert text == "ok"
        nursery.cancel_scope.cancel()


class StallingAfterDecode(FakeEngine):
    """FakeEngine whose ``release`` takes ``stall`` seconds: engine time outside decode calls."""

    stall = 0.0

    def release(self, slot, keep=0):
        time.sleep(self.stall)
        super().release(slot, keep)


async def test_engine_idle_counts_the_gaps_between_decode_calls_while_work_is_pending():
    """The time from one decode call's end to the next one's start counts while the loop has work
    (a release of 50 ms between two requests' steps counts), not while it has none (a pause of 0.5 s)."""
    engine = StallingAfterDecode(n_slots=2, step_seconds=0.005)
    async with serving(engine, slots=2) as runner:
        assert runner.statistics().engine_idle_seconds_total == 0
        await generate(runner, req("echo:one", 1))  # one decode call: no gap
        assert runner.statistics().engine_idle_seconds_total == 0
        await trio.sleep(0.5)  # idle: not counted
        engine.stall = 0.05
        prepared = [await runner.prepare(req("echo:two", 1)), await runner.prepare(req("echo:three three", 8))]
        async with runner.submit(prepared[0]) as first, runner.submit(prepared[1]) as second:
            [e async for e in first]  # ends after one step: its slot's release stalls the other's steps
            [e async for e in second]
        stats = runner.statistics()
    assert 0.05 <= stats.engine_idle_seconds_total < 0.5
    assert stats.decode_seconds_total >= 0.005 * stats.steps


async def test_no_step_feeds_a_generation_after_its_end_whether_its_text_decides_it_or_its_sample():
    """A plain reply's text is turned into events after the next step is handed to the engine
    (only its sample says whether it goes on); one with a stop string is read first. Neither is
    fed once it ended: decode calls feed each slot as many times as it sampled (EOG included)."""
    engine = FakeEngine(n_slots=3, piece_bytes=2, reply="alpha beta gamma delta", record=True, step_seconds=0.002)
    async with serving(engine, slots=3) as runner:
        results = {}

        async def one(name: str, request: GenerationRequest) -> None:
            results[name] = await generate(runner, request)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "stop", req("go", stop=["beta gamma"]))
            nursery.start_soon(one, "eog", req("go"))
            nursery.start_soon(one, "budget", req("go", 5))
    texts = {name: r[1] for name, r in results.items()}
    assert texts == {"stop": "alpha ", "eog": "alpha beta gamma delta", "budget": "alpha beta"}
    assert {name: r[2].stop_reason for name, r in results.items()} == {
        "stop": StopReason.STOP_SEQUENCE, "eog": StopReason.END, "budget": StopReason.MAX_TOKENS}
    fed: dict[int, int] = {}
    for call in engine.log:
        for feed in call.feeds:
            if feed.sample:
                fed[feed.slot] = fed.get(feed.slot, 0) + 1
    samples = sorted(r[3].usage.output_tokens for r in results.values())
    assert sorted(fed.values()) == samples


# -- one KV pool shared by the slots ------------------------------------------------------------


async def test_a_long_request_and_three_short_chats_share_the_pool_and_a_second_long_one_waits():
    """Issue 40's proof on the fake engine (the real models' prefill of 20,000 tokens is too slow for
    CI): in a 32,768-token pool a 20,000-token request and three short chats all run at once; a
    second long request, sent with them, waits until the first has ended, then completes. Read from
    the engine's log (a feed carries its request's bytes: ``L``, ``S``, lower-case chat text), not
    from timing."""
    engine = FakeEngine(n_slots=4, n_ctx=32768, n_batch=512, piece_bytes=1, step_seconds=0.002,
                        reply=lambda text: text[:8] * 4)
    async with serving(engine, guard=120) as runner:
        results: dict[str, tuple[str, object]] = {}

        async def run(name: str, prepared, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with runner.submit(prepared) as gen:  # enqueued on entering
                task_status.started()
                results[name] = await collect_text(gen)

        async with trio.open_nursery() as nursery:
            for name, text in [("long", "L" * 20_000), *((f"chat{i}", f"chat {i} hello") for i in range(3)),
                               ("second", "S" * 20_000)]:
                await nursery.start(run, name, await runner.prepare(req(text, 32)))
    assert {name: text for name, (text, _) in results.items()} == {
        "long": "L" * 32, "second": "S" * 32, **{f"chat{i}": f"chat {i} hello"[:8] * 4 for i in range(3)},
    }
    assert all(isinstance(terminal, Finish) for _, terminal in results.values())

    def holds(call, byte: str) -> bool:
        return any(ord(byte) in feed.tokens for feed in call.feeds)

    calls = [call for call in engine.log if call.error is None]
    assert not any(call.error for call in engine.log)  # the pool never overflowed
    assert any(holds(call, "L") and len(call.feeds) == 4 for call in calls)  # the long one and 3 chats at once
    last_long = max(i for i, call in enumerate(calls) if holds(call, "L"))
    first_second = min(i for i, call in enumerate(calls) if holds(call, "S"))
    assert first_second > last_long  # 20,032 beside the first's 20,032 did not fit: it waited
    assert runner.statistics().preemptions == 0


async def test_at_the_pool_s_edge_the_younger_request_pauses_and_both_replies_come_out_whole():
    """Two requests whose budgets do not both fit: the younger gives its cells up when the pool runs
    out, waits, refills and goes on; neither fails, and each text is its whole scripted reply."""
    def reply(text: str) -> str:
        return "".join(f"{text}{i:03d}," for i in range(200))

    engine = FakeEngine(n_slots=2, n_ctx=1000, n_batch=64, piece_bytes=1, reply=reply)
    async with serving(engine, guard=60) as runner:
        texts: dict[str, tuple[str, object]] = {}

        async def run(name: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
            prepared = await runner.prepare(req(name * 30, 700))
            async with runner.submit(prepared) as gen:
                task_status.started()
                texts[name] = await collect_text(gen)

        async with trio.open_nursery() as nursery:
            await nursery.start(run, "a")
            await wait_until(lambda: runner.statistics().generated_tokens_total > 0)
            nursery.start_soon(run, "b")
        stats = runner.statistics()
    for name in "ab":
        text, terminal = texts[name]
        assert isinstance(terminal, Finish) and terminal.stop_reason is StopReason.MAX_TOKENS
        assert text == reply(name * 30)[:700]
    assert stats.preemptions >= 1
    assert engine.kv_cells_used() <= 1000
    assert not any(call.error for call in engine.log)  # the pool never overflowed: no KVCacheFull
