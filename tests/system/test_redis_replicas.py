"""Two ringserve processes (bench/fake_server.py) on one redis-server: a stream generated on A is
read through both replicas with random drops and resumes (directly, and through nginx with the
config of docs/scale-out.md) and reassembles byte for byte; status, stream tokens, cancel and
Idempotency-Key retries work through the replica that does not own the message."""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from bench.common import ServerProcess, metric_totals
from ringserve.core.sse import SSEParser
from tests.http.test_drain import FakeServerProcess, _toml
from tests.support.helpers import ANTHROPIC_BODY
from tests.support.redis_server import RedisServer, free_port, needs_redis
from tests.support.server import MODEL_THREADS, SERVE
from tests.system.test_nginx import NGINX, documented_snippet, start_nginx

pytest.importorskip("coredis", reason="the redis extra is not installed (pip install 'ringserve[redis]')")

pytestmark = [needs_redis, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX processes")]

#: Drop/resume cycles (the issue asks for 200; each one is a fresh connection to one of the replicas).
CYCLES = 200
ASYNC = {"Prefer": "respond-async"}
#: Reply tokens: one log entry each (flush_tokens = 1), enough for CYCLES cycles of up to 8 events.
TOKENS = 2000

_ID = re.compile(rb"^id: (\S+):(\d+)$", re.M)


@contextlib.contextmanager
def two_replicas(tmp_path: Path, fake: dict[str, Any],
                 reply_bytes: int = 2 * TOKENS) -> Iterator[tuple[FakeServerProcess, FakeServerProcess]]:
    """Replicas A and B (one entry per token, a shared stream-token secret, API keys off) on one redis-server."""
    redis = RedisServer(tmp_path)
    servers = []
    try:
        for name in ("a", "b"):
            work = tmp_path / name
            work.mkdir()
            sections = {"stream": {"backend": "redis", "redis_url": redis.url, "flush_tokens": 1, "flush_ms": 0.0},
                        "auth": {"stream_token_secret": "shared by both replicas"}}
            servers.append(FakeServerProcess(work, sections, fake, reply_bytes=reply_bytes))
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[FakeServerProcess, FakeServerProcess]]:
    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.002}) as pair:
        yield pair


async def _read_blocks(client: httpx.AsyncClient, url: str, headers: dict[str, str], most: int | None) -> tuple[list[bytes], bool]:
    """Up to ``most`` complete SSE blocks (pings left out), and whether the stream ended."""
    blocks: list[bytes] = []
    buffer = b""
    async with client.stream("GET", url, headers=headers) as resp:
        assert resp.status_code == 200, (url, resp.status_code, await resp.aread())
        async for chunk in resp.aiter_raw():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n\n")
            for block in complete:
                if not block.startswith(b":"):
                    blocks.append(block + b"\n\n")
                if most is not None and len(blocks) >= most:
                    return blocks, False  # leaving the block drops the connection mid-stream
    return blocks, True


def _last_event_id(block: bytes) -> dict[str, str]:
    found = _ID.search(block)
    return {"Last-Event-ID": f"{found[1].decode()}:{found[2].decode()}"}


