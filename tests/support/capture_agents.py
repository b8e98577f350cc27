"""Drive the pinned Claude Code and Codex CLI against the recording stub and save every request.

Usage (from the repository root, after ``npm ci --prefix .ci/agents``)::

    python tests/support/capture_agents.py [--out tests/data/agents] [--only RUN ...]

Each run starts an :class:`~tests.support.agent_stub.AgentStub`, runs one agent once in a fresh
scratch folder (its own HOME, and CODEX_HOME for Codex) and writes ``<run>.jsonl``: one request a
line (``t``, seconds since the run's first request; method, path, query, headers, body) in arrival
order. ``runs.json`` says, per run, the
agent's version, its command line and settings, the stub's script, the exit status, the files the
agent's tools wrote and what they hold. The scratch folder's path is replaced by ``/SCRATCH`` and
the stub's port by ``PORT`` in everything saved.

The scratch folders live under ``/var/tmp`` (``--scratch``): Codex refuses to put its helper
links under ``/tmp``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.agent_stub import AgentStub, Call, Custom, Step, Text, start, stepped  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".ci" / "agents" / "node_modules" / ".bin"
PROMPT = "Write hi to f.txt with the shell, then create g.txt, then say done."
#: Apply_patch's input for Codex's second step (its own format: codex-rs/apply-patch).
PATCH = "*** Begin Patch\n*** Add File: g.txt\n+written by apply_patch\n*** End Patch\n"


@attrs.frozen
class Run:
    """One agent run: which agent, its arguments, environment and config, and the stub's behaviour."""

    name: str
    agent: str  # "claude" or "codex"
    about: str
    steps: Callable[[Path], Sequence[Step]]
    args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.Factory(dict)
    codex_model: str = "ringserve-model"
    codex_root: str = ""  # config.toml keys at the root (before the provider's table)
    codex_toml: str = ""  # config.toml keys in the provider's table
    fail_first: tuple[int, ...] = ()
    drop_streams: int = 0
    mcp: bool = False  # Claude Code gets tests/support/mcp_inventory.py as an MCP server


def claude_steps(work: Path) -> Sequence[Step]:
    return [
        Call("Bash", {"command": "echo hi > f.txt", "description": "Write hi to f.txt"}),
        Call("Write", {"file_path": str(work / "g.txt"), "content": "written by Write\n"}),
        Text("Done: f.txt and g.txt are written."),
    ]


def claude_bare_steps(work: Path) -> Sequence[Step]:
    """Under ``--bare`` Claude Code offers Bash, Edit and Read (no Write)."""
    return [
        Call("Bash", {"command": "echo hi > f.txt", "description": "Write hi to f.txt"}),
        Call("Read", {"file_path": str(work / "f.txt")}),
        Text("Done: f.txt is written."),
    ]


def codex_exec_steps(work: Path) -> Sequence[Step]:
    return [Call("exec_command", {"cmd": "echo hi > f.txt"}), Text("Done: f.txt is written.")]


def codex_patch_steps(work: Path) -> Sequence[Step]:
    return [Call("exec_command", {"cmd": "echo hi > f.txt"}), Custom("apply_patch", PATCH), Text("Done: f.txt and g.txt are written.")]


def claude_mcp_steps(work: Path) -> Sequence[Step]:
    return [
        Call("ToolSearch", {"query": "select:mcp__inventory__lookup_3"}),
        Call("mcp__inventory__lookup_3", {"id": "a1"}),
        Text("Done: record a1 found."),
    ]


def text_only(work: Path) -> Sequence[Step]:
    return [Text("Done.")]


CLAUDE_ARGS = ("--allowedTools", "Bash", "Write")
CODEX_ARGS = ("--dangerously-bypass-approvals-and-sandbox",)

RUNS = [
    Run("claude_default", "claude", "default model and settings; Bash, Write, then text", claude_steps, CLAUDE_ARGS),
    Run("claude_bare", "claude", "--bare (default model; tools Bash, Edit, Read): its per-turn control message has no content",
        claude_bare_steps, ("--bare", "--allowedTools", "Bash", "Read")),
    Run("claude_sonnet", "claude", "--model sonnet", claude_steps, (*CLAUDE_ARGS, "--model", "sonnet")),
    Run("claude_haiku", "claude", "--model haiku", claude_steps, (*CLAUDE_ARGS, "--model", "haiku")),
    Run("claude_custom_model", "claude", "--model ringserve-model (a name Claude Code does not know)", claude_steps,
        (*CLAUDE_ARGS, "--model", "ringserve-model")),
    Run("claude_thinking_off", "claude", "CLAUDE_CODE_DISABLE_THINKING=1", claude_steps, CLAUDE_ARGS,
        env={"CLAUDE_CODE_DISABLE_THINKING": "1"}),
    Run("claude_sonnet45", "claude", "--model claude-sonnet-4-5-20250929 (thinking enabled with budget_tokens, no effort)",
        claude_steps, (*CLAUDE_ARGS, "--model", "claude-sonnet-4-5-20250929")),
    Run("claude_mcp_tool_search", "claude", "an MCP server of 40 tools (deferred); ToolSearch, the MCP tool, then text",
        claude_mcp_steps, ("--allowedTools", "ToolSearch", "mcp__inventory"), mcp=True),
    Run("claude_retries", "claude", "the stub answers 529, 500, 429, then drops one stream after message_start",
        text_only, CLAUDE_ARGS, fail_first=(529, 500, 429), drop_streams=1),
    Run("codex_custom_model", "codex", "model = ringserve-model (no bundled metadata); exec_command, then text",
        codex_exec_steps, CODEX_ARGS),
    Run("codex_gpt55", "codex", "model = gpt-5.5 (bundled metadata: freeform apply_patch); exec_command, apply_patch, text",
        codex_patch_steps, CODEX_ARGS, codex_model="gpt-5.5"),
    Run("codex_reasoning", "codex", "model_reasoning_effort = high, model_reasoning_summary = detailed; exec_command, text",
        codex_exec_steps, CODEX_ARGS, codex_root='model_reasoning_effort = "high"\nmodel_reasoning_summary = "detailed"\n'),
    Run("codex_retries", "codex", "the stub answers 500, 503, then drops one stream after response.created",
        text_only, CODEX_ARGS, fail_first=(500, 503), drop_streams=1),
    Run("codex_429", "codex", "the stub answers 429 once (request_max_retries = 1)", text_only, CODEX_ARGS,
        fail_first=(429,), codex_toml="request_max_retries = 1\n"),
]


