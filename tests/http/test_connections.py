"""Connections on an in-process server: heartbeats (C10), decode-loop crash (C12), keep-alive and
``Connection: close`` (the quart-trio trap), Quart's RESPONSE_TIMEOUT, max stream duration, TCP options
and the slow-reader watchdog's parts."""

from __future__ import annotations

import json
import re
import socket
import sys
from contextlib import aclosing
from typing import Any

import attrs
import httpx
import pytest
import trio
from quart_trio import QuartTrio

from ringserve.http.transport import HypercornConfig, SendWatchdog, abort_connection
from ringserve.core.ringlog import LogState, RingLog, format_event_id
from ringserve.core.sse import ServerSentEvent, SSEParser, encode_comment, encode_event, encode_reconnect
from ringserve.server import hypercorn_config
from ringserve.logs.memory import MemoryMessageLog
from ringserve.logs.reader import tail
from tests.support.server import fake_config, running_server
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, sse_events

def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _read_until_eof(stream: trio.SocketStream, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that happened."""
    raw = bytearray()
    with trio.fail_after(limit):
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return bytes(raw), trio.current_time()
            raw += data


# -- C10: heartbeats before the first token --------------------------------------------------


async def _until_first_token(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """Stream ``body`` until its first token: when headers and token came, pings before it (the
    readers' ``: ping`` comments and the keepalive ``ping`` events), status meanwhile."""
    parser = SSEParser()
    t0 = trio.current_time()
    out: dict[str, Any] = {}
    ping_events = 0
    async with client.stream("POST", "/v1/messages", json=body) as resp:
        out["headers_after"] = trio.current_time() - t0
        async for chunk in resp.aiter_raw():
            events = parser.feed(chunk)
            ping_events += sum(1 for e in events if e.event == "ping")
            pings = parser.comments + ping_events
            if pings and "first_ping_after" not in out:
                out["first_ping_after"] = trio.current_time() - t0
                url = f"/v1/messages/{resp.headers['x-message-id']}"
                out["status_while_waiting"] = (await client.get(url)).json()["status"]
            if any(e.event == "content_block_delta" for e in events):
                out["first_token_after"] = trio.current_time() - t0
                out["pings"] = pings
                return out
    raise AssertionError("the stream ended without a token")


async def test_heartbeats_before_first_token_during_prefill_and_queue(tmp_path):
    """C10: heartbeat 1 s; a 5 s prefill, and a 5 s wait in the queue behind a busy slot: headers at
    once, then >= 4 ": ping" comments before the first token."""
    body = {**ANTHROPIC_BODY, "stream": True}
    for sub in ("prefill", "queue"):
        (tmp_path / sub).mkdir()
    prefill_config = fake_config(tmp_path / "prefill", server={"heartbeat_interval": 1.0})
    queue_config = fake_config(tmp_path / "queue", server={"heartbeat_interval": 1.0}, engine={"slots": 1})
    busy_reply = " ".join(f"w{i:02}" for i in range(100))  # 100 tokens of 4 bytes at 0.05 s: 5 s
    got: dict[str, dict[str, Any]] = {}

    async def prefilled(client: httpx.AsyncClient) -> None:
        got["prefill"] = await _until_first_token(client, body)

    async def busy_then_queued(client: httpx.AsyncClient) -> None:
        async with trio.open_nursery() as nursery, client.stream(
            "POST", "/v1/messages", json={**body, "max_tokens": 200}
        ) as busy:
            # The busy stream holds the only slot (its headers are out); the next request queues.
            echo = {**body, "messages": [{"role": "user", "content": "echo:after the queue"}]}
            nursery.start_soon(lambda: _record(got, "queued", _until_first_token(client, echo)))
            parser = SSEParser()
            events = [e async for chunk in busy.aiter_raw() for e in parser.feed(chunk)]
            assert anthropic_text(events) == busy_reply

    async with (
        running_server(prefill_config, prefill_seconds=5.0) as prefill_state,
        running_server(queue_config, step_seconds=0.05, reply=busy_reply) as queue_state,
        httpx.AsyncClient(base_url=prefill_state.urls[0], timeout=30) as prefill_client,
        httpx.AsyncClient(base_url=queue_state.urls[0], timeout=30) as queue_client,
    ):
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(prefilled, prefill_client)
                nursery.start_soon(busy_then_queued, queue_client)
    assert set(got) == {"prefill", "queued"}
    for case, stats in got.items():
        assert stats["first_token_after"] >= 4.0, (case, stats)
        assert stats["pings"] >= 4, (case, stats)
        # Headers and pings went out as they were made, not with the token: four pings, each after 1 s
        # of silence, are made over 3 s, so the first came long before the token (2 s: room for a
        # loaded machine; held back, it would come with the token).
        assert stats["first_token_after"] - stats["first_ping_after"] >= 2.0, (case, stats)
    assert got["queued"]["status_while_waiting"] == "queued"


async def _record(into: dict[str, Any], key: str, awaitable: Any) -> None:
    into[key] = await awaitable


# -- C12: a crash inside the decode loop -----------------------------------------------------


async def test_decode_loop_crash_ends_every_stream_in_band_and_server_keeps_serving(tmp_path):
    """C12: the decode worker raises mid-stream: every reader gets an error event and EOF, then a new request works."""
    config = fake_config(tmp_path)
    results: dict[int, tuple[str, list[ServerSentEvent], bytes]] = {}
    long_reply = "word " * 200

    async def one(client: httpx.AsyncClient, i: int) -> None:
        surface, url, base = ("openai", "/v1/chat/completions", OPENAI_BODY) if i == 2 else (
            "anthropic", "/v1/messages", ANTHROPIC_BODY)
        _, events, raw = await sse_events(client, "POST", url, json={**base, "stream": True, "max_tokens": 400})
        results[i] = (surface, events, raw)

    # Call 0 prefills the first request for 0.3 s while the others arrive; call 3 crashes with all three in it.
    async with running_server(config, crash_after_steps=3, prefill_seconds=0.3, step_seconds=0.01,
                              reply=long_reply) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            with trio.fail_after(10):  # bounded: a stream must never hang after the crash
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, client, i)
            for surface, events, raw in results.values():
                if surface == "anthropic":
                    assert events[-1].event == "error"
                    err = json.loads(events[-1].data)
                    assert err["type"] == "error" and err["error"]["type"] == "api_error"
                    assert "message_stop" not in [e.event for e in events]
                else:
                    assert "error" in json.loads(events[-1].data)
                    assert b"[DONE]" not in raw
                message_id = events[-1].id.rpartition(":")[0]
                assert (await client.get(f"/v1/messages/{message_id}")).json()["status"] == "failed"
            _, events, _ = await sse_events(client, "POST", "/v1/messages", json={**ANTHROPIC_BODY, "stream": True})
            assert events[-1].event == "message_stop"
            assert anthropic_text(events) == long_reply[: len(anthropic_text(events))] != ""


# -- keep-alive and Connection: close (quart-trio trap fixed in app.ClosingHTTPConnection) ------


async def test_keep_alive_timeout_still_fires_after_the_first_request(tmp_path):
    """An idle keep-alive connection is closed after keep_alive_timeout, after any number of requests."""
    config = fake_config(tmp_path, server={"keep_alive_timeout": 1.0})
    async with running_server(config) as state:
        stream = await trio.open_tcp_stream(*_host_port(state.urls[0]))
        async with stream:
            for _ in range(2):  # the second request proves the connection was kept alive
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head = b""
                with trio.fail_after(5):
                    while not (b"\r\n\r\n" in head and head.endswith(b"}")):
                        head += await stream.receive_some(65536)
                assert head.startswith(b"HTTP/1.1 200")
            idle_since = trio.current_time()
            raw, closed_at = await _read_until_eof(stream, 15)  # fires, not never (generous under load)
        assert raw == b""
        assert closed_at - idle_since > 0.5  # and not before its time


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /health HTTP/1.0\r\n\r\n",
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n",
        b"POST /v1/messages HTTP/1.0\r\nContent-Type: application/json\r\n",
    ],
    ids=["close-get", "http10-get", "close-stream", "http10-stream"],
)
async def test_connection_close_and_http10_responses_close_the_socket(tmp_path, request_head):
    """With Connection: close or HTTP/1.0 the server closes the socket right after the response
    (nginx's default upstream mode, HTTP/1.0, waits for exactly that)."""
    if request_head.startswith(b"POST"):
        body = json.dumps({**ANTHROPIC_BODY, "stream": True}).encode()
        request_head += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    async with running_server(fake_config(tmp_path, server={"keep_alive_timeout": 30.0})) as state:
        stream = await trio.open_tcp_stream(*_host_port(state.urls[0]))
        async with stream:
            await stream.send_all(request_head)
            raw, _ = await _read_until_eof(stream, 5)  # far below the 30 s keep-alive timeout
    assert b" 200 " in raw.split(b"\r\n", 1)[0]
    if request_head.startswith(b"POST"):
        assert b"event: message_stop" in raw


