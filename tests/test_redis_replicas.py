"""Two ringserve processes (bench/fake_server.py) on one redis-server: a stream generated on A is
read through both replicas with random drops and resumes, and reassembles byte for byte."""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ANTHROPIC_BODY
from tests.redis_server import RedisServer, needs_redis
from tests.test_drain import FakeServerProcess

pytest.importorskip("coredis", reason="the redis extra is not installed (pip install 'ringserve[redis]')")

pytestmark = [needs_redis, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX processes")]

#: Drop/resume cycles (the issue asks for 200; each one is a fresh connection to one of the replicas).
CYCLES = 200
#: Reply tokens: one log entry each (flush_tokens = 1), enough for CYCLES cycles of up to 8 events.
TOKENS = 2000

_ID = re.compile(rb"^id: (\S+):(\d+)$", re.M)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[FakeServerProcess, FakeServerProcess]]:
    redis = RedisServer(tmp_path)
    servers = []
    try:
        for name in ("a", "b"):
            work = tmp_path / name
            work.mkdir()
            sections = {"stream": {"backend": "redis", "redis_url": redis.url, "flush_tokens": 1, "flush_ms": 0.0}}
            servers.append(FakeServerProcess(work, sections, {"piece_bytes": 2, "step_seconds": 0.002},
                                             reply_bytes=2 * TOKENS))
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


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


async def test_a_stream_read_through_both_replicas_with_drops_reassembles_exactly(replicas):
    a, b = replicas
    rng = random.Random(17)
    async with httpx.AsyncClient(timeout=60) as client:
        body = {**ANTHROPIC_BODY, "max_tokens": TOKENS + 10, "stream": True}
        got: list[bytes] = []
        async with client.stream("POST", f"{a.url}/v1/messages", json=body,
                                 headers={"Ringserve-Disconnect-Policy": "continue"}) as resp:
            assert resp.status_code == 200
            message_id = resp.headers["X-Message-Id"]
            buffer = b""
            async for chunk in resp.aiter_raw():
                buffer += chunk
                if b"\n\n" in buffer:
                    got.append(buffer[: buffer.index(b"\n\n") + 2])
                    break
        ended = False
        replica_of = []
        for cycle in range(CYCLES):
            replica = (a, b)[cycle % 2] if rng.random() < 0.5 else rng.choice((a, b))
            replica_of.append(replica is b)
            last = _ID.search(got[-1])
            blocks, ended = await _read_blocks(
                client, f"{replica.url}/v1/messages/{message_id}/stream",
                {"Last-Event-ID": f"{last[1].decode()}:{last[2].decode()}"}, rng.randint(1, 8))
            got += blocks
            if ended:
                break
        assert ended or cycle == CYCLES - 1
        if not ended:
            last = _ID.search(got[-1])
            blocks, _ = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream",
                                           {"Last-Event-ID": f"{last[1].decode()}:{last[2].decode()}"}, None)
            got += blocks
        whole, _ = await _read_blocks(client, f"{b.url}/v1/messages/{message_id}/stream", {}, None)
    seqs = [int(_ID.search(block)[2]) for block in got]
    assert seqs == list(range(len(got))), "a seq was lost or repeated"
    assert b"".join(got) == b"".join(whole)  # byte for byte, the single read through B
    assert b"event: message_stop" in got[-1]
    assert sum(replica_of) >= CYCLES // 4 and len(replica_of) - sum(replica_of) >= CYCLES // 4
    assert len(replica_of) == CYCLES, f"the stream ended after {len(replica_of)} cycles"
