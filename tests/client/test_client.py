"""ringserve.client and the chat/tail commands against an in-process server (fake engine).

The drop tests put :class:`tests.support.proxy.DroppingProxy` between the client and
the server: it cuts connections at random byte offsets (FIN or RST, before
the request or mid-event), goes silent, or cuts on demand. Every resumed
stream must end with exactly the text of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx_sse
import pytest
import trio

from ringserve.client import (
    APIError,
    AsyncClient,
    Backoff,
    Client,
    ClientError,
    FinalMessage,
    Reconnect,
    RequestTimeout,
    ResumeState,
    StreamError,
    message_path,
)
from tests.support.helpers import ANTHROPIC_BODY
from tests.support.proxy import Cut, forget_last_event_id, random_cuts, server_behind_proxy

#: Multi-byte characters, split across 3-byte tokens by the fake engine.
REPLY = "Résumé ✓ 👍🏽 你好 🇯🇵 Привет ½. " * 8
FAST = Backoff(base=0.002, cap=0.02)


def server_and_proxy(tmp_path: Path, plan: Any, **kwargs: Any) -> Any:
    """:func:`server_behind_proxy` with this file's reply, cut into 3-byte tokens."""
    kwargs.setdefault("reply", REPLY)
    kwargs.setdefault("piece_bytes", 3)
    return server_behind_proxy(tmp_path, plan, **kwargs)


def sse(data: str, id_: str | None, event: str = "message") -> httpx_sse.ServerSentEvent:
    return httpx_sse.ServerSentEvent(event=event, data=data, id=id_ or "")


def delta(text: str) -> str:
    return json.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})


# -- the sans-I/O parts ---------------------------------------------------------------------------