async def _start(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> tuple[str, list[bytes]]:
    """POST a long stream (policy continue) and drop it after its first event: (message id, [that event])."""
    body = body or {**ANTHROPIC_BODY, "max_tokens": TOKENS + 10, "stream": True}
    async with client.stream("POST", f"{url}/v1/messages", json=body,
                             headers={"Ringserve-Disconnect-Policy": "continue", **(headers or {})}) as resp:
        assert resp.status_code == 200
        buffer = b""
        async for chunk in resp.aiter_raw():
            buffer += chunk
            if b"\n\n" in buffer:
                return resp.headers["X-Message-Id"], [buffer[: buffer.index(b"\n\n") + 2]]
    raise AssertionError("the stream ended before its first event")


async def _drop_and_resume(client: httpx.AsyncClient, message_id: str, got: list[bytes], urls: list[str],
                           rng: random.Random) -> None:
    """One resume per url of ``urls`` after ``got[-1]``, each dropped after 1-8 events; then read the rest."""
    for url in urls:
        blocks, ended = await _read_blocks(client, f"{url}/v1/messages/{message_id}/stream",
                                           _last_event_id(got[-1]), rng.randint(1, 8))
        got += blocks
        assert not ended, f"the stream ended after {urls.index(url) + 1} cycles"
    blocks, _ = await _read_blocks(client, f"{urls[-1]}/v1/messages/{message_id}/stream", _last_event_id(got[-1]), None)
    got += blocks


def _assert_whole(got: list[bytes], whole: list[bytes]) -> None:
    seqs = [int(_ID.search(block)[2]) for block in got]
    assert seqs == list(range(len(got))), "a seq was lost or repeated"
    assert b"".join(got) == b"".join(whole)  # byte for byte
    assert b"event: message_stop" in got[-1]


async def test_a_stream_read_through_both_replicas_with_drops_reassembles_exactly(replicas):
    a, b = replicas
    rng = random.Random(17)
    async with httpx.AsyncClient(timeout=60) as client:
        message_id, got = await _start(client, a.url)
        # alternating, with random runs on one replica
        urls = [((a, b)[cycle % 2] if rng.random() < 0.5 else rng.choice((a, b))).url for cycle in range(CYCLES)]
        assert urls.count(b.url) >= CYCLES // 4 and urls.count(a.url) >= CYCLES // 4
        await _drop_and_resume(client, message_id, got, urls, rng)
        whole, _ = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream", {}, None)
    _assert_whole(got, whole)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install -y nginx)")
async def test_the_scale_out_nginx_config_spreads_resumes_over_both_replicas(replicas, tmp_path):
    a, b = replicas
    port = free_port()
    snippet = documented_snippet("scale-out.md")
    snippet, n1 = re.subn(r"server 127\.0\.0\.1:808([12]);",
                          lambda m: f"server {(a, b)[int(m[1]) - 1].url.removeprefix('http://')};", snippet)
    snippet, n2 = re.subn(r"listen 80;", f"listen 127.0.0.1:{port};", snippet)
    assert (n1, n2) == (2, 1), "docs/scale-out.md no longer has the lines this test adjusts"
    (tmp_path / "nginx").mkdir()
    rng = random.Random(18)
    with start_nginx(tmp_path / "nginx", snippet, port) as proxy:
        async with httpx.AsyncClient(timeout=60) as client:
            message_id, got = await _start(client, proxy)
            await _drop_and_resume(client, message_id, got, [proxy] * 20, rng)
            whole, _ = await _read_blocks(client, f"{a.url}/v1/messages/{message_id}/stream", {}, None)
            _assert_whole(got, whole)
            for replica in (a, b):  # round robin: both served resumes
                metrics = (await client.get(f"{replica.url}/metrics")).text
                ok = re.search(r'^ringserve_resumes_total\{result="ok"\} (\S+)$', metrics, re.M)
                assert ok is not None and float(ok[1]) >= 5


def _metric(text: str, name: str) -> float:
    return metric_totals(text)[name]


