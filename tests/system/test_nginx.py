"""Debian's nginx in front of ringserve, configured with the snippet of docs/nginx.md (timeouts
shortened): tokens arrive unbuffered, a silent prefill longer than proxy_read_timeout survives on
heartbeats, and nginx's default HTTP/1.0 upstream mode ends a stream as soon as it is complete.

.ci/run installs nginx (``apt-get install -y nginx``); the test skips only when no nginx binary
can be found or started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trio

from ringserve.core.sse import ServerSentEvent, SSEParser
from tests.support.helpers import ANTHROPIC_BODY, anthropic_text
from tests.support.server import fake_config, running_server

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install -y nginx)")

READ_TIMEOUT = 2  # seconds; the snippet's 60 s, shortened
PREFILL = 5.0  # seconds of silence before the first token: 2.5 read timeouts


def documented_snippet(doc: str = "nginx.md") -> str:
    """The ```nginx block of ``docs/<doc>``."""
    text = (ROOT / "docs" / doc).read_text()
    return re.search(r"```nginx\n(.*?)```", text, re.DOTALL).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_nginx(tmp_path: Path, upstream_port: int, plain_port: int) -> Iterator[str]:
    """nginx with the documented snippet (upstream ringserve on ``upstream_port``) plus, at
    ``/http10/``, a location in nginx's default upstream mode (HTTP/1.0, no keep-alive) to
    ringserve on ``plain_port``. Yields its base URL."""
    port = _free_port()
    snippet = documented_snippet()
    snippet, n1 = re.subn(r"server 127\.0\.0\.1:8080;", f"server 127.0.0.1:{upstream_port};", snippet)
    snippet, n2 = re.subn(r"listen 80;", f"listen 127.0.0.1:{port};", snippet)
    snippet, n3 = re.subn(r"proxy_read_timeout 60s;", f"proxy_read_timeout {READ_TIMEOUT}s;", snippet)
    assert (n1, n2, n3) == (1, 1, 1), "docs/nginx.md no longer has the lines this test adjusts"
    snippet = snippet.replace(
        "    location / {",
        f"    location /http10/ {{\n        proxy_pass http://127.0.0.1:{plain_port}/;\n"
        f"        proxy_read_timeout {READ_TIMEOUT}s;\n    }}\n\n    location / {{",
        1,
    )
    with start_nginx(tmp_path, snippet, port) as url:
        yield url


@contextmanager
def start_nginx(tmp_path: Path, snippet: str, port: int) -> Iterator[str]:
    """nginx with ``snippet`` (an ``upstream`` and a ``server`` listening on ``port``) as its http
    block, files in ``tmp_path``; skips when nginx cannot start. Yields its base URL."""
    temp = {name: tmp_path / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    user = "user root root;\n" if os.geteuid() == 0 else ""
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {tmp_path}/nginx.pid;\n"
        f"error_log {tmp_path}/error.log info;\nevents {{ worker_connections 64; }}\n"
        "http {\n    access_log off;\n"
        + "".join(f"    {name}_temp_path {path};\n" for name, path in temp.items())
        + snippet
        + "}\n"
    )
    proc = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(200):  # up to 10 s for nginx to listen
            if proc.poll() is not None:
                pytest.skip(f"nginx could not start: {proc.stdout.read()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)  # an external process: poll its port
        else:
            pytest.skip("nginx did not start listening within 10 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.stdout.close()


async def _timed_stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[ServerSentEvent], int, float, float]:
    """Events, pings (the readers' ``: ping`` comments and the producer's ``ping`` keepalive events,
    which come first in a silence), seconds to the first token and to the end."""
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    t0 = trio.current_time()
    first = None
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_raw():
            events += parser.feed(chunk)
            if first is None and any(e.event == "content_block_delta" for e in events):
                first = trio.current_time() - t0
    pings = parser.comments + sum(e.event == "ping" for e in events)
    return events, pings, first, trio.current_time() - t0


async def test_nginx_in_front_streams_unbuffered_and_survives_a_silent_prefill(tmp_path):
    reply = " ".join(f"w{i:02}" for i in range(12))  # 12 tokens of 4 bytes, 0.15 s each
    body = {**ANTHROPIC_BODY, "stream": True}
    (tmp_path / "slow").mkdir()
    (tmp_path / "plain").mkdir()
    slow = fake_config(tmp_path / "slow", server={"heartbeat_interval": 1.0})
    plain = fake_config(tmp_path / "plain")
    results: dict[str, tuple] = {}
    async with (
        running_server(slow, prefill_seconds=PREFILL, step_seconds=0.15, reply=reply) as slow_state,
        running_server(plain, reply=reply) as plain_state,
    ):
        slow_port = int(slow_state.urls[0].rsplit(":", 1)[1])
        plain_port = int(plain_state.urls[0].rsplit(":", 1)[1])
        with run_nginx(tmp_path, slow_port, plain_port) as proxy:
            async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:

                async def through(name: str, url: str) -> None:
                    results[name] = await _timed_stream(client, url, body)

                with trio.fail_after(25):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(through, "proxied", "/v1/messages")
                        nursery.start_soon(through, "http10", "/http10/v1/messages")
    events, pings, first, end = results["proxied"]
    assert events[-1].event == "message_stop"  # the silent prefill did not trip the read timeout
    assert anthropic_text(events) == reply
    assert pings >= PREFILL - 1 - 0.5
    assert first >= PREFILL - 0.5
    assert end - first > 1.0  # tokens came as they were made (12 x 0.15 s), not all at the end
    events, _, _, end = results["http10"]
    assert events[-1].event == "message_stop"
    assert json.loads(events[-2].data)["delta"]["stop_reason"] == "end_turn"
    assert end < READ_TIMEOUT  # ringserve closed the HTTP/1.0 connection when done; nginx did not wait
