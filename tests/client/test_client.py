"""ringserve.client against an in-process server (fake engine), on every surface.

The drop tests put :class:`tests.support.proxy.DroppingProxy` between the client and
the server: it cuts connections at random byte offsets (FIN or RST, before
the request or mid-event), goes silent, or cuts on demand. Every resumed
stream must end with exactly the text of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import random
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ringserve.client import (
    APIError,
    AsyncClient,
    Backoff,
    Client,
    ConnectionLost,
    FinalMessage,
    NoServer,
    Reconnect,
    RequestTimeout,
    StreamError,
    message_path,
)
from ringserve.core.toolcalls import format_call
from tests.support.helpers import ANTHROPIC_BODY
from tests.support.proxy import REPLY, Cut, forget_last_event_id, random_cuts, server_and_proxy

FAST = Backoff(base=0.002, cap=0.02)
SURFACES = ("anthropic", "openai", "responses")


# -- drops at random points: the text equals an uninterrupted run ----------------------------------


async def test_async_client_survives_random_drops_on_every_surface(tmp_path: Path) -> None:
    rng = random.Random(20240607)
    # step_seconds: the generation is still running during most resumes (live tail, not only replay).
    async with server_and_proxy(tmp_path, random_cuts(rng, p_cut=0.9), step_seconds=0.001) as (state, proxy):
        reference: dict[str, FinalMessage] = {}
        async with AsyncClient(state.urls[0]) as direct:
            for surface in SURFACES:
                async with direct.stream("hi", surface=surface, max_tokens=400) as stream:
                    reference[surface] = await stream.final_message()
                    assert stream.reconnects == 0
        assert [reference[surface].text for surface in SURFACES] == [REPLY] * 3
        reconnects = 0
        async with AsyncClient(proxy.url, backoff=FAST, max_retries=30, rng=rng, idle_timeout=10) as client:
            for round_ in range(24):
                surface = SURFACES[round_ % 3]
                async with client.stream("hi", surface=surface, max_tokens=400) as stream:
                    deltas = [text async for text in stream.text_stream]
                    final = await stream.final_message()
                assert "".join(deltas) == final.text  # no gap, no repeat
                assert (final.text, final.stop_reason, final.usage) == (
                    reference[surface].text, reference[surface].stop_reason, reference[surface].usage)
                reconnects += stream.reconnects
    assert proxy.cuts >= 24 * 4 and reconnects >= 24 * 4


async def test_sync_client_survives_random_drops(tmp_path: Path) -> None:
    rng = random.Random(99)
    async with server_and_proxy(tmp_path, random_cuts(rng, p_cut=0.9)) as (_state, proxy):

        def run() -> list[tuple[str, list[int], int]]:
            out = []
            with Client(proxy.url, backoff=FAST, max_retries=30, rng=rng, idle_timeout=10) as client:
                for round_ in range(9):
                    surface = SURFACES[round_ % 3]
                    with client.stream("hi", surface=surface, max_tokens=400) as stream:
                        seqs = [event.seq for event in stream]
                        out.append((stream.final_message().text, seqs, stream.reconnects))
            return out

        results = await trio.to_thread.run_sync(run)
    for text, seqs, _ in results:
        assert text == REPLY
        assert seqs == list(range(len(seqs)))  # every event once, in order
    assert sum(r for _, _, r in results) >= 9


async def test_events_replayed_by_the_server_are_dropped_by_seq(tmp_path: Path) -> None:
    # The proxy deletes Last-Event-ID, so every resume replays the stream from its first event.
    rng = random.Random(3)
    async with server_and_proxy(tmp_path, random_cuts(rng, p_cut=0.9), request_filter=forget_last_event_id,
                                step_seconds=0.001) as (_state, proxy):
        async with AsyncClient(proxy.url, backoff=FAST, max_retries=30, rng=rng) as client:
            for surface in SURFACES:
                async with client.stream("hi", surface=surface, max_tokens=400) as stream:
                    events = [event async for event in stream]
                assert "".join(e.text for e in events) == REPLY and stream.reconnects >= 2
                assert [e.seq for e in events] == list(range(len(events)))


async def test_a_post_cut_before_its_answer_is_resent_with_its_idempotency_key(tmp_path: Path) -> None:
    prompts: list[str] = []
    plans = iter([Cut(after_bytes=0), Cut(after_bytes=0)])

    def reply(prompt: str) -> str:
        prompts.append(prompt)
        return REPLY

    async with server_and_proxy(tmp_path, lambda: next(plans, Cut()), reply=reply) as (_state, proxy):
        async with AsyncClient(proxy.url, backoff=FAST) as client:
            async with client.stream("only once", max_tokens=400) as stream:
                final = await stream.final_message()
    assert final.text == REPLY and stream.reconnects == 2
    assert prompts == ["only once"]  # the server generated it once


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: The same function tool in each surface's request shape.
TOOLS = {
    "anthropic": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}],
    "openai": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER}}],
    "responses": [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                   "parameters": WEATHER}],
}


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_stream_cut_mid_event_resumes_to_the_same_text_and_tool_call(tmp_path: Path, surface: str) -> None:
    """The first connection is cut in the middle of an event; the resumed stream ends with the text, the tool
    call, the stop reason and the usage of an uninterrupted run."""
    plans = iter([Cut(), Cut(after_bytes=2500)])  # the reference run's connection, then the cut one
    reply = REPLY + format_call("get_weather", '{"city": "Paris"}')
    async with server_and_proxy(tmp_path, lambda: next(plans, Cut()), reply=reply, step_seconds=0.001) as (_s, proxy):
        reconnects: list[Reconnect] = []
        finals = []
        async with AsyncClient(proxy.url, backoff=FAST) as client:
            for _ in range(2):
                async with client.stream("weather?", surface=surface, max_tokens=400, tools=TOOLS[surface],
                                         on_reconnect=reconnects.append) as stream:
                    events = [event async for event in stream]
                    finals.append(await stream.final_message())
    reference, final = finals
    assert proxy.cuts == 1 and len(reconnects) == 1 and reconnects[0].last_event_id is not None  # a resume
    assert final.text == reference.text == REPLY == "".join(e.text for e in events)
    assert (final.stop_reason, final.usage) == (reference.stop_reason, reference.usage)
    (call,), (called,) = final.tool_calls, reference.tool_calls  # call ids differ from message to message
    assert (call.name, call.arguments) == (called.name, called.arguments)
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert "".join(d.arguments for e in events for d in e.tool_deltas) == call.arguments
    assert [c for e in events for c in e.tool_calls] == [call]


@pytest.mark.parametrize("surface", SURFACES)
async def test_follow_learns_the_surface_by_name_and_reads_the_same_message(tmp_path: Path, surface: str) -> None:
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.002) as (state, _proxy):
        async with AsyncClient(state.urls[0]) as client:
            async with client.stream("hi", surface=surface, max_tokens=400) as created:
                async for event in created:
                    if event.text:
                        break
                async with client.follow(created.message_id) as followed:  # no surface given
                    following = await followed.final_message()
                assert followed.reconnects == 0
                assert following == await created.final_message()
    assert following.text == REPLY


# -- the other ways a stream ends ----------------------------------------------------------------------


async def test_expired_log_falls_back_to_the_stored_message(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut, stream={"ring_max_entries": 8}) as (state, _proxy):
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            done = await http.post("/v1/messages", json={**ANTHROPIC_BODY, "max_tokens": 400})
        message_id = done.headers["x-message-id"]
        # as a row written before schema 5: the server cannot rebuild the stream whose head left the ring
        state.hub.store.update(message_id, trace="")
        causes: list[str] = []
        async with AsyncClient(state.urls[0]) as client:
            async with client.follow(message_id, on_reconnect=lambda r: causes.append(r.cause)) as stream:
                events = [event async for event in stream]
                final = await stream.final_message()
    assert final == FinalMessage(message_id, REPLY, "end_turn", None, final.usage, "fake")
    assert final.usage.output_tokens > 0
    assert [e.event for e in events] == ["fallback"] and events[0].text == REPLY
    assert causes == ["the stream log is gone (410); reading the message"]


@pytest.mark.parametrize("surface", SURFACES)
async def test_an_in_band_error_raises(tmp_path: Path, surface: str) -> None:
    async with server_and_proxy(tmp_path, Cut, fail_after_tokens=5) as (state, _proxy):
        async with AsyncClient(state.urls[0]) as client:
            async with client.stream("hi", surface=surface, max_tokens=400) as stream:
                with pytest.raises(StreamError) as caught:
                    await stream.final_message()
    error = caught.value
    assert error.type in ("api_error", "server_error") and error.message_id == stream.message_id
    assert error.text == REPLY.encode()[:15].decode("utf-8", "ignore") and stream.reconnects == 0
    with pytest.raises(StreamError):
        await stream.final_message()  # the stream stays failed


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_cancel_by_another_party_gives_a_final_message_marked_cancelled(tmp_path: Path, surface: str) -> None:
    """The server's ringserve_cancelled key becomes FinalMessage.cancelled; the stop reason stays an SDK value."""
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.01) as (state, _proxy):
        async with AsyncClient(state.urls[0]) as client:
            async with client.stream("hi", surface=surface, max_tokens=400) as stream:
                async for event in stream:
                    if event.text:
                        await client.cancel(stream.message_id)
                        break
                final = await stream.final_message()
    assert final.cancelled
    assert final.stop_reason == {"anthropic": "end_turn", "openai": "stop", "responses": "cancelled"}[surface]
    assert 0 < len(final.text) < len(REPLY)