async def test_status_stream_token_and_cancel_through_b_for_a_message_generated_on_a(tmp_path):
    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.02}) as (a, b):  # 40 s if not cancelled
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**ANTHROPIC_BODY, "max_tokens": TOKENS + 10, "stream": True}
            resp = await client.post(f"{a.url}/v1/messages", json=body, headers={"Prefer": "respond-async"})
            assert resp.status_code == 202
            message_id = resp.json()["id"]
            # B has no such row in its SQLite: it reads the state A wrote to Redis.
            status = (await client.get(f"{b.url}/v1/messages/{message_id}")).json()
            with trio.fail_after(30):
                while status["status"] != "generating" or not status["text"]:  # A writes it every second
                    await trio.sleep(0.05)
                    status = (await client.get(f"{b.url}/v1/messages/{message_id}")).json()
            assert status["id"] == message_id and status["surface"] == "anthropic"
            # A stream token B issued opens the stream on A (one secret for both).
            token = (await client.post(f"{b.url}/v1/messages/{message_id}/stream_token")).json()["stream_token"]
            blocks, _ = await _read_blocks(client, f"{a.url}/v1/messages/{message_id}/stream?stream_token={token}",
                                           {}, 2)
            assert b"event: message_start" in blocks[0]
            # Cancel through B: A stops the generation and frees its KV cells.
            cancelled = await client.post(f"{b.url}/v1/messages/{message_id}/cancel")
            assert cancelled.status_code == 200
            final = cancelled.json()
            assert final["status"] == "cancelled" and final["stop_reason"] is not None
            on_a = (await client.get(f"{a.url}/v1/messages/{message_id}")).json()
            assert on_a["status"] == "cancelled" and on_a["text"] == final["text"]
            assert 0 < on_a["usage"]["output_tokens"] < TOKENS
            with trio.fail_after(10):  # the runner removes the cells at its next step, after the log ended
                while _metric(metrics := (await client.get(f"{a.url}/metrics")).text, "ringserve_kv_cells_used"):
                    await trio.sleep(0.05)
            assert _metric(metrics, "ringserve_cancel_to_kv_freed_seconds_count") == 1
            # The stream through B ends with the cancel's terminal event, as on A.
            whole_b, ended = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream", {}, None)
            whole_a, _ = await _read_blocks(client, f"{a.url}/v1/messages/{message_id}/stream", {}, None)
            assert ended and whole_b == whole_a and b"message_stop" in whole_b[-1]


async def test_kill_9_of_the_owner_ends_the_stream_on_b_with_an_in_band_error_and_interrupted(tmp_path):
    from ringserve.logs.redis import LEASE_MS

    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.02}) as (a, b):  # 40 s if left to run
        async with httpx.AsyncClient(timeout=60) as client:
            message_id, got = await _start(client, a.url)
            async with client.stream("GET", f"{b.url}/v1/messages/{message_id}/stream",
                                     headers=_last_event_id(got[-1])) as resp:
                assert resp.status_code == 200
                parser = SSEParser()
                events = []
                killed_at = None
                with trio.fail_after(LEASE_MS / 1000 + 20):
                    async for chunk in resp.aiter_raw():
                        events += parser.feed(chunk)
                        if killed_at is None and len(events) >= 5:
                            a.proc.send_signal(signal.SIGKILL)
                            a.proc.wait(10)
                            killed_at = trio.current_time()
            assert killed_at is not None
            assert events[-1].event == "error" and "retry" in json.loads(events[-1].data)["error"]["message"]
            assert [int(e.id.rsplit(":", 1)[1]) for e in events] == list(range(1, len(events) + 1))
            status = (await client.get(f"{b.url}/v1/messages/{message_id}")).json()
            assert status["status"] == "interrupted" and status["error"] and status["text"]
            # a resume on B now replays to the same end
            blocks, ended = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream", {}, None)
            assert ended and b"event: error" in blocks[-1]


def _kill(server: FakeServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)


