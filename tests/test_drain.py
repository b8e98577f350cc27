"""A real server process on the fake engine (bench/fake_server.py): SIGTERM drain, a second signal,
and a client that stops reading (server memory bounded, reader dropped, shutdown still prompt)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ringserve.core.sse import ServerSentEvent, SSEParser
from ringserve.server import DRAIN_FLUSH_SECONDS
from tests.conftest import ServerProcess
from tests.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and sends POSIX signals")


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())
        for name, table in sections.items()
    )


class FakeServerProcess(ServerProcess):
    """``bench/fake_server.py`` with a config built from ``sections``; keeps reading its log."""

    def __init__(self, tmp_path: Path, sections: dict[str, dict[str, Any]], fake: dict[str, Any],
                 reply_bytes: int | None = None) -> None:
        self.store = tmp_path / "store.sqlite3"
        sections = {**sections, "server": {"port": 0, **sections.get("server", {})},
                    "store": {"path": str(self.store)}}
        config = tmp_path / "config.toml"
        config.write_text(_toml(sections))
        args = ["--config", str(config), "--fake", json.dumps(fake)]
        if reply_bytes is not None:
            args += ["--reply-bytes", str(reply_bytes)]
        super().__init__(args, env={"PYTHONPATH": str(ROOT)}, command=[sys.executable, str(ROOT / "bench" / "fake_server.py")])
        self._changed = threading.Condition()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for_log(self, pattern: str, timeout: float) -> str:
        """The first log line matching ``pattern`` (blocking; run it in a thread from Trio)."""
        with self._changed:
            for _ in range(2):
                found = next((line for line in self.lines if re.search(pattern, line)), None)
                if found is not None or not self._changed.wait_for(
                    lambda: any(re.search(pattern, line) for line in self.lines), timeout
                ):
                    break
            if found is None:
                found = next((line for line in self.lines if re.search(pattern, line)), None)
        assert found is not None, f"no log line matches {pattern!r}:\n" + "".join(self.lines)
        return found

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib * 1024

    async def exit_code(self, timeout: float) -> tuple[int, float]:
        """Wait for the process to exit: its exit code and how long that took (seconds)."""
        t0 = time.monotonic()
        try:
            code = await trio.to_thread.run_sync(lambda: self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not exit within {timeout} s:\n" + "".join(self.lines)) from None
        return code, time.monotonic() - t0

    def rows(self) -> dict[str, sqlite3.Row]:
        db = sqlite3.connect(self.store)
        db.row_factory = sqlite3.Row
        try:
            return {row["id"]: row for row in db.execute("SELECT * FROM messages")}
        finally:
            db.close()


def _stuck_client(url: str, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """A client that sends a streaming request, reads the head, and never reads again (tiny window)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # byte by byte: nothing of the body is read
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock, head


def _message_id(head: bytes) -> str:
    return re.search(rb"x-message-id: (\S+)", head, re.IGNORECASE).group(1).decode()


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], first: trio.Event,
                  out: dict[str, Any]) -> None:
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    out["events"] = events
    try:
        async with client.stream("POST", url, json=body) as resp:
            out["id"] = resp.headers["x-message-id"]
            async for chunk in resp.aiter_raw():
                events += parser.feed(chunk)
                if any(e.event == "content_block_delta" or '"content"' in e.data for e in events):
                    first.set()
    except (httpx.RemoteProtocolError, httpx.ReadError):
        out["cut"] = True  # the connection ended without the end of the body


def _ended_with(surface: str, events: list[ServerSentEvent]) -> str:
    """``complete``, ``retryable`` (an in-band error a client retries) or ``truncated``."""
    last = events[-1]
    if surface == "anthropic":
        if last.event == "message_stop":
            return "complete"
        if last.event == "error" and json.loads(last.data)["error"]["type"] == "overloaded_error":
            return "retryable"
    else:
        if last.data == "[DONE]":
            return "complete"
        if "error" in json.loads(last.data) and "[DONE]" not in [e.data for e in events]:
            return "retryable"
    return "truncated"


REPLY_BYTES = 2 * 1024 * 1024  # 8192 tokens of 256 bytes: several seconds at >= 1 ms a step
FAKE = {"piece_bytes": 256, "step_seconds": 0.001}