def codex_config(run: Run, port: int) -> str:
    """CODEX_HOME/config.toml: the stub as a Responses provider (root keys before tables)."""
    return (
        f'model = "{run.codex_model}"\nmodel_provider = "stub"\n{run.codex_root}\n[model_providers.stub]\nname = "stub"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\nwire_api = "responses"\nenv_key = "STUB_API_KEY"\n{run.codex_toml}'
    )


def version(agent: str) -> str:
    return subprocess.run([str(BIN / agent), "--version"], capture_output=True, text=True, check=True).stdout.strip()


def capture(run: Run, out: Path, scratch_base: Path) -> dict[str, Any]:
    """Run ``run`` once; write ``out/<name>.jsonl``; return its entry for ``runs.json``."""
    scratch = Path(tempfile.mkdtemp(prefix="agent-", dir=scratch_base))
    home, work = scratch / "home", scratch / "work"
    home.mkdir()
    work.mkdir()
    stub = AgentStub(script=stepped(run.steps(work)), fail_first=list(run.fail_first), drop_streams=run.drop_streams)
    server, _ = start(stub)
    port = server.server_port
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "LANG": "C.UTF-8", **run.env}
    config = ""
    if run.agent == "claude":
        env |= {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": "x", "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        argv = [str(BIN / "claude"), "-p", PROMPT, *run.args]
        if run.mcp:
            server_command = {"command": sys.executable, "args": [str(Path(__file__).with_name("mcp_inventory.py")), "40"]}
            (scratch / "mcp.json").write_text(json.dumps({"mcpServers": {"inventory": server_command}}))
            argv += ["--mcp-config", str(scratch / "mcp.json")]
    else:
        codex_home = scratch / "codex"
        codex_home.mkdir()
        config = codex_config(run, port)
        (codex_home / "config.toml").write_text(config)
        env |= {"CODEX_HOME": str(codex_home), "STUB_API_KEY": "x"}
        argv = [str(BIN / "codex"), "exec", "--skip-git-repo-check", *run.args, PROMPT]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    finally:
        server.shutdown()
        server.server_close()
    elapsed = time.monotonic() - started

    def scrub(text: str) -> str:
        return text.replace(str(scratch), "/SCRATCH").replace(f"127.0.0.1:{port}", "127.0.0.1:PORT")

    with open(out / f"{run.name}.jsonl", "w") as f:
        for entry in stub.requests:
            line = {"t": round(entry.at - stub.requests[0].at, 3), **entry.to_json()}
            f.write(scrub(json.dumps(line, ensure_ascii=False)) + "\n")
    files = {p.name: p.read_text() for p in sorted(work.iterdir()) if p.is_file()}
    entry = {
        "run": run.name,
        "agent": run.agent,
        "version": version(run.agent),
        "about": run.about,
        "argv": [scrub(a) for a in [Path(argv[0]).name, *argv[1:]]],
        "mcp_server": "tests/support/mcp_inventory.py 40" if run.mcp else None,
        "env": {k: scrub(v) for k, v in env.items() if k not in ("PATH", "TERM", "LANG")},
        "codex_config": scrub(config) or None,
        "stub": {"fail_first": list(run.fail_first), "drop_streams": run.drop_streams,
                 "steps": [attrs.asdict(s) | {"kind": type(s).__name__} for s in run.steps(Path("/SCRATCH/work"))]},
        "exit_status": done.returncode,
        "seconds": round(elapsed, 1),
        "requests": len(stub.requests),
        "files": files,
        "stdout_tail": scrub(done.stdout[-800:]),
        "stderr_tail": scrub(done.stderr[-800:]),
    }
    shutil.rmtree(scratch)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "agents")
    parser.add_argument("--scratch", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    index_path = args.out / "runs.json"
    index = {e["run"]: e for e in json.loads(index_path.read_text())} if index_path.exists() else {}
    for run in RUNS:
        if args.only and run.name not in args.only:
            continue
        entry = capture(run, args.out, args.scratch)
        index[run.name] = entry
        print(f"{run.name}: exit {entry['exit_status']}, {entry['requests']} requests, files {sorted(entry['files'])}, "
              f"{entry['seconds']} s", flush=True)
    order = [r.name for r in RUNS]
    index_path.write_text(json.dumps(sorted(index.values(), key=lambda e: order.index(e["run"])), indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