async def _started(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> str:
    """POST a long stream (policy continue) on ``url`` and drop it after its first event: its message id."""
    async with client.stream("POST", f"{url}{path}", json=body,
                             headers={"Ringserve-Disconnect-Policy": "continue"}) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_raw():
            if b"\n\n" in chunk:
                return resp.headers["X-Message-Id"]
    raise AssertionError("the stream ended before its first event")


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_kill_9_of_the_owner_ends_the_stream_read_through_b_with_an_error_the_sdk_raises(tmp_path, surface):
    """Read through B with the surface's official SDK (its stream type, on the resume route), the
    owner-lost end is the error event each SDK raises on, with the retry hint."""
    import anthropic
    import openai
    from anthropic.types import RawMessageStreamEvent
    from openai.types.chat import ChatCompletionChunk

    from ringserve.logs.redis import LEASE_MS

    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.02}) as (a, b):  # 40 s if left to run
        async with httpx.AsyncClient(timeout=60) as client:
            if surface == "anthropic":
                message_id = await _started(client, a.url, "/v1/messages",
                                            {**ANTHROPIC_BODY, "max_tokens": TOKENS + 10, "stream": True})
                sdk_client: Any = anthropic.Anthropic(base_url=b.url, api_key="unused", max_retries=0)
                path, cast_to, stream_cls = (f"/v1/messages/{message_id}/stream", RawMessageStreamEvent,
                                             anthropic.Stream[RawMessageStreamEvent])
                raised: type[Exception] = anthropic.APIError
            else:
                body = {"model": "any", "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": TOKENS + 10, "stream": True}
                message_id = await _started(client, a.url, "/v1/chat/completions", body)
                sdk_client = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
                path, cast_to, stream_cls = (f"/messages/{message_id}/stream", ChatCompletionChunk,
                                             openai.Stream[ChatCompletionChunk])
                raised = openai.APIError

            def read() -> tuple[int, Exception | None]:
                seen = 0
                try:
                    for _event in sdk_client.get(path, cast_to=cast_to, stream=True, stream_cls=stream_cls):
                        seen += 1
                        if seen == 5:
                            _kill(a)
                except Exception as exc:  # what the SDK raised: judged below
                    return seen, exc
                return seen, None

            with trio.fail_after(LEASE_MS / 1000 + 30):
                seen, error = await trio.to_thread.run_sync(read)
            assert seen >= 5 and isinstance(error, raised), (seen, error)
            assert "retry" in str(error)
            status = (await client.get(f"{b.url}/v1/messages/{message_id}")).json()
            assert status["status"] == "interrupted" and status["text"]


async def test_kill_9_of_the_owner_ends_a_responses_stream_with_response_failed_the_sdk_sees(tmp_path):
    """Issue 36 item 2: the official SDK's ``responses.stream(response_id=..., starting_after=3)``
    through B sees the owner-lost end: ``response.failed`` with the next ``sequence_number``, the
    response's own fields (background, metadata, model) and the output generated so far."""
    import openai

    from ringserve.logs.redis import LEASE_MS

    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.02}) as (a, b):  # 40 s if left to run
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "any", "input": "hello", "max_output_tokens": TOKENS + 10, "stream": True,
                    "background": True, "metadata": {"k": "v"}}
            response_id = await _started(client, a.url, "/v1/responses", body)
            sdk_client = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)

            def read() -> list[Any]:
                events = []
                with sdk_client.responses.stream(response_id=response_id, starting_after=3) as stream:
                    for event in stream:
                        events.append(event)
                        if len(events) == 80:  # past the first timed snapshot ([stream] persist_seconds 1)
                            _kill(a)
                return events

            with trio.fail_after(LEASE_MS / 1000 + 30):
                events = await trio.to_thread.run_sync(read)
            served = (await client.get(f"{b.url}/v1/models")).json()["data"][0]["id"]
    seqs = [event.sequence_number for event in events]
    assert len(events) > 80 and seqs == list(range(4, 4 + len(events))), seqs[-5:]
    failed = events[-1]
    assert failed.type == "response.failed", [event.type for event in events[-5:]]
    response = failed.response
    assert response.id == response_id and response.status == "failed" and "retry" in response.error.message
    assert response.background is True and response.metadata == {"k": "v"}
    assert response.model == served
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    output = response.output[0].content[0].text
    assert output and text.startswith(output)  # the stored output: what was generated up to the last snapshot


async def _prompt_tokens(client: httpx.AsyncClient, *replicas: FakeServerProcess) -> float:
    """Prompt tokens admitted, over ``replicas`` (each counts the generations it runs)."""
    return sum([_metric((await client.get(f"{r.url}/metrics")).text, "ringserve_prompt_tokens_total") for r in replicas])


async def _post_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[str, list[bytes]]:
    """POST a stream and read it to its end: (X-Message-Id, its SSE blocks)."""
    async with client.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    return resp.headers["X-Message-Id"], [block + b"\n\n" for block in raw.split(b"\n\n")[:-1]]


async def _status_through(client: httpx.AsyncClient, url: str, message_id: str) -> str:
    """The status of another replica's message as the replica at ``url`` reads it, once it can: the
    owner answers 202 before its first flush reaches Redis (a loaded host may take a while), and
    until then the other replica does not know the message (404)."""
    with trio.fail_after(10):
        while (resp := await client.get(f"{url}/v1/messages/{message_id}")).status_code == 404:
            await trio.sleep(0.01)
    assert resp.status_code == 200, resp.text
    return resp.json()["status"]


