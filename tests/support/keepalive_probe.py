"""Does an agent keep waiting through a silent stream that carries a given keepalive?

Usage (from the repository root, after ``npm ci --prefix .ci/agents``)::

    python tests/support/keepalive_probe.py AGENT KEEPALIVE SECONDS [--every S] [--idle-ms MS] [--after N]

AGENT is ``claude`` or ``codex``; KEEPALIVE one of :data:`~tests.support.agent_stub.Keepalive`.
The stub's first model stream opens (``message_start`` / ``response.created``; ``--after N``: its
first N events), then stays silent for SECONDS but for the keepalive every S seconds, then finishes
with a text. The agent waited if
that stream was its only model request; a second one means its idle timer fired and it retried.
``--idle-ms`` sets Codex's ``stream_idle_timeout_ms`` (default 5000) or Claude Code's
``CLAUDE_STREAM_IDLE_TIMEOUT_MS`` (unset by default; Claude Code never goes below 300000).
Prints one JSON line: the agent, the keepalive, the silence, the model requests and their times.
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
from pathlib import Path
from typing import Any, get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.agent_stub import AgentStub, Keepalive, Silence, Text, start  # noqa: E402

BIN = Path(__file__).resolve().parents[2] / ".ci" / "agents" / "node_modules" / ".bin"


def probe(agent: str, keepalive: Keepalive, seconds: float, *, every: float = 1.0, idle_ms: int | None = None,
          after: int = 1) -> dict[str, Any]:
    """Run ``agent`` once against a stub whose first stream goes silent; return what happened (see the module doc)."""
    stub = AgentStub(script=lambda api, body: [Text("Done.")], silence=Silence(seconds, keepalive, every, after))
    server, _ = start(stub)
    scratch = Path(tempfile.mkdtemp(prefix="keepalive-", dir="/var/tmp"))
    (scratch / "home").mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(scratch / "home"), "TERM": "dumb"}
    url = f"http://127.0.0.1:{server.server_port}"
    if agent == "claude":
        env |= {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x", "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        if idle_ms is not None:
            env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] = str(idle_ms)
        argv = [str(BIN / "claude"), "-p", "Say done."]
    else:
        (scratch / "codex").mkdir()
        (scratch / "codex" / "config.toml").write_text(
            'model = "ringserve-model"\nmodel_provider = "stub"\n\n[model_providers.stub]\nname = "stub"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "STUB_API_KEY"\n'
            f"stream_idle_timeout_ms = {idle_ms or 5000}\nstream_max_retries = 1\n")
        env |= {"CODEX_HOME": str(scratch / "codex"), "STUB_API_KEY": "x"}
        argv = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say done."]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=seconds + 900, stdin=subprocess.DEVNULL)
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(scratch)
    model = [r for r in stub.requests if r.path in ("/v1/messages", "/v1/responses")]
    return {
        "agent": agent, "keepalive": keepalive, "silence_s": seconds, "every_s": every, "after_events": after,
        "idle_ms": idle_ms, "exit_status": done.returncode,
        "model_requests_at_s": [round(r.at - started, 1) for r in model],
        "waited": len(model) == 1 and done.returncode == 0, "stdout_tail": done.stdout[-300:], "stderr_tail": done.stderr[-300:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("agent", choices=["claude", "codex"])
    parser.add_argument("keepalive", choices=get_args(Keepalive))
    parser.add_argument("seconds", type=float)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--idle-ms", type=int, default=None)
    parser.add_argument("--after", type=int, default=1, help="events before the silence (0: before the opening event)")
    args = parser.parse_args()
    print(json.dumps(probe(args.agent, args.keepalive, args.seconds, every=args.every, idle_ms=args.idle_ms, after=args.after)))


if __name__ == "__main__":
    main()
