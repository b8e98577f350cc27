"""The ``ringserve chat`` and ``ringserve tail`` commands (``ringserve/client/cli.py``) in a subprocess,
against an in-process server (fake engine) behind the dropping proxy."""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from ringserve.client import AsyncClient
from tests.support.helpers import ANTHROPIC_BODY
from tests.support.proxy import REPLY, Cut, random_cuts, server_and_proxy
from tests.support.server import fake_config, running_server


def ringserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ringserve", *args]


@pytest.mark.parametrize(("surface", "stop"), [("anthropic", "end_turn"), ("openai", "stop"),
                                              ("responses", "completed")])
async def test_chat_streams_the_reply_through_drops(tmp_path: Path, surface: str, stop: str) -> None:
    rng = random.Random(5)
    async with server_and_proxy(tmp_path, random_cuts(rng, max_bytes=2500)) as (_state, proxy):
        done = await trio.run_process(ringserve_cmd("chat", "--url", proxy.url, "--surface", surface,
                                                    "--max-tokens", "400", "hi"),
                                      capture_stdout=True, capture_stderr=True, check=False)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    assert stdout == REPLY + "\n"
    assert "reconnecting in" in stderr and f"{stop}," in stderr


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


@pytest.mark.parametrize("command", [("chat", "hi"), ("tail", "msg_x")])
def test_nothing_listening_is_one_line_at_once(command: tuple[str, str]) -> None:
    """Not 8 retries over 33 s with nothing said of why (the client's NoServer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    done = subprocess.run(ringserve_cmd(command[0], "--url", url, command[1]), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"ringserve: nothing listens at {url} (connection refused): start the server"
                           " (ringserve serve), or give its URL (--url or $RINGSERVE_URL)\n")


@pytest.mark.parametrize("command", [("chat", "hi"), ("tail", "msg_x")])
async def test_a_refused_key_is_one_line_naming_the_flag(tmp_path: Path, command: tuple[str, str]) -> None:
    """Not the surface's raw 401 (``HTTP 401 authentication_error: ...``), after a blank line."""
    async with running_server(fake_config(tmp_path, auth={"api_keys": ["k-1"]})) as state:
        url = state.urls[0]
        said = []
        for key in ((), ("--api-key", "k-2")):
            done = await trio.run_process(ringserve_cmd(command[0], "--url", url, *key, command[1]),
                                          capture_stdout=True, capture_stderr=True, check=False)
            said.append((done.returncode, done.stdout.decode(), done.stderr.decode()))
    assert said == [
        (1, "", f"ringserve: {url} wants an API key: give --api-key or set RINGSERVE_API_KEY\n"),
        (1, "", f"ringserve: {url} refused the API key (--api-key or $RINGSERVE_API_KEY): give one of the "
                "server's keys\n"),
    ]