async def test_idempotent_retries_through_b_follow_the_message_a_generates(tmp_path):
    from ringserve.live.idempotency import KEY_WAIT_SECONDS

    # 300 tokens of 10 ms: each generation is live for about 3 s
    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.01}, reply_bytes=600) as (a, b):
        async with httpx.AsyncClient(timeout=60) as client:
            stream_body = {**ANTHROPIC_BODY, "max_tokens": 400, "stream": True}
            json_body = {**ANTHROPIC_BODY, "max_tokens": 400}

            # A stream started on A and retried through B while A generates: B tails A's log from its start.
            key = {"Idempotency-Key": "k-stream"}
            first = await client.post(f"{a.url}/v1/messages", json=stream_body, headers={**key, **ASYNC})
            assert first.status_code == 202
            message_id = first.json()["id"]
            assert await _status_through(client, b.url, message_id) in ("queued", "generating")
            retried_id, retried = await _post_stream(client, b.url, stream_body, key)
            assert retried_id == message_id
            whole, _ = await _read_blocks(client, f"{a.url}/v1/messages/{message_id}/stream", {}, None)
            assert retried == whole and b"event: message_stop" in whole[-1]  # byte for byte

            # Not a stream: the retry through B waits for A's message to end and answers it.
            key = {"Idempotency-Key": "k-json"}
            first = await client.post(f"{a.url}/v1/messages", json=json_body, headers={**key, **ASYNC})
            message_id = first.json()["id"]
            assert await _status_through(client, b.url, message_id) in ("queued", "generating")
            retry = await client.post(f"{b.url}/v1/messages", json=json_body, headers=key)
            assert retry.status_code == 200 and retry.json()["id"] == message_id
            on_a = (await client.get(f"{a.url}/v1/messages/{message_id}")).json()
            assert on_a["status"] == "complete" and retry.json()["content"][0]["text"] == on_a["text"] != ""
            # The same key with another body, through B: the conflict a single box answers.
            other = await client.post(f"{b.url}/v1/messages", json={**json_body, "max_tokens": 399}, headers=key)
            assert other.status_code == 422 and other.json()["error"]["type"] == "invalid_request_error"

            # Two first attempts at once, one on each replica: one generation, one message id.
            before = await _prompt_tokens(client, a, b)
            small = {**ANTHROPIC_BODY, "max_tokens": 5}
            raced = []
            for attempt in range(5):
                ids: list[str] = []

                async def post(url: str, key: dict[str, str], ids: list[str] = ids) -> None:
                    resp = await client.post(f"{url}/v1/messages", json=small, headers={**key, **ASYNC})
                    assert resp.status_code == 202, resp.text
                    ids.append(resp.json()["id"])

                async with trio.open_nursery() as nursery:
                    for replica in (a, b):
                        nursery.start_soon(post, replica.url, {"Idempotency-Key": f"k-race-{attempt}"})
                assert ids[0] == ids[1]
                raced.append(ids[0])
            with trio.fail_after(KEY_WAIT_SECONDS + 20):
                for message_id in raced:
                    # .get: a 404 until the owner's first flush reaches Redis, like any other status but the end
                    while (status := (await client.get(f"{b.url}/v1/messages/{message_id}")).json()).get("status") != "complete":
                        await trio.sleep(0.05)
            after = await _prompt_tokens(client, a, b)
            assert after - before == 5 * status["usage"]["input_tokens"]  # not 10: each key generated once

            # A's message ends interrupted (A killed while B reads it): a retry through B generates again.
            key = {"Idempotency-Key": "k-crash"}
            crashed_id, got = await _start(client, a.url, headers=key)
            async with client.stream("GET", f"{b.url}/v1/messages/{crashed_id}/stream",
                                     headers=_last_event_id(got[-1])) as resp:
                count = 0
                async for chunk in resp.aiter_raw():
                    count += chunk.count(b"\n\n")
                    if count >= 3 and a.proc.poll() is None:
                        a.proc.send_signal(signal.SIGKILL)
                        a.proc.wait(10)
            assert (await client.get(f"{b.url}/v1/messages/{crashed_id}")).json()["status"] == "interrupted"
            body = {**ANTHROPIC_BODY, "max_tokens": TOKENS + 10, "stream": True}
            new_id, blocks = await _post_stream(client, b.url, body, key)
            assert new_id != crashed_id and b"event: message_stop" in blocks[-1]
            again_id, again = await _post_stream(client, b.url, body, key)
            assert again_id == new_id and again == blocks  # the key names the new message now


