"""Issue 19: whether decode step N+1 starts while step N's events are still being handled.

The decision (``[engine] overlap``, ``[model] n_threads``) is a function of
plain values; the runner's behaviour is checked on the FakeEngine with a
consumer that keeps the Trio thread busy for a while after each event.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import httpx
import pytest
import trio
import trio.testing

from ringserve.config import Config, EngineConfig, decode_threads, overlap_steps
from ringserve.core.events import ChatMessage, GenerationRequest, SamplingParams
from ringserve.core.offload import Offload
from ringserve.engine.fake import DEFAULT_REPLY, FakeEngine
from ringserve.engine.runner import Runner
from tests.support.server import fake_config, running_server
from tests.support.helpers import OPENAI_BODY, openai_text, sse_events
from bench.common import default_runner

GUARD = 20  # seconds: a guard against hangs, not a wait


@pytest.mark.parametrize(
    ("n_threads", "cores", "threads"),
    [(0, 2, 1), (0, 1, 1), (0, 16, 15), (2, 2, 2), (4, 2, 4), (1, 16, 1)],
)
def test_decode_threads_zero_leaves_one_core(n_threads, cores, threads):
    assert decode_threads(n_threads, cores) == threads


@pytest.mark.parametrize(
    ("setting", "threads", "cores", "gpu", "overlap"),
    [
        ("auto", 2, 2, False, False),  # llama.cpp takes every core: let the consumers finish first
        ("auto", 3, 2, False, False),
        ("auto", 1, 2, False, True),  # a core left for the Trio thread
        ("auto", 15, 16, False, True),
        ("auto", 2, 2, True, True),  # a GPU decodes: the CPU is free
        ("on", 2, 2, False, True),
        ("off", 1, 16, True, False),
    ],
)
def test_overlap_steps(setting, threads, cores, gpu, overlap):
    assert overlap_steps(setting, threads=threads, cores=cores, gpu=gpu) is overlap


def test_overlap_setting_is_checked_and_defaults_to_auto():
    assert EngineConfig().overlap == "auto"
    with pytest.raises(ValueError, match="overlap must be one of 'auto', 'on', 'off', got 'yes'"):
        EngineConfig(overlap="yes")
    with pytest.raises(ValueError, match=r"\[engine\] overlap must be a string"):
        Config.from_dict({"engine": {"overlap": True}})


class FlaggedEngine(FakeEngine):
    """FakeEngine whose ``decoding`` is True while a decode call runs (set on the worker thread)."""

    decoding = False

    def decode(self, feeds):
        self.decoding = True
        try:
            return super().decode(feeds)
        finally:
            self.decoding = False


def request(max_tokens: int) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", "hello"),), max_tokens, SamplingParams(temperature=0))


async def busy_consumer(runner: Runner, engine: FlaggedEngine, work: float) -> list[bool]:
    """Generate; after each event keep the Trio thread busy (runnable) for ``work`` seconds,
    then note whether a decode was in flight."""
    seen = []
    prepared = await runner.prepare(request(6))
    async with runner.submit(prepared) as gen:
        async for _event in gen:
            end = time.perf_counter() + work
            while time.perf_counter() < end:
                await trio.lowlevel.checkpoint()
            seen.append(engine.decoding)
    return seen


@pytest.mark.parametrize("overlap", [False, True])
async def test_without_overlap_no_decode_runs_while_a_consumer_works(overlap):
    engine = FlaggedEngine(n_slots=2, step_seconds=0.05)
    runner = Runner(engine, EngineConfig(slots=2), overlap=overlap)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            seen = await busy_consumer(runner, engine, work=0.005)
        nursery.cancel_scope.cancel()
    assert len(seen) >= 6
    if overlap:
        assert any(seen)  # the next step decoded while the consumer still worked
    else:
        assert not any(seen)


@pytest.mark.parametrize("overlap", [False, True])
async def test_between_steps_waits_for_the_step_in_flight_only_without_overlap(overlap):
    engine = FlaggedEngine(n_slots=1, step_seconds=0.2)
    runner = Runner(engine, EngineConfig(slots=1), overlap=overlap)
    returned_during_decode: list[bool] = []

    async def waiter():
        while not engine.decoding:
            await trio.lowlevel.checkpoint()
        await runner.between_steps()
        returned_during_decode.append(engine.decoding)

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as inner:
                inner.start_soon(waiter)
                prepared = await runner.prepare(request(2))
                async with runner.submit(prepared) as gen:
                    async for _ in gen:
                        pass
        nursery.cancel_scope.cancel()
    assert returned_during_decode == [overlap]


async def test_requests_arriving_together_are_prefilled_in_one_batch():
    """The first enqueued request wakes the loop while the others are still being tokenized
    (one at a time, 10 ms each here); the first decode call prefills all of them."""
    engine = FakeEngine(n_slots=8, tokenize_hook=lambda: time.sleep(0.01))
    runner = Runner(engine, EngineConfig(slots=8))

    async def one(i: int) -> None:
        prepared = await runner.prepare(request(4))
        async with runner.submit(prepared) as gen:
            async for _ in gen:
                pass

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:
                for i in range(8):
                    clients.start_soon(one, i)
        nursery.cancel_scope.cancel()
    first = engine.log[0]
    assert sorted(f.slot for f in first.feeds) == list(range(8))
    assert all(f.pos == 0 and f.sample for f in first.feeds)


async def test_the_ready_line_says_the_decode_threads_and_the_mode(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ringserve")
    async with running_server(fake_config(tmp_path, model={"n_threads": 3}, engine={"overlap": "off"})):
        pass
    assert (f"decode threads 3 of {os.cpu_count()} cores, overlapped steps off, GPU offload none (no GPU device),"
            " at http://127.0.0.1:") in caplog.text
    assert "ready: model fake, chat format generic, " in caplog.text


async def test_the_ready_line_names_the_chat_format(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ringserve")
    async with running_server(fake_config(tmp_path), chat_format="qwen3-coder"):
        pass
    assert "ready: model fake, chat format qwen3-coder, " in caplog.text


class _GpuFake(FakeEngine):
    offload = Offload(31, 31, ("CUDA0 (NVIDIA H200)",))


READY = re.compile(r"overlapped steps (on|off), GPU offload (.+), at http://")


@pytest.mark.parametrize(
    ("engine", "overlap", "words"),
    [(_GpuFake, "on", "31 of 31 layers on CUDA0 (NVIDIA H200)"), (FakeEngine, "off", "none (no GPU device)")],
)
async def test_ready_line_gives_the_offload_and_layers_on_a_gpu_overlap_steps(tmp_path, caplog, engine, overlap, words):
    """With the decode threads on every core, ``[engine] overlap = "auto"`` overlaps steps only when
    layers run on a GPU: the engine's offload decides, not the ``n_gpu_layers`` setting (whose default,
    every layer, offloads none on a CPU build)."""
    cores = os.cpu_count() or 1
    config = fake_config(tmp_path, model={"n_threads": cores})
    caplog.set_level(logging.INFO, logger="ringserve")
    async with running_server(config, lambda _c: engine(n_slots=config.engine.slots)):
        pass
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert len(ready) == 1
    match = READY.search(ready[0])
    assert match is not None, ready[0]
    assert match.groups() == (overlap, words)


@pytest.mark.parametrize("overlap", ["off", "on"])
async def test_a_server_streams_the_whole_reply_in_either_mode(tmp_path, overlap):
    """Over HTTP, with flush deadlines that pass during every decode (5 ms against 20 ms steps)."""
    config = fake_config(tmp_path, engine={"overlap": overlap}, stream={"flush_ms": 5.0})
    async with running_server(config, step_seconds=0.02) as state:
        assert default_runner(state.hub).overlap is (overlap == "on")
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
            body = {**OPENAI_BODY, "stream": True}
            resp, events, _ = await sse_events(client, "POST", "/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert openai_text(events) == DEFAULT_REPLY
    assert len([e for e in events if '"content"' in e.data]) > 2  # flushed in several entries


@pytest.mark.parametrize("overlap", ["off", "on"])
async def test_text_goes_out_as_its_step_ends_when_steps_are_longer_than_the_flush_window(tmp_path, overlap):
    """Decode steps of 200 ms against the default 25 ms window (a CPU box): each step's text is
    written as soon as the step ends. Without overlap it was held for a deadline that fell inside
    the next step, and waited for that step's end: every token after the first one step late
    (400 ms from the first to the second)."""
    step = 0.2
    config = fake_config(tmp_path, engine={"overlap": overlap})
    assert config.stream.flush_ms == 25.0
    async with running_server(config, step_seconds=step) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
            body = {**OPENAI_BODY, "stream": True, "max_tokens": 4}
            arrivals = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                        arrivals.append(trio.current_time())
    assert len(arrivals) == 4
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert all(g < 1.5 * step for g in gaps), gaps



class CountingEngine(FakeEngine):
    """FakeEngine that counts the decode calls begun (on the worker thread) and lets a test wait for one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.begun = 0
        self.changed = threading.Condition()

    def decode(self, feeds):
        with self.changed:
            self.begun += 1
            self.changed.notify_all()
        return super().decode(feeds)

    def wait_begun(self, n: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.begun >= n, timeout)


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_consumer_gets_each_step_in_one_call_while_the_next_decodes_only_with_overlap(overlap):
    """Every step that sampled for the generation is one call (one delta per token here, the terminal
    event with the last one). With overlap the next decode was handed to the engine before the call
    (the call waits for it to begin, which blocks the Trio thread); without, only after it."""
    engine = CountingEngine(n_slots=1, step_seconds=0.01)
    runner = Runner(engine, EngineConfig(slots=1), overlap=overlap)
    calls: list[list[str]] = []
    next_began: list[bool] = []
    ended = trio.Event()

    def consumer(events):
        kinds = [type(e).__name__ for e in events]
        calls.append(kinds)
        if "Finish" in kinds:
            ended.set()
        else:  # the call for the step that sampled token n: has decode call n + 1 begun?
            next_began.append(engine.wait_begun(len(calls) + 1, 0.5 if overlap else 0.1))

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            prepared = await runner.prepare(request(4))
            async with runner.submit(prepared) as gen:
                gen.consume(consumer)
                await ended.wait()
        nursery.cancel_scope.cancel()
    assert calls == [["BlockStart", "BlockDelta"], ["BlockDelta"], ["BlockDelta"], ["BlockDelta", "BlockStop", "Finish"]]
    assert next_began == [overlap] * 3