async def test_quart_response_timeout_does_not_cut_streams(tmp_path, monkeypatch):
    """Quart's RESPONSE_TIMEOUT (60 s by default, here 0.5 s) must not cut a stream that lasts longer."""
    monkeypatch.setattr(QuartTrio, "default_config", {**QuartTrio.default_config, "RESPONSE_TIMEOUT": 0.5})
    async with running_server(fake_config(tmp_path), step_seconds=0.1, reply="a b c d e f g h i j k l") as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            t0 = trio.current_time()
            _, events, _ = await sse_events(client, "POST", "/v1/messages", json={**ANTHROPIC_BODY, "stream": True})
            assert trio.current_time() - t0 > 0.5
    assert events[-1].event == "message_stop"
    assert anthropic_text(events) == "a b c d e f g h i j k l"


# -- max stream duration -------------------------------------------------------------------


async def test_max_stream_seconds_ends_with_reconnect_hint_and_generation_goes_on(tmp_path):
    """A connection that streamed max_stream_seconds ends with the reconnect hint, a comment line naming
    the last event sent (no parser dispatches it); the generation is not aborted (policy abort, grace 0)
    and resuming completes it."""
    reply = " ".join(f"w{i}" for i in range(60))  # 4 bytes a token, 0.05 s a token: about 3 s
    config = fake_config(tmp_path, server={"max_stream_seconds": 1.0})
    hint_line = re.compile(rb": reconnect (\{.*\})\n\Z")
    async with running_server(config, step_seconds=0.05, reply=reply) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            _, events, raw = await sse_events(client, "POST", "/v1/messages", json={**ANTHROPIC_BODY, "stream": True})
            all_events = list(events)
            hints = 0
            while (hint := hint_line.search(raw)) is not None:
                hints += 1
                data = json.loads(hint.group(1))
                assert data == {"last_event_id": events[-1].id}
                message_id = data["last_event_id"].rpartition(":")[0]
                _, events, raw = await sse_events(client, "GET", f"/v1/messages/{message_id}/stream",
                                                  headers={"Last-Event-ID": data["last_event_id"]})
                all_events += events
                assert hints < 10
            assert hints >= 2
            assert all_events[-1].event == "message_stop"
            assert anthropic_text(all_events) == reply
            seqs = [int(e.id.rpartition(":")[2]) for e in all_events]
            assert seqs == list(range(len(seqs)))  # nothing lost, nothing twice
            status = (await client.get(f"/v1/messages/{message_id}")).json()
            assert status["status"] == "complete" and status["stop_reason"] == "end_turn"