async def test_a_json_retry_through_b_of_a_response_generating_on_a_waits_for_its_end(tmp_path):
    """The Responses API follows the one idempotent-retry rule: a JSON retry of a response that
    another replica still generates waits for its end and answers the finished object (it was
    answered at once, ``in_progress``)."""
    # 300 tokens of 10 ms: the first attempt is live on A for about 3 s
    with two_replicas(tmp_path, {"piece_bytes": 2, "step_seconds": 0.01}, reply_bytes=600) as (a, b):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "any", "input": "hello", "max_output_tokens": 400}
            key = {"Idempotency-Key": "k-response"}
            answers: dict[str, httpx.Response] = {}

            async def first() -> None:
                answers["a"] = await client.post(f"{a.url}/v1/responses", json=body, headers=key)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                with trio.fail_after(30):
                    while not _metric((await client.get(f"{a.url}/metrics")).text, "ringserve_active_generations"):
                        await trio.sleep(0.02)
                answers["b"] = await client.post(f"{b.url}/v1/responses", json=body, headers=key)
            on_a, on_b = answers["a"].json(), answers["b"].json()
            assert answers["b"].status_code == 200 and on_b["id"] == on_a["id"], on_b
            assert on_a["status"] == on_b["status"] == "completed"
            assert on_b["output"] == on_a["output"] and on_b["output"][0]["content"][0]["text"] != ""


@pytest.mark.model
async def test_a_real_model_stream_generated_on_a_resumes_on_b_byte_for_byte(tmp_path):
    redis = RedisServer(tmp_path)
    servers: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            config = tmp_path / f"{name}.toml"
            config.write_text(_toml({
                "engine": {"slots": 1, "ctx_per_slot": 1024},
                "model": {"n_threads": MODEL_THREADS},  # two model servers on 2 cores: one thread each
                "stream": {"backend": "redis", "redis_url": redis.url, "flush_tokens": 1},
                "store": {"path": str(tmp_path / f"{name}.sqlite3")},
            }))
            servers.append(ServerProcess([*SERVE, "--config", str(config)]))
        a, b = servers
        # 64 tokens: one event each, more than the 4 resumes below read (at most 8 events each)
        body = {**ANTHROPIC_BODY, "max_tokens": 64, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]}
        async with httpx.AsyncClient(timeout=120) as client:
            message_id, got = await _start(client, a.url, body=body)
            await _drop_and_resume(client, message_id, got, [b.url, a.url, b.url, a.url], random.Random(19))
            whole, _ = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream", {}, None)
        _assert_whole(got, whole)
        assert len(whole) > 10 and b"text_delta" in b"".join(whole)
    finally:
        for server in servers:
            server.stop()
        redis.stop()


async def test_a_json_retry_through_b_of_a_message_that_fails_on_a_gets_its_error_not_a_409(tmp_path):
    # 400 tokens of 10 ms, failing after 200: each generation is live for about 2 s, then fails
    fake = {"piece_bytes": 2, "step_seconds": 0.01, "fail_after_tokens": 200}
    with two_replicas(tmp_path, fake, reply_bytes=800) as (a, b):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**ANTHROPIC_BODY, "max_tokens": 400}
            key = {"Idempotency-Key": "k-fails"}
            first = await client.post(f"{a.url}/v1/messages", json=body, headers={**key, **ASYNC})
            assert first.status_code == 202
            message_id = first.json()["id"]
            answers: dict[str, httpx.Response] = {}

            async def retry(name: str, url: str) -> None:
                answers[name] = await client.post(f"{url}/v1/messages", json=body, headers=key)

            async with trio.open_nursery() as nursery:  # both wait, one on the owner and one through B
                nursery.start_soon(retry, "a", a.url)
                nursery.start_soon(retry, "b", b.url)
            assert (await client.get(f"{a.url}/v1/messages/{message_id}")).json()["status"] == "failed"
            on_a, on_b = answers["a"], answers["b"]
            assert on_a.status_code == 500 and on_a.json()["error"]["type"] == "api_error", on_a.text
            assert (on_b.status_code, on_b.json()) == (on_a.status_code, on_a.json())


