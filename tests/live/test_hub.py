"""The hub without HTTP: a fake-engine runner, a memory log store, a ``:memory:`` store, and Trio's
autojump clock (waits and grace periods take no real time; the engine thread decodes in real time).

Create, stream, cancel, the abort policy with its grace, resume and rebuild, idempotent retries,
and the store's failure back-off.
"""

from __future__ import annotations

import gc
import json
import sqlite3
import threading
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from bench.common import default_runner
from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.sse import SSEParser
from ringserve.core.status import CancelReason, MessageStatus, Policy
from ringserve.engine.catalog import discover
from ringserve.engine.fake import FakeEngine
from ringserve.engine.loader import FactoryLoader
from ringserve.live.hub import Hub
from ringserve.live.message import Created, LiveMessage
from ringserve.live.models import ModelPool
from ringserve.live.resume import StreamEnded
from ringserve.logs.cluster import LocalCluster
from ringserve.logs.memory import MemoryLogStore
from ringserve.store.sqlite import MessageStore
from ringserve.surfaces.registry import ANTHROPIC
from ringserve.surfaces.responses import RESPONSES
from tests.support.helpers import anthropic_text
from tests.support.wait import wait_until

GUARD = 60  # seconds of real time: a guard against hangs, not a wait
LONG = "echo:" + " ".join(f"w{i}" for i in range(400))

# A fake engine paced by step_seconds sleeps in the engine thread, which the autojump clock sees as
# Trio being idle: it would jump to the next timer at every step (a keepalive entry per step, a grace
# gone in one step, a wait_until's deadline passed). The tests that pace it run on the real clock.
# An unpaced engine's steps are short, not instant: on a loaded host the clock jumps during them too,
# so a test that reads a long message's whole log runs on the real clock as well.


class GatedPrefill(FakeEngine):
    """A fake engine whose every prefill waits (on the engine thread) until :attr:`opened` is set,
    by a Trio task after a wait on the autojump clock: a silent phase as long as the test says."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opened = threading.Event()

    def decode(self, feeds):
        if any(feed.pos == 0 for feed in feeds):
            self.opened.wait()
        return super().decode(feeds)


@asynccontextmanager
async def running_hub(config: Config = Config(), engine: Callable[..., FakeEngine] = FakeEngine,
                      **fake: Any) -> AsyncIterator[Hub]:
    """A hub over a :class:`FakeEngine` (made by ``engine``; ``fake``: its arguments), a memory
    log store and a ``:memory:`` message store; everything is cancelled at the end."""
    made = engine(n_slots=config.engine.slots, **fake)
    store = MessageStore(":memory:")
    try:
        async with trio.open_nursery() as nursery:
            pool = ModelPool(discover(config), FactoryLoader(lambda _settings: made), nursery, max_loaded=1)
            await pool.load("")
            logs = MemoryLogStore(config.stream)
            await nursery.start(logs.run)
            yield Hub(config, pool, logs, LocalCluster(), store, nursery, safety=None)
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def request(text: str, **fields: Any) -> Any:
    return ANTHROPIC.parse_request({"model": "fake", "max_tokens": 4000, "stream": True,
                                    "messages": [{"role": "user", "content": text}], **fields})


async def create(hub: Hub, text: str = "echo:hello world", *, policy: Policy = Policy.CONTINUE,
                 key: str | None = None, body_hash: str = "h") -> Created:
    return await hub.create(ANTHROPIC, request(text), body_hash=body_hash, request_json="{}", policy=policy,
                            idempotency_key=key)


def live(created: Created) -> LiveMessage:
    assert created.live is not None
    return created.live


async def read_to_end(msg: LiveMessage) -> list[Any]:
    """Every event of ``msg``'s log, read as a reader to its end."""
    with msg.open_log.reader():
        await msg.done.wait()
    entries = msg.open_log.read_from(None)
    assert isinstance(entries, list)
    return [event for entry in entries for event in SSEParser().feed(entry.data)]