def test_backoff_is_exponential_with_full_jitter() -> None:
    backoff, rng = Backoff(base=0.1, cap=2.0), random.Random(7)
    assert [backoff.bound(n) for n in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert backoff.bound(10_000) == 2.0
    for n in range(8):
        delays = [backoff.delay(n, rng) for _ in range(400)]
        assert all(0.0 <= d <= backoff.bound(n) for d in delays)
        # Full jitter: spread over the whole range, not clustered near the bound.
        assert min(delays) < 0.1 * backoff.bound(n) and max(delays) > 0.9 * backoff.bound(n)
    with pytest.raises(ValueError):
        Backoff(base=1.0, cap=0.5)


def test_state_drops_duplicates_and_refuses_a_gap() -> None:
    state = ResumeState.follow("msg_1", now=0.0, timeout=None)
    assert state.next_request().headers.get("Last-Event-ID") is None
    first = state.feed(sse(delta("a"), "msg_1:0", "content_block_delta"))
    assert [e.text for e in first] == ["a"]
    assert state.feed(sse(delta("a"), "msg_1:0", "content_block_delta")) == []  # replayed: dropped
    assert state.feed(sse("", "msg_1:0")) == []  # httpx-sse's data-less dispatch after a ping
    state.feed(sse(delta("b"), "msg_1:1", "content_block_delta"))
    assert state.text == "ab"
    assert state.next_request().headers["Last-Event-ID"] == "msg_1:1"
    with pytest.raises(ClientError, match="gap"):
        state.feed(sse(delta("d"), "msg_1:3", "content_block_delta"))
    with pytest.raises(ClientError, match="does not belong"):
        ResumeState.follow("msg_1", now=0.0, timeout=None).feed(sse(delta("x"), "msg_2:0", "content_block_delta"))


def test_state_gives_up_after_max_retries_without_progress_and_resets_on_progress() -> None:
    state = ResumeState.follow("msg_1", now=0.0, timeout=None, max_retries=2, backoff=FAST)
    assert state.reconnect(None, 0.0).attempt == 1
    state.feed(sse(delta("a"), "msg_1:0", "content_block_delta"))  # progress resets the count
    assert [state.reconnect(OSError("boom"), 0.0).attempt for _ in range(2)] == [1, 2]
    with pytest.raises(ClientError, match="gave up after 2 retries"):
        state.reconnect(None, 0.0)


def test_state_honours_retry_after_and_the_deadline() -> None:
    state = ResumeState.follow("msg_1", now=0.0, timeout=10.0, backoff=FAST)
    state.answered(503, {"retry-after": "3"}, b"{}")
    wait = state.reconnect(None, 0.0)
    assert wait.delay >= 3.0 and wait.cause == "HTTP 503"
    state.answered(529, {"retry-after": "3"}, b"{}")
    with pytest.raises(RequestTimeout):
        state.reconnect(None, 8.0)  # the next attempt would start after the deadline


def test_state_reads_the_message_when_the_stream_has_ended_204() -> None:
    """204 (nothing after the last event: the stream has ended) switches to GET /v1/messages/{id}, at once."""
    state = ResumeState.follow("msg_1", now=0.0, timeout=None, backoff=FAST)
    state.feed(sse(delta("a"), "msg_1:0", "content_block_delta"))
    assert state.answered(204, {}, b"") == []
    wait = state.reconnect(None, 0.0)
    assert wait.delay == 0.0 and "ended (204)" in wait.cause and wait.attempt == 0
    request = state.next_request()
    assert (request.method, request.url) == ("GET", "/v1/messages/msg_1")
    message = {"status": "complete", "text": "ab", "stop_reason": "end_turn", "usage": {"input_tokens": 1,
               "output_tokens": 2}, "model": "fake"}
    assert [e.text for e in state.answered(200, {}, json.dumps(message).encode())] == ["b"]
    assert state.done and state.finish_or_raise().text == "ab"


# -- drops at random points: the text equals an uninterrupted run ----------------------------------


async def test_async_client_survives_random_drops_on_both_surfaces(tmp_path: Path) -> None:
    rng = random.Random(20240607)
    # step_seconds: the generation is still running during most resumes (live tail, not only replay).
    async with server_and_proxy(tmp_path, random_cuts(rng, p_cut=0.9), step_seconds=0.001) as (state, proxy):
        reference: dict[str, FinalMessage] = {}
        async with AsyncClient(state.urls[0]) as direct:
            for surface in ("anthropic", "openai"):
                async with direct.stream("hi", surface=surface, max_tokens=400) as stream:
                    reference[surface] = await stream.final_message()
                    assert stream.reconnects == 0
        assert reference["anthropic"].text == REPLY == reference["openai"].text
        reconnects = 0
        async with AsyncClient(proxy.url, backoff=FAST, max_retries=30, rng=rng, idle_timeout=10) as client:
            for round_ in range(24):
                surface = ("anthropic", "openai")[round_ % 2]
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
                for round_ in range(8):
                    surface = ("openai", "anthropic")[round_ % 2]
                    with client.stream("hi", surface=surface, max_tokens=400) as stream:
                        seqs = [event.seq for event in stream]
                        out.append((stream.final_message().text, seqs, stream.reconnects))
            return out

        results = await trio.to_thread.run_sync(run)
    for text, seqs, _ in results:
        assert text == REPLY
        assert seqs == list(range(len(seqs)))  # every event once, in order
    assert sum(r for _, _, r in results) >= 8


async def test_events_replayed_by_the_server_are_dropped_by_seq(tmp_path: Path) -> None:
    # The proxy deletes Last-Event-ID, so every resume replays the stream from its first event.
    rng = random.Random(3)
    async with server_and_proxy(tmp_path, random_cuts(rng, p_cut=0.9), request_filter=forget_last_event_id,
                                step_seconds=0.001) as (_state, proxy):
        async with AsyncClient(proxy.url, backoff=FAST, max_retries=30, rng=rng) as client:
            for surface in ("anthropic", "openai"):
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


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
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


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
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
    assert final.cancelled and final.stop_reason == {"anthropic": "end_turn", "openai": "stop"}[surface]
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


# -- the terminal commands -------------------------------------------------------------------------------


def ringserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ringserve", *args]


async def test_chat_streams_the_reply_through_drops(tmp_path: Path) -> None:
    rng = random.Random(5)
    async with server_and_proxy(tmp_path, random_cuts(rng, max_bytes=2500)) as (_state, proxy):
        done = await trio.run_process(ringserve_cmd("chat", "--url", proxy.url, "--max-tokens", "400", "hi"),
                                      capture_stdout=True, capture_stderr=True, check=False)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    assert stdout == REPLY + "\n"
    assert "reconnecting in" in stderr and "end_turn" in stderr


@contextlib.contextmanager
def sigint_not_ignored() -> Iterator[None]:
    """Let a child started inside the block get Ctrl-C as KeyboardInterrupt.

    A shell starts background jobs (``.ci/run ... &``) with SIGINT ignored; children
    inherit that across exec, and Python then installs no KeyboardInterrupt handler,
    so the child would ignore the test's SIGINT and finish with status 0.
    """
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


async def test_chat_ctrl_c_cancels_the_generation_on_the_server(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.05) as (state, _proxy):
        with sigint_not_ignored():
            proc = await trio.lowlevel.open_process(ringserve_cmd("chat", "--url", state.urls[0], "hi"),
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with trio.fail_after(20):
            seen = await proc.stdout.receive_some()  # the reply has started
            assert seen
            proc.send_signal(signal.SIGINT)
            stderr = b""
            while chunk := await proc.stderr.receive_some():
                stderr += chunk
            assert await proc.wait() == 130
        line = stderr.decode().strip().splitlines()[-1]
        assert line.startswith("[cancelled msg_") and "cancelled," in line, line
        message_id = line.split()[1].rstrip(":")
        async with AsyncClient(state.urls[0]) as client:
            status = await client.get_message(message_id)
    assert status["status"] == "cancelled" and status["stop_reason"] == "end_turn"
    assert len(status["text"]) < len(REPLY)


async def test_tail_follows_an_existing_message(tmp_path: Path) -> None:
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.01) as (state, proxy):
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            body = {**ANTHROPIC_BODY, "max_tokens": 400, "stream": True}
            created = (await http.post("/v1/messages", json=body, headers={"Prefer": "respond-async"})).json()
        done = await trio.run_process(ringserve_cmd("tail", "--url", proxy.url, created["id"]),
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == REPLY + "\n"