async def test_sigterm_drains_streams_in_flight_and_exits_0(tmp_path):
    """SIGTERM with streams in flight: each gets its complete answer or a retryable in-band error (never a
    fake message_stop), new requests get 503/529 meanwhile, the store is right, a client that stopped
    reading does not hold the exit up, and the exit code is 0."""
    drain_timeout = 3.0
    server = FakeServerProcess(tmp_path, {"server": {"drain_timeout": drain_timeout, "slow_reader_timeout": 60.0},
                                          "engine": {"ctx_per_slot": 20000, "slots": 4}}, FAKE, REPLY_BYTES)
    try:
        streams = {  # name: (surface, route, body)
            "finishes": ("anthropic", "/v1/messages", {**ANTHROPIC_BODY, "stream": True, "max_tokens": 200}),
            "long-anthropic": ("anthropic", "/v1/messages", {**ANTHROPIC_BODY, "stream": True, "max_tokens": 12000}),
            "long-openai": ("openai", "/v1/chat/completions", {**OPENAI_BODY, "stream": True, "max_tokens": 12000}),
        }
        out: dict[str, dict[str, Any]] = {name: {} for name in streams}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            stuck, _ = _stuck_client(server.url, {**ANTHROPIC_BODY, "stream": True, "max_tokens": 12000})
            with stuck, trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    firsts = []
                    for name, (_surface, route, body) in streams.items():
                        firsts.append(trio.Event())
                        nursery.start_soon(_stream, client, route, body, firsts[-1], out[name])
                    for first in firsts:
                        await first.wait()
                    server.proc.send_signal(signal.SIGTERM)
                    await trio.to_thread.run_sync(server.wait_for_log, "draining", 5)
                    refused = await client.post("/v1/messages", json=ANTHROPIC_BODY)
                    refused_openai = await client.post("/v1/chat/completions", json=OPENAI_BODY)
                    ready = await client.get("/ready")
                code, took = await server.exit_code(drain_timeout + DRAIN_FLUSH_SECONDS + 8)
    finally:
        server.stop()
    assert code == 0
    assert took < drain_timeout + 2 * DRAIN_FLUSH_SECONDS + 3
    assert refused.status_code in (503, 529) and refused.json()["error"]["type"] == "overloaded_error"
    assert refused.headers["retry-after"]
    assert refused_openai.status_code == 503 and refused_openai.headers["retry-after"]
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert any("reset 1 connection" in line for line in server.lines)

    rows = server.rows()
    ended = {}
    for name, (surface, _route, _body) in streams.items():
        events = out[name]["events"]
        ended[name] = _ended_with(surface, events)
        row = rows[out[name]["id"]]
        text = anthropic_text(events) if surface == "anthropic" else openai_text(events[:-1])
        assert row["text"] == text, name  # the stored text is what the client got
        if ended[name] == "complete":
            assert row["status"] == "complete"
        else:
            assert row["status"] == "interrupted" and "shutting down" in row["error"]
    assert ended == {"finishes": "complete", "long-anthropic": "retryable", "long-openai": "retryable"}
    assert all(row["status"] in ("complete", "interrupted") for row in rows.values())  # the stuck one too


async def test_second_signal_exits_at_once(tmp_path):
    server = FakeServerProcess(tmp_path, {"server": {"drain_timeout": 30.0}, "engine": {"ctx_per_slot": 20000}},
                               FAKE, REPLY_BYTES)
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    first = trio.Event()
                    nursery.start_soon(_stream, client, "/v1/messages",
                                       {**ANTHROPIC_BODY, "stream": True, "max_tokens": 12000}, first, out)
                    await first.wait()
                    server.proc.send_signal(signal.SIGTERM)
                    await trio.to_thread.run_sync(server.wait_for_log, "draining", 5)
                    server.proc.send_signal(signal.SIGINT)
                    code, took = await server.exit_code(10)
    finally:
        server.stop()
    assert code == 1 and took < 3.0
    assert _ended_with("anthropic", out["events"]) in ("retryable", "truncated")
    assert out["events"][-1].event != "message_stop"
    row = server.rows()[out["id"]]
    assert row["status"] == "interrupted" and "shutting down" in row["error"]


async def test_non_reading_client_is_dropped_and_cannot_grow_memory_or_block_shutdown(tmp_path):
    """A client that stops reading: the generation finishes regardless, the server's peak RSS is that of
    a reader keeping up (the ring is 1 MiB, the answer 16 MiB), the reader is dropped after slow_reader_timeout and counted, and SIGTERM
    still ends the server within drain_timeout + a few seconds."""
    reply_bytes = 16 * 1024 * 1024
    body = {**ANTHROPIC_BODY, "stream": True, "max_tokens": 10000}
    server = FakeServerProcess(
        tmp_path,
        {"server": {"slow_reader_timeout": 4.0, "drain_timeout": 2.0}, "engine": {"ctx_per_slot": 20000},
         "stream": {"ring_max_bytes": 1024 * 1024}},
        {"piece_bytes": 4096, "step_seconds": 0.0003}, reply_bytes,  # ~8 MB/s: a reading client keeps up
    )
    peaks: list[int] = []

    async def sample_rss(task_status: trio.TaskStatus[None]) -> None:
        peaks.append(server.rss_bytes())
        task_status.started()
        while True:
            await trio.sleep(0.02)
            peaks[-1] = max(peaks[-1], server.rss_bytes())

    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(2):  # a reader that keeps up; the second run's peak is the reference
                async with trio.open_nursery() as nursery:
                    await nursery.start(sample_rss)
                    async with client.stream("POST", "/v1/messages", json=body) as resp:
                        received = sum([len(chunk) async for chunk in resp.aiter_raw()])
                    nursery.cancel_scope.cancel()
                assert received > reply_bytes
            stuck, head = _stuck_client(server.url, body)
            with stuck:
                async with trio.open_nursery() as nursery:
                    await nursery.start(sample_rss)
                    dropped = await trio.to_thread.run_sync(server.wait_for_log, "dropping a slow reader", 10)
                    nursery.cancel_scope.cancel()
                with contextlib.suppress(ConnectionResetError):  # the connection ends: EOF or reset
                    while stuck.recv(1 << 20):
                        pass
            # It finished while its only reader was stuck (after the drop, policy abort would have cancelled it).
            status = (await client.get(f"/v1/messages/{_message_id(head)}")).json()
            assert status["status"] == "complete" and status["usage"]["output_tokens"] == reply_bytes // 4096 + 1
            metrics = (await client.get("/metrics")).text
            # One more, stuck while the server shuts down (400 KiB of answer fills its window).
            stuck, _ = _stuck_client(server.url, {**body, "max_tokens": 100})
            with stuck:
                server.proc.send_signal(signal.SIGTERM)
                code, took = await server.exit_code(15)
    finally:
        server.stop()
    assert code == 0 and took < 2.0 + 2 * DRAIN_FLUSH_SECONDS + 2
    assert "write blocked" in dropped
    assert re.search(r'^ringserve_slow_reader_disconnects_total\{reason="blocked"\} 1\.0$', metrics, re.MULTILINE), metrics
    _, reading, stuck_peak = peaks
    assert stuck_peak - reading < 8 * 1024 * 1024, peaks  # nothing buffers the 16 MiB for the stuck reader