async def test_a_message_is_generated_into_its_log_and_the_store_answers_once_it_ended(autojump_clock):
    async with running_hub() as hub:
        created = await create(hub)
        msg = live(created)
        assert created.view.live and hub.live(msg.id) is msg and created.view.status is MessageStatus.QUEUED
        events = await read_to_end(msg)
        assert anthropic_text(events) == "hello world" and events[-1].event == "message_stop"
        assert [int(e.id.rsplit(":", 1)[1]) for e in events] == list(range(len(events)))
        assert hub.live(msg.id) is None  # ended and written: the store answers for it
        view = hub.lookup(msg.id)
        assert (view.status, view.text, view.live) == (MessageStatus.COMPLETE, "hello world", False)
        assert hub.store.get(msg.id).final_seq == len(events) - 1
        assert hub.statistics().active_generations == 0


class StallingEngine(FakeEngine):
    """A FakeEngine whose third decode call waits (on its thread) until ``go`` is set."""

    go = threading.Event()

    def decode(self, feeds):  # type: ignore[no-untyped-def]
        if len(self.log) == 2:
            self.go.wait(GUARD)
        return super().decode(feeds)


async def test_text_waiting_for_its_window_is_released_by_the_producer_s_timer_when_no_step_comes(autojump_clock):
    """The producer is ticked after each step; when the next step does not come (a long decode),
    the message's task ticks it itself, half a window past the deadline (a window of 10 minutes
    here, so that no jump of the clock between steps releases the text early)."""
    config = Config().replace("stream", flush_ms=600_000.0, flush_tokens=1000)
    StallingEngine.go.clear()
    async with running_hub(config, StallingEngine, record=True) as hub:
        msg = live(await create(hub, "echo:hello world"))
        await wait_until(lambda: msg.view().text == "hell", timeout=3600)  # the first text goes at once
        await wait_until(lambda: len(default_runner(hub)._engine.log) == 2, timeout=3600)  # type: ignore[attr-defined]
        start = trio.current_time()
        await wait_until(lambda: msg.view().text == "hello wo", timeout=3600, interval=1.0)  # while decode 3 waits
        assert trio.current_time() - start >= 600
        StallingEngine.go.set()
        assert anthropic_text(await read_to_end(msg)) == "hello world"


async def test_cancel_ends_every_reader_with_a_terminal_event_and_frees_the_slot():
    async with running_hub(step_seconds=0.001) as hub:
        msg = live(await create(hub, LONG))
        reading = []

        async def reader() -> None:
            reading.append(await read_to_end(msg))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await wait_until(lambda: msg.view().text)
            ended = await hub.ended(msg.view())
        assert ended.status is MessageStatus.CANCELLED and 0 < ended.usage.output_tokens < 400
        assert reading[0][-1].event == "message_stop"
        assert json.loads(reading[0][-2].data)["delta"]["ringserve_cancelled"] is True
        await default_runner(hub).wait_idle()
        stats = default_runner(hub).statistics()
        assert (stats.slots_busy, stats.kv_cells_used, stats.cancels) == (0, 0, 1)
        steps = stats.steps
        await trio.sleep(0.2)  # 200 steps' time: no decode step for the cancelled message
        assert default_runner(hub).statistics().steps == steps
        assert hub.store.get(msg.id).status is MessageStatus.CANCELLED


async def test_abort_policy_cancels_after_the_grace_unless_a_reader_comes_back():
    """Ported from the HTTP test of the same policy: the generation survives a reader that comes
    back within the grace, and is cancelled no earlier than the grace after its last reader left."""
    grace = 0.3  # the real clock: the decode (0.01 s a step, 4 s in all) sleeps in the engine thread
    async with running_hub(Config().replace("policy", grace_seconds=grace), step_seconds=0.01) as hub:
        msg = live(await create(hub, LONG, policy=Policy.ABORT))
        with msg.open_log.reader():
            await wait_until(lambda: msg.view().text)
        t0 = trio.current_time()  # the last reader left: the grace starts
        await trio.sleep(grace / 2)
        with msg.open_log.reader():  # a reader comes back within the grace
            await trio.sleep(grace * 2)
            assert not msg.done.is_set()
        t1 = trio.current_time()
        await msg.done.wait()
        assert trio.current_time() - t1 >= grace and t1 - t0 > grace  # the first grace did not end it
        assert (msg.cancel_reason, msg.status) == (CancelReason.CLIENT_GONE, MessageStatus.CANCELLED)
        assert hub.lookup(msg.id).usage.output_tokens > 0
        await default_runner(hub).wait_idle()
        assert default_runner(hub).statistics().kv_cells_used == 0