@pytest.mark.parametrize("overlap", [False, True])
async def test_the_loop_lag_is_the_time_the_engine_waited_for_the_loop_after_a_decode(overlap):
    """A consumer that holds the Trio thread for 60 ms per step against 10 ms decode steps: with
    overlap its work runs while the next step decodes, and the runner takes that step's result only
    once it returns, about 50 ms late (issue 42: what widens the coalescing window); without overlap
    the consumer runs between the steps, after the runner took the result."""
    engine = FakeEngine(n_slots=1, step_seconds=0.01)
    runner = Runner(engine, EngineConfig(slots=1), overlap=overlap)
    ended = trio.Event()
    lags: list[float] = []

    def consumer(events):
        lags.append(runner.loop_lag)
        time.sleep(0.06)
        if any(type(e).__name__ == "Finish" for e in events):
            ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            prepared = await runner.prepare(request(4))
            async with runner.submit(prepared) as gen:
                gen.consume(consumer)
                await ended.wait()
        nursery.cancel_scope.cancel()
    total = runner.statistics().loop_lag_seconds_total
    assert len(lags) == 4 and all(lag >= 0 for lag in lags)
    if overlap:  # steps 2, 3 and 4 each decoded beside the last step's consumer
        assert min(lags[1:]) >= 0.04
        assert total >= 3 * 0.04
    else:
        assert total >= sum(lags)