async def test_an_http_error_raises_without_retrying(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut) as (state, _proxy), AsyncClient(state.urls[0]) as client:
        async with client.stream("hi", max_tokens=0) as stream:
            with pytest.raises(APIError) as caught:
                await stream.final_message()
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    assert stream.reconnects == 0


def test_a_message_id_is_one_escaped_path_segment() -> None:
    """An id with ``/``, ``..`` or spaces cannot name another route (``ringserve tail "bad id/../x"``)."""
    seen: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(200, json={"id": "x", "status": "complete"})

    with Client("http://ringserve.test", transport=httpx.MockTransport(answer)) as client:
        client.get_message("bad id/../x")
        client.cancel("bad id/../x")
    assert seen == [b"/v1/messages/bad%20id%2F..%2Fx", b"/v1/messages/bad%20id%2F..%2Fx/cancel"]
    assert message_path("a/b", "/stream") == "/v1/messages/a%2Fb/stream"  # what tail and follow ask for


async def test_openai_stream_without_usage_reads_it_from_the_message(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut) as (state, _proxy):
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            body = {"model": "m", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}
            created = (await http.post("/v1/chat/completions", json=body, headers={"Prefer": "respond-async"})).json()
        async with AsyncClient(state.urls[0]) as client:
            final = await client.follow(created["id"]).final_message()
    assert final.text == REPLY and final.stop_reason == "stop"
    assert final.usage.output_tokens == math.ceil(len(REPLY.encode()) / 3) + 1  # 3-byte tokens, the end token