async def test_continue_policy_finishes_with_no_reader(autojump_clock):
    async with running_hub(Config().replace("policy", grace_seconds=0.0)) as hub:
        msg = live(await create(hub, LONG, policy=Policy.CONTINUE))
        with msg.open_log.reader():
            pass  # the only reader leaves at once
        await msg.done.wait()
        assert hub.lookup(msg.id).status is MessageStatus.COMPLETE
        assert hub.lookup(msg.id).text == LONG.removeprefix("echo:")


async def test_resume_after_an_event_after_the_end_and_after_the_log_expired():
    async with running_hub() as hub:
        msg = live(await create(hub, LONG))
        events = await read_to_end(msg)
        log, after = await hub.resume.open_log(msg.id, f"{msg.id}:2")
        assert after == 2 and log is msg.open_log
        with pytest.raises(StreamEnded):
            await hub.resume.open_log(msg.id, events[-1].id)
        for bad, kind in (("garbage", ErrorKind.INVALID_REQUEST), (f"{msg.id}:99999", ErrorKind.INVALID_REQUEST)):
            with pytest.raises(RingserveError) as info:
                await hub.resume.open_log(msg.id, bad)
            assert info.value.kind is kind
        with pytest.raises(RingserveError) as info:
            await hub.resume.open_log("msg_unknown", None)
        assert info.value.kind is ErrorKind.NOT_FOUND
        # the log is gone: rebuilt from the store, the same bytes, and its end is still the end
        hub.logs.forget(msg.id)
        rebuilt, after = await hub.resume.open_log(msg.id, None)
        assert rebuilt is not msg.open_log and after is None
        assert rebuilt.read_from(None) == msg.open_log.read_from(None)
        with pytest.raises(StreamEnded):
            await hub.resume.open_log(msg.id, events[-1].id)


async def test_an_idempotent_retry_finds_its_message_live_or_stored_and_regenerates_a_failed_one():
    async with running_hub(step_seconds=0.001) as hub:
        first = await create(hub, LONG, key="k")
        again = await create(hub, LONG, key="k")
        assert again.view.id == first.view.id and again.live is first.live  # live: the same handle
        with pytest.raises(RingserveError) as info:
            await create(hub, LONG, key="k", body_hash="another body")
        assert info.value.kind is ErrorKind.UNPROCESSABLE
        await read_to_end(live(first))
        stored = await create(hub, LONG, key="k")
        assert (stored.view.id, stored.live, stored.view.status) == (first.view.id, None, MessageStatus.COMPLETE)
        assert default_runner(hub).statistics().prompt_tokens_total == first.view.usage.input_tokens  # one generation
        hub.store.update(first.view.id, status=MessageStatus.FAILED)  # as if it had failed
        retried = await create(hub, LONG, key="k")
        assert retried.view.id != first.view.id and retried.live is not None
        await read_to_end(retried.live)
        assert hub.store.by_idempotency_key("anthropic:k").id == retried.view.id  # the key moved
        assert hub.keys.pending == {}


