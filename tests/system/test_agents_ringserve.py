"""The pinned agents against ringserve itself, on the fake engine (issue 33, "Proof (CI)").

Claude Code runs ``claude -p`` against an in-process ringserve whose fake engine answers every
prompt with one reply; its slots are large enough for Claude Code's prompt (about 50,000 fake
tokens: a byte each). A plain turn must complete: its request accepted whole (thinking, effort,
context management, deferred tools, the mid-conversation system message), the stream read by
Claude Code's own parser, the reply printed. (The tool turns need a scripted engine: later.)

Skipped where the agents are not installed (``npm ci --prefix .ci/agents``).
"""

from __future__ import annotations

import os

import pytest
import trio

from tests.support.capture_agents import BIN
from tests.support.server import fake_config, running_server

pytestmark = pytest.mark.skipif(not (BIN / "claude").exists(),
                                reason="the agents are not installed: npm ci --prefix .ci/agents")

REPLY = "Hi from ringserve!"


async def test_claude_code_completes_a_plain_turn(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    config = fake_config(tmp_path, engine={"ctx_per_slot": 131072, "slots": 2})
    with trio.fail_after(240):
        async with running_server(config, reply=REPLY, piece_bytes=3) as state:
            env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "LANG": "C.UTF-8",
                   "ANTHROPIC_BASE_URL": state.urls[0], "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "0"}
            done = await trio.run_process([str(BIN / "claude"), "-p", "Say hi"], cwd=work, env=env,
                                          capture_stdout=True, capture_stderr=True, check=False,
                                          stdin=b"")
            statistics = state.hub.runner.statistics()
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (out, err)
    assert out.strip() == REPLY, (out, err)
    assert statistics.generated_tokens_total > 0