# -- timeouts -------------------------------------------------------------------------------------------


async def test_a_silent_connection_hits_the_idle_timeout_and_resumes(tmp_path: Path) -> None:
    plans = iter([Cut(after_bytes=1500, stall=True)])
    reconnects: list[Reconnect] = []
    async with server_and_proxy(tmp_path, lambda: next(plans, Cut()), step_seconds=0.002) as (_state, proxy):
        async with AsyncClient(proxy.url, idle_timeout=0.5, backoff=FAST, timeout=20) as client:
            async with client.stream("hi", max_tokens=400, on_reconnect=reconnects.append) as stream:
                final = await stream.final_message()
    assert final.text == REPLY
    assert [r.cause.split(":")[0] for r in reconnects] == ["ReadTimeout"]
    assert reconnects[0].last_event_id is not None


async def test_heartbeats_keep_a_connection_inside_the_idle_timeout(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut, server={"heartbeat_interval": 1.0}, prefill_seconds=2.5) as (s, _p):
        async with AsyncClient(s.urls[0], idle_timeout=1.6) as client:
            async with client.stream("hi", max_tokens=400) as stream:
                final = await stream.final_message()
    assert final.text == REPLY and stream.reconnects == 0


async def test_a_reconnect_hint_resumes_on_a_fresh_connection(tmp_path: Path) -> None:
    """server.max_stream_seconds ends each connection with a reconnect hint (a comment line)."""
    reconnects: list[Reconnect] = []
    async with server_and_proxy(tmp_path, Cut, server={"max_stream_seconds": 0.3}, step_seconds=0.004) as (s, _p):
        async with AsyncClient(s.urls[0], backoff=FAST, timeout=20) as client:
            async with client.stream("hi", max_tokens=400, on_reconnect=reconnects.append) as stream:
                final = await stream.final_message()
    assert final.text == REPLY
    assert reconnects and all(r.last_event_id is not None for r in reconnects)