async def test_a_claim_whose_first_attempt_never_started_is_taken_over_at_once(tmp_path, monkeypatch):
    """The first attempt on A claims the key, then stops before its message exists (A's store
    fails; the request is cancelled): a retry through B proceeds at once, not after KEY_WAIT_SECONDS."""
    import sqlite3

    import ringserve.live.idempotency as idempotency_module
    import ringserve.live.persist as persist_module
    from ringserve.http.decide import RequestHeaders, Start, admit
    from ringserve.logs.redis import RedisCluster
    from ringserve.surfaces.registry import SURFACES
    from tests.support.server import fake_config, running_server

    monkeypatch.setattr(idempotency_module, "KEY_WAIT_SECONDS", 3600.0)  # a retry that waits for the claim hangs
    monkeypatch.setattr(persist_module, "STORE_RETRY_SECONDS", 0.0)  # A takes the next message after its failure
    redis = RedisServer(tmp_path)
    try:
        configs = [fake_config(tmp_path / name, stream={"backend": "redis", "redis_url": redis.url}) for name in "ab"]
        for config in configs:
            Path(config.store.path).parent.mkdir()
        async with running_server(configs[0]) as a, running_server(configs[1]) as b, \
                httpx.AsyncClient(timeout=30) as client:
            # A's store fails the new row's write: the client gets a 503, the key names nothing
            insert = a.hub.store.insert

            def broken(_row: Any) -> None:
                raise sqlite3.OperationalError("disk I/O error")

            a.hub.store.insert = broken
            key = {"Idempotency-Key": "k-store-failed"}
            refused = await client.post(f"{a.urls[0]}/v1/messages", json=ANTHROPIC_BODY, headers=key)
            assert refused.status_code == 503, refused.text
            a.hub.store.insert = insert
            with trio.fail_after(30):
                retry = await client.post(f"{b.urls[0]}/v1/messages", json=ANTHROPIC_BODY, headers=key)
            assert retry.status_code == 200 and retry.json()["content"][0]["text"], retry.text

            # A's attempt is cancelled (its client gone) right after its claim
            claimed = trio.Event()
            claim = RedisCluster.claim_key

            async def claim_then_hang(cluster: RedisCluster, *args: Any, **kwargs: Any) -> Any:
                holder = await claim(cluster, *args, **kwargs)
                if cluster is a.hub.cluster:
                    claimed.set()
                    await trio.sleep_forever()
                return holder

            monkeypatch.setattr(RedisCluster, "claim_key", claim_then_hang)
            surface = SURFACES.by_name("anthropic")
            raw = json.dumps(ANTHROPIC_BODY).encode()
            start = admit(surface, raw, RequestHeaders(idempotency_key="k-cancelled"), a.config)
            assert isinstance(start, Start)
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def first_attempt() -> None:
                    with scope:
                        await a.hub.create(surface, start.parsed, body_hash=start.body_hash,
                                           request_json=start.request_json, policy=start.policy,
                                           idempotency_key=start.idempotency_key)

                nursery.start_soon(first_attempt)
                await claimed.wait()
                scope.cancel()
            monkeypatch.setattr(RedisCluster, "claim_key", claim)
            with trio.fail_after(30):
                retry = await client.post(f"{b.urls[0]}/v1/messages", json=ANTHROPIC_BODY,
                                          headers={"Idempotency-Key": "k-cancelled"})
            assert retry.status_code == 200 and retry.json()["content"][0]["text"], retry.text
    finally:
        redis.stop()