async def test_while_the_loop_lags_a_stream_gets_fewer_larger_entries(tmp_path, monkeypatch):
    """A runner that reports a lag over 5 % of every 10 ms step: each stream's coalescing window
    widens (``[stream] flush_max_ms``, 1 s here), and the token count that releases an entry
    (``flush_tokens``, the default 16) with it, so an entry carries many tokens. With the default
    25 ms window an entry holds the tokens of the steps within about one window (10 ms each at
    least): a few."""
    tokens = {}
    monkeypatch.setattr(Runner, "loop_busy", property(lambda self: 0.0))
    for lagging in (False, True):  # the lag the runner reports, not this loaded machine's
        monkeypatch.setattr(Runner, "loop_lag", property(lambda self, lag=0.01 if lagging else 0.0: lag))
        (tmp_path / str(lagging)).mkdir()
        config = fake_config(tmp_path / str(lagging), engine={"overlap": "on"},
                             stream={"flush_max_ms": 1000.0})
        async with running_server(config, step_seconds=0.01, piece_bytes=1, reply="x" * 200) as state:
            async with httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
                body = {**OPENAI_BODY, "stream": True, "max_tokens": 120}
                _, events, _ = await sse_events(client, "POST", "/v1/chat/completions", json=body)
        tokens[lagging] = [len(openai_text([e])) for e in events if '"content":"' in e.data]
        assert sum(tokens[lagging]) == 120
    assert max(tokens[False]) <= 8
    assert max(tokens[True]) >= 24