async def test_a_store_that_fails_leaves_the_message_in_memory_until_it_is_written():
    # (the real clock: the retry writes on a worker thread, during which the autojump clock jumps)
    async with running_hub() as hub:
        update_all = hub.store.update_all

        def failing(updates: object) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        hub.store.update_all = failing  # type: ignore[method-assign]
        msg = live(await create(hub))
        await read_to_end(msg)
        assert msg.unsaved and hub.live(msg.id) is msg and hub.statistics().unsaved_messages == 1
        assert hub.lookup(msg.id).status is MessageStatus.COMPLETE  # answered from memory
        with pytest.raises(RingserveError) as info:  # no new row is tried while the writes fail
            await create(hub)
        assert info.value.kind is ErrorKind.UNAVAILABLE and info.value.retry_after is not None
        hub.store.update_all = update_all  # type: ignore[method-assign]
        await wait_until(lambda: hub.live(msg.id) is None)  # the next retry (STORE_RETRY_SECONDS) writes it
        assert hub.live(msg.id) is None and hub.statistics().unsaved_messages == 0
        assert hub.store.get(msg.id).status is MessageStatus.COMPLETE


async def test_a_drain_refuses_new_messages_and_interrupts_the_running_ones():
    async with running_hub(step_seconds=0.001) as hub:
        msg = live(await create(hub, LONG))
        hub.drain()
        with pytest.raises(RingserveError) as info:
            await create(hub)
        assert info.value.kind is ErrorKind.UNAVAILABLE
        hub.cancel_all(CancelReason.DRAIN)
        await hub.wait_all_done()
        view = hub.lookup(msg.id)
        assert view.status is MessageStatus.INTERRUPTED and view.error is not None
        assert attrs.asdict(hub.statistics()) == {"active_generations": 0, "unsaved_messages": 0}


