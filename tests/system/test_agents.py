"""The pinned agents against ringserve, started with ``ringserve launch``, run their own tools for
real in a scratch folder and finish with text (issue 33, "Proof (CI)"; issue 36, item 7).

The model is the fake engine playing a script of model text, a turn per generation, its calls
in the generic ``<tool_call>`` syntax, which the runner's real parsers read: Codex CLI runs
``exec_command`` (a function), then its freeform ``apply_patch`` (a ``custom`` tool, which Codex
offers because ``ringserve launch`` gives it a model catalog; its call comes back as a
``custom_tool_call``), then says it is done; Claude Code runs ``Bash``, then ``Write``, then says
it is done. The files the tools wrote are checked.

Each first prompt takes 9 s to prefill, three times Codex's idle timer set here to 3 s (its
default is 300 s; it counts data events only, not SSE comments) with its stream retries off, so
that the turn fails unless the stream's keepalive events (``response.in_progress`` again, every
``heartbeat_interval`` = 1 s) keep it waiting; Claude Code (whose timer cannot go under 300 s:
docs/agents.md) reads the same silence broken by ``event: ping`` with its own parser.
``tests/live/test_hub.py`` plays a 400 s silence on the autojump clock.

Skipped where the agents are not installed (``npm ci --prefix .ci/agents``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from ringserve.core.toolcalls import format_call
from ringserve.engine.fake import FakeEngine
from tests.support.capture_agents import BIN
from tests.support.server import fake_config, running_server

pytestmark = pytest.mark.skipif(not (BIN / "claude").exists() or not (BIN / "codex").exists(),
                                reason="the agents are not installed: npm ci --prefix .ci/agents")

PROMPT = "Write hi to f.txt with the shell, then create g.txt, then say done."
PATCH = "*** Begin Patch\n*** Add File: g.txt\n+written by apply_patch\n*** End Patch\n"
#: Per slot: Claude Code's first prompt is about 50,000 fake tokens (a byte each), Codex's 45,000.
CTX = 131072
#: Seconds the first prompt of each run takes to prefill (the turns after it come from the cache).
PREFILL_SECONDS = 9.0
CODEX_IDLE_MS = 3000


def script(*turns: str) -> Callable[[str], str]:
    """The model's turns in order, one per generation (the last one again past the end)."""
    played = iter(turns)
    last = turns[-1]

    def reply(_last_user_text: str) -> str:
        return next(played, last)

    return reply


def scripted_server(tmp_path: Path, reply: Callable[[str], str]) -> tuple[object, list[FakeEngine]]:
    """An in-process server whose fake engine plays ``reply`` (its calls as written, also under a
    lazy grammar), each first prompt prefilled for :data:`PREFILL_SECONDS`, a keepalive every second
    of silence; and the list that will hold its engine."""
    engines: list[FakeEngine] = []

    def factory(_config: object) -> FakeEngine:
        engines.append(FakeEngine(n_slots=2, n_ctx_slot=CTX, piece_bytes=8, reply=reply,
                                  prefill_seconds=PREFILL_SECONDS, grammar_examples=False))
        return engines[0]

    config = fake_config(tmp_path, engine={"ctx_per_slot": CTX, "slots": 2}, server={"heartbeat_interval": 1.0})
    return running_server(config, engine_factory=factory), engines


async def launch(agent: str, url: str, scratch: Path, agent_args: list[str],
                 extra_env: dict[str, str] | None = None) -> trio.CompletedProcess[bytes]:
    """``ringserve launch AGENT --url URL -- AGENT_ARGS`` in ``scratch/work``, with its own HOME."""
    home, work = scratch / "home", scratch / "work"
    home.mkdir()
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": str(home),
           "TERM": "dumb", "LANG": "C.UTF-8",
           "CODEX_HOME": str(home / ".codex"), **(extra_env or {})}
    (home / ".codex").mkdir()
    argv = [sys.executable, "-m", "ringserve", "launch", agent, "--url", url, "--", *agent_args]
    with trio.fail_after(240):
        return await trio.run_process(argv, cwd=work, env=env, capture_stdout=True, capture_stderr=True,
                                      check=False, stdin=b"")


async def test_codex_runs_exec_command_and_apply_patch_through_a_silence_then_says_done(tmp_path):
    """Codex through ``ringserve launch`` (its catalog makes it offer apply_patch): three turns,
    one generation each, the first after 9 s of prefill that its 3 s idle timer (no stream
    retries) sits through on keepalives; both files written by its tools."""
    reply = script(format_call("exec_command", json.dumps({"cmd": "echo hi > f.txt"})),
                   format_call("apply_patch", json.dumps({"input": PATCH})),
                   "Done: f.txt and g.txt are written.")
    server, engines = scripted_server(tmp_path, reply)
    scratch = Path(tempfile.mkdtemp(prefix="ringserve-codex-", dir="/var/tmp"))  # Codex refuses helpers under /tmp
    try:
        async with server as state:
            done = await launch("codex", state.urls[0], scratch, [
                "-c", f"model_providers.ringserve.stream_idle_timeout_ms={CODEX_IDLE_MS}",
                "-c", "model_providers.ringserve.stream_max_retries=0",
                "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT])
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, (out[-2000:], err[-3000:])
        files = {p.name: p.read_text() for p in (scratch / "work").iterdir() if p.is_file()}
        assert files == {"f.txt": "hi\n", "g.txt": "written by apply_patch\n"}, (files, err[-3000:])
        assert "Done" in out and "idle timeout" not in err, (out, err[-3000:])
        assert len(engines[0].begins) == 3
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def test_claude_code_runs_bash_and_write_through_a_silence_then_says_done(tmp_path):
    """Claude Code through ``ringserve launch``: three turns, one generation each (no retry, no
    non-streaming fallback), the first after 9 s of prefill broken by ``event: ping``."""
    scratch = tmp_path / "claude"
    scratch.mkdir()
    work = scratch / "work"
    reply = script(format_call("Bash", json.dumps({"command": "echo hi > f.txt", "description": "Write hi"})),
                   format_call("Write", json.dumps({"file_path": str(work / "g.txt"), "content": "written by Write\n"})),
                   "Done: f.txt and g.txt are written.")
    server, engines = scripted_server(tmp_path, reply)
    async with server as state:
        done = await launch("claude", state.urls[0], scratch, ["-p", PROMPT, "--allowedTools", "Bash", "Write"],
                            {"CLAUDE_CODE_MAX_RETRIES": "0"})
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    files = {p.name: p.read_text() for p in work.iterdir() if p.is_file()}
    assert files == {"f.txt": "hi\n", "g.txt": "written by Write\n"}, (files, out[-2000:])
    assert "Done" in out, out
    assert len(engines[0].begins) == 3