async def test_tail_ends_with_a_reconnect_hint_after_max_seconds(autojump_clock):
    """logs/reader.py: pings while silent, then at max_seconds on_reconnect() and the hint naming the
    last entry sent; a log that ends first ends normally, with no hint."""
    log = MemoryMessageLog("msg_1", RingLog(64, 65536))
    log.append(encode_event("first", id=format_event_id("msg_1", 0)))
    reconnects: list[None] = []
    out: list[bytes] = []
    async with aclosing(tail(log, None, heartbeat_interval=1.0, max_seconds=2.5,
                             on_reconnect=lambda: reconnects.append(None))) as chunks:
        async for chunk in chunks:
            out.append(chunk)
    assert out == [encode_event("first", id="msg_1:0"), encode_comment("ping"), encode_comment("ping"),
                   encode_reconnect("msg_1:0")]
    assert trio.current_time() == pytest.approx(2.5) and reconnects == [None]
    async with aclosing(tail(log, 0, heartbeat_interval=1.0, max_seconds=2.5)) as chunks:
        assert [chunk async for chunk in chunks][-1] == encode_reconnect("msg_1:0")
    log.close(LogState.FINISHED)
    async with aclosing(tail(log, None, heartbeat_interval=1.0, max_seconds=0.5)) as chunks:
        assert [chunk async for chunk in chunks] == [encode_event("first", id="msg_1:0")]