@pytest.mark.parametrize("surface", ["anthropic", "responses"])
async def test_a_400_s_silent_prefill_is_broken_every_heartbeat_interval_by_a_keepalive_event(autojump_clock, surface):
    """Issue 36 item 7, in-process: the prompt's prefill takes 400 s. The opening event is in the
    log at once (before the prefill), then a keepalive data event every ``heartbeat_interval``
    (15 s) of silence, which the agents' idle timers count (Codex: 300 s of no data event;
    Claude Code: 300 s of no byte): never 15 s without an entry. Each is an event of the
    official SDK's types, and a rebuild from the store renders them again, byte for byte."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    engine = GatedPrefill()
    async with running_hub(engine=lambda **_: engine) as hub:
        target = ANTHROPIC if surface == "anthropic" else RESPONSES
        parsed = (request("echo:hello world") if surface == "anthropic"
                  else RESPONSES.parse_request({"model": "fake", "input": "echo:hello world", "stream": True}))
        msg = live(await hub.create(target, parsed, body_hash="h", request_json="{}", policy=Policy.CONTINUE))
        t0 = trio.current_time()  # (the clock jumps while the prompt is tokenized on a thread)
        arrivals: list[tuple[float, Any]] = []

        async def read() -> None:
            after = None
            with msg.open_log.reader():
                while not (msg.open_log.closed and after == msg.open_log.next_seq - 1):
                    await msg.open_log.wait_for_entries(after)
                    for entry in msg.open_log.read_from(after):
                        arrivals.extend((trio.current_time() - t0, e) for e in SSEParser().feed(entry.data))
                        after = entry.seq

        async def open_after_400_s() -> None:
            await trio.sleep(400)
            engine.opened.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(open_after_400_s)
        times, events = [t for t, _ in arrivals], [e for _, e in arrivals]
        keepalive = "ping" if surface == "anthropic" else "response.in_progress"
        silent = [e.event for t, e in arrivals if 0 < t < 400]
        assert times[0] == 0 and events[0].event in ("message_start", "response.created")
        assert silent == [keepalive] * 26  # at 15, 30, ... 390 s
        assert max(b - a for a, b in zip(times, times[1:])) <= 15
        if surface == "responses":
            adapter = TypeAdapter(ResponseStreamEvent)
            for e in events:
                adapter.validate_python(json.loads(e.data), strict=True)
        else:
            assert anthropic_text(events) == "hello world"
        hub.logs.forget(msg.id)
        rebuilt, _ = await hub.resume.open_log(msg.id, None)
        assert [e for entry in rebuilt.read_from(None) for e in SSEParser().feed(entry.data)] == events


async def test_session_turns_hold_at_most_their_limit_and_drop_turns_whose_log_is_gone(autojump_clock):
    """The implicit keys of session requests are bounded: past the limit the oldest goes, and an
    oldest one whose log expired (or a message that failed) goes at the next add."""
    async with running_hub() as hub:
        hub.sessions.limit = 2
        made = []
        for i in range(3):
            made.append(live(await hub.create(ANTHROPIC, request(f"echo:{i}"), body_hash=f"h{i}", request_json="{}",
                                              policy=Policy.CONTINUE, turn=f"s:h{i}")))
            await made[-1].done.wait()
        assert len(hub.sessions) == 2
        again = await hub.create(ANTHROPIC, request("echo:2"), body_hash="h2", request_json="{}",
                                 policy=Policy.CONTINUE, turn="s:h2")
        assert again.live is made[2]  # ended whole, its log held: the same message
        hub.logs.forget(made[1].id)
        hub.logs.forget(made[2].id)
        fresh = live(await hub.create(ANTHROPIC, request("echo:3"), body_hash="h3", request_json="{}",
                                      policy=Policy.CONTINUE, turn="s:h3"))
        assert len(hub.sessions) == 1 and await hub.sessions.find("anthropic:s:h3") is fresh


async def test_ended_messages_live_no_longer_than_their_requests_and_session_turns():
    """An ended message (its text, its renderer) is not kept alive by its log, which the log store
    holds for its TTL (counting only its entries against the memory cap): once written and read,
    one without a session is freed (refcounts alone, no garbage collection). A session turn keeps
    its message while a retry may attach to it, and lets it go at the next add once its log left
    the log store (its TTL, the memory cap)."""
    gc.disable()
    try:
        async with running_hub() as hub:
            plain = live(await create(hub, "echo:no session"))
            await read_to_end(plain)
            plain_ref, plain_id = weakref.ref(plain), plain.id
            refs = []
            for i in range(20):
                msg = live(await hub.create(ANTHROPIC, request(f"echo:{i}"), body_hash=f"h{i}", request_json="{}",
                                            policy=Policy.CONTINUE, turn=f"s:h{i}"))
                await read_to_end(msg)
                refs.append(weakref.ref(msg))
                hub.logs.forget(msg.id)  # as the TTL sweep or the memory cap drops it
                del msg
            del plain
            await trio.lowlevel.checkpoint()
            assert plain_ref() is None and hub.logs.get(plain_id) is not None  # its log lives on
            assert refs[-1]() is not None  # (the last key waits for the next add)
            live(await hub.create(ANTHROPIC, request("echo:new"), body_hash="new", request_json="{}",
                                  policy=Policy.CONTINUE, turn="s:new"))
            assert len(hub.sessions) == 1 and [ref() for ref in refs] == [None] * 20
    finally:
        gc.enable()


async def test_a_large_reply_is_held_a_bounded_number_of_times_and_only_by_its_log_once_read():
    """A 2 MB reply (the fake engine, 4 KiB tokens), traced by tracemalloc: at its peak the process
    holds its text a bounded number of times (the producer's text, the log's entries, a snapshot's
    join and the one being encoded); once it ended and its reader left, only its log's entries,
    which ``[stream] memory_cap_bytes`` counts; once the log is gone, nothing."""
    text = "0123456789abcdef" * (2_000_000 // 16)
    async with running_hub(piece_bytes=4096, reply=text, record=False) as hub:
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            msg = live(await create(hub, "hi"))
            with msg.open_log.reader():
                await msg.done.wait()
            message_id, log_bytes = msg.id, hub.logs.statistics().bytes
            del msg
            await trio.lowlevel.checkpoint()
            held, peak = (size - base for size in tracemalloc.get_traced_memory())
            hub.logs.forget(message_id)
            left = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    assert log_bytes >= len(text)
    assert peak < 4 * len(text), peak / len(text)
    assert held < log_bytes + len(text) / 10, (held / len(text), log_bytes / len(text))
    assert left < len(text) / 10, left / len(text)
