"""Cancellation reaches the engine: a gone client frees its slot and KV cells (C1, C2), on the real model.

Also C8 over HTTP: concurrent streams share the model instead of queueing.
"""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import trio

from bench.common import default_runner
from ringserve.core.sse import SSEParser
from ringserve.engine.llama import LlamaLoader
from tests.support.helpers import anthropic_text, sse_events
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

pytestmark = pytest.mark.model

LONG = {"model": "m", "max_tokens": 4000, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}


@pytest.fixture
async def real_server(tmp_path):
    config = fake_config(tmp_path, engine={"slots": 2, "ctx_per_slot": 4608})
    async with running_server(config, engine_factory=LlamaLoader()) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            yield state, client


async def test_stream_client_gone_frees_slot_within_one_step(real_server):
    """C1: max_tokens 4000, close the socket after 3 events."""
    state, client = real_server
    runner = default_runner(state.hub)
    events = 0
    async with client.stream("POST", "/v1/messages", json={**LONG, "stream": True}) as resp:
        message_id = resp.headers["x-message-id"]
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                events += 1
                if events == 3:
                    break
        assert runner.statistics().slots_busy == 1
        closed = trio.current_time()
    # leaving the block closed the connection
    await wait_until(lambda: runner.statistics().slots_busy == 0)
    freed = trio.current_time()
    stats = runner.statistics()
    assert stats.cancels == 1
    assert stats.tokens_after_cancel_total <= 1  # within one step: at most the decode already in flight
    assert stats.kv_cells_used == 0
    # the cancel-to-free time is measured, from the cancel (after the close) to the free (before we saw it)
    assert stats.last_cancel_to_free_seconds is not None and 0 <= stats.last_cancel_to_free_seconds <= freed - closed
    decoded = stats.generated_tokens_total
    assert decoded < 100  # nowhere near max_tokens
    steps = stats.steps
    await runner.wait_idle()  # the loop ran out of work: no decode happened for the gone stream
    assert runner.statistics().steps == steps
    assert runner.statistics().generated_tokens_total == decoded
    msg = (await client.get(f"/v1/messages/{message_id}")).json()
    assert msg["status"] == "cancelled"
    assert msg["usage"]["output_tokens"] == decoded  # billed for what was really generated


async def test_non_stream_client_gone_frees_slot(real_server):
    """C2: stream false, max_tokens 4000, the client is killed once its tokens are being decoded."""
    state, client = real_server
    runner = default_runner(state.hub)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, "/v1/chat/completions", json=LONG))
        await wait_until(lambda: runner.statistics().generated_tokens_total > 0)
        nursery.cancel_scope.cancel()  # the client is gone
    await wait_until(lambda: runner.statistics().cancels == 1 and runner.statistics().slots_busy == 0)
    stats = runner.statistics()
    assert stats.kv_cells_used == 0
    assert stats.tokens_after_cancel_total <= 1
    decoded = stats.generated_tokens_total
    assert 0 < decoded < 1000
    await runner.wait_idle()  # the loop ran out of work: nothing more was decoded for it
    assert runner.statistics().generated_tokens_total == decoded


async def test_four_concurrent_streams_all_start_before_any_finishes(tmp_path):
    """C8 over HTTP: 4 streams on 4 slots; every first token arrives before any stream ends."""
    config = fake_config(tmp_path, engine={"slots": 4, "ctx_per_slot": 512})
    async with running_server(config, engine_factory=LlamaLoader()) as state:
        first: dict[int, float] = {}
        done: dict[int, float] = {}
        texts: dict[int, str] = {}

        async def one(i: int, client: httpx.AsyncClient) -> None:
            body = {"model": "m", "max_tokens": 24, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}]}
            parser, events = SSEParser(), []
            async with client.stream("POST", "/v1/messages", json=body) as resp:
                async for chunk in resp.aiter_raw():
                    events += parser.feed(chunk)
                    if i not in first and any(e.event == "content_block_delta" for e in events):
                        first[i] = trio.current_time()
            done[i] = trio.current_time()
            assert events[-1].event == "message_stop"
            texts[i] = anthropic_text(events)

        async with httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client:
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i, client)
            assert len(first) == 4
            assert max(first.values()) < min(done.values())
            # greedy output alone equals output under concurrency
            body = {"model": "m", "max_tokens": 24, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": "Count from 2 to 22."}]}
            _, events, _ = await sse_events(client, "POST", "/v1/messages", json=body)
        assert anthropic_text(events) == texts[2]