# -- TCP options and the slow-reader watchdog's parts ----------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_USER_TIMEOUT and its inheritance are Linux")
def test_listening_socket_options_are_inherited_by_accepted_sockets(tmp_path):
    """TCP_USER_TIMEOUT and keep-alive set on the listener reach every accepted connection (Linux)."""
    config = fake_config(tmp_path, server={"slow_reader_timeout": 7.5, "keep_alive_timeout": 3.0})
    hc = hypercorn_config(config)
    assert isinstance(hc, HypercornConfig) and hc.tcp_user_timeout == 15.0 and hc.keep_alive_timeout == 3.0
    assert not hc.ssl_enabled and not hc.quic_bind  # plain HTTP + h2c; HTTP/3 stays off
    [listener] = hc.create_sockets().insecure_sockets
    with listener:
        listener.listen()
        with socket.create_connection(listener.getsockname()[:2]) as _client:
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15000
                assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5


def test_abort_connection_resets_a_connection_found_by_its_addresses():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert not abort_connection(("127.0.0.1", 1), client.getsockname())
                assert abort_connection(accepted.getsockname(), accepted.getpeername())
                with pytest.raises(OSError):  # EPIPE: a write pinned on this socket would wake with it
                    accepted.send(b"x")
                client.settimeout(5)
                assert client.recv(10) == b""  # the peer sees the end of the connection


async def test_watchdog_drops_a_send_blocked_longer_than_the_timeout(autojump_clock):
    drops: list[None] = []
    dog = SendWatchdog(10.0, on_drop=lambda: drops.append(None))
    scope_h1 = {"http_version": "1.1", "method": "GET", "path": "/x", "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 2)}
    scope_h2 = {**scope_h1, "http_version": "2"}
    cancelled: list[str] = []

    async def blocked_send(scope: dict[str, Any], name: str, seconds: float) -> None:
        with trio.CancelScope() as cancel_scope:
            with dog.watch(scope, cancel_scope):
                await trio.sleep(seconds)
        if cancel_scope.cancelled_caught:
            cancelled.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dog.run)
        nursery.start_soon(blocked_send, scope_h1, "slow", 60)
        nursery.start_soon(blocked_send, scope_h2, "h2-slow", 60)
        nursery.start_soon(blocked_send, scope_h1, "quick", 9)
        await trio.sleep(1)
        assert dog.statistics().sends_in_flight == 3
        await trio.sleep(11)
        assert sorted(cancelled) == ["h2-slow", "slow"]  # "quick" returned at 9 s
        stats = dog.statistics()
        assert stats.readers_dropped_total == 2 and len(drops) == 2
        assert stats.sends_in_flight == 0
        nursery.cancel_scope.cancel()


# -- error answers made outside the routes ------------------------------------------------------


def _openai_error(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("path", ["/static//x", "/v1//models", "/nonexistent"])
async def test_paths_that_match_no_route_get_a_json_404(fake_server, path):
    """werkzeug merged slashes with a 308 redirect whose body was HTML; now no route matches: 404,
    OpenAI's error shape (the shape outside /v1/messages)."""
    _state, client = fake_server
    resp = await client.get(path)
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"
    _openai_error(resp.content)


@pytest.mark.parametrize("header", [b"X-Test: a\x00b", b"X-Test: a\rb", b"Bad Header: x"])
async def test_a_request_hypercorn_cannot_parse_gets_a_json_400(tmp_path, header):
    """A NUL or CR in a header value, or a space in a name: h11 refuses the request and hypercorn answers
    it itself; the answer has a JSON body in OpenAI's error shape, and the connection is closed."""
    async with running_server(fake_config(tmp_path)) as state:
        stream = await trio.open_tcp_stream(*_host_port(state.urls[0]))
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            raw, _ = await _read_until_eof(stream, 5)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head.lower()
    assert "malformed HTTP request" in _openai_error(body)["message"]


async def test_the_answer_hypercorn_makes_itself_takes_its_shape_from_the_surface_registry(tmp_path, monkeypatch):
    """The shape is the registry's default surface's (one lookup for the wire format), not a surface
    http/transport.py builds: with Anthropic as the default, the 400 is in Anthropic's error shape."""
    from ringserve.surfaces import registry

    monkeypatch.setattr(registry, "SURFACES", attrs.evolve(registry.SURFACES, default=registry.ANTHROPIC))
    async with running_server(fake_config(tmp_path)) as state:
        stream = await trio.open_tcp_stream(*_host_port(state.urls[0]))
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n")
            raw, _ = await _read_until_eof(stream, 5)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    doc = json.loads(body)
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert "malformed HTTP request" in doc["error"]["message"]