async def test_the_overall_timeout_ends_the_stream_and_cancels_the_generation(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.05) as (state, _proxy):
        async with AsyncClient(state.urls[0], timeout=0.6) as client:
            start = trio.current_time()
            async with client.stream("hi", max_tokens=400) as stream:
                with pytest.raises(RequestTimeout) as caught:
                    await stream.final_message()
            # Ended by the 0.6 s timeout, not by the stream's end (400 tokens at 0.05 s: 20 s); the bound
            # leaves room for a loaded machine.
            assert 0.6 <= trio.current_time() - start < 5.0
            assert 0 < len(caught.value.text) < len(REPLY)
            status = await client.get_message(stream.message_id)
        assert status["status"] == "cancelled"  # leaving the stream early cancelled it

        def sync_run() -> tuple[float, dict[str, Any]]:
            with Client(state.urls[0], timeout=0.6, idle_timeout=0.5) as sync_client:
                began = time.monotonic()
                with sync_client.stream("hi", max_tokens=400) as sync_stream:
                    with pytest.raises(RequestTimeout):
                        sync_stream.final_message()
                elapsed = time.monotonic() - began
                return elapsed, sync_client.get_message(sync_stream.message_id)

        elapsed, sync_status = await trio.to_thread.run_sync(sync_run)
    assert 0.6 <= elapsed < 5.0 and sync_status["status"] == "cancelled"  # as above


def closed_port() -> int:
    """A port nothing listens on (bound a moment ago, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_connection_before_any_answer_raises_no_server_at_once() -> None:
    reconnects: list[Reconnect] = []
    async with AsyncClient(f"http://127.0.0.1:{closed_port()}") as client:
        for follow in (False, True):
            stream = (client.follow("msg_x", on_reconnect=reconnects.append) if follow
                      else client.stream("hi", on_reconnect=reconnects.append))
            async with stream:
                with pytest.raises(NoServer, match="nothing listens at the server's address"):
                    await stream.final_message()
    assert reconnects == []

    def sync() -> None:
        with Client(f"http://127.0.0.1:{closed_port()}") as client, client.stream("hi") as stream:
            with pytest.raises(NoServer):
                stream.final_message()

    await trio.to_thread.run_sync(sync)


async def test_a_refused_connection_after_the_server_answered_is_retried(tmp_path: Path) -> None:
    """A server restarting between two messages: the client keeps retrying, as for any drop."""
    reconnects: list[Reconnect] = []
    async with AsyncClient(backoff=FAST, max_retries=2, idle_timeout=10) as client:
        async with server_and_proxy(tmp_path) as (state, _proxy):
            client.http.base_url = httpx.URL(state.urls[0])
            async with client.stream("hi") as stream:
                assert (await stream.final_message()).text == REPLY
        async with client.stream("hi", on_reconnect=reconnects.append) as stream:  # the server is gone
            with pytest.raises(ConnectionLost, match="gave up after 2 retries"):
                await stream.final_message()
    assert len(reconnects) == 2 and all("ConnectError" in r.cause for r in reconnects)
