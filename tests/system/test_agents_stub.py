"""The pinned agents against the recording stub: they run their tools, and their idle timers read
keepalives as docs/agents.md says (Codex only: Claude Code's timer is 300 s at the least).

Skipped where the agents are not installed (``npm ci --prefix .ci/agents``).
"""

from __future__ import annotations

import json

import pytest

from tests.support.capture_agents import BIN, RUNS, capture
from tests.support.keepalive_probe import probe

pytestmark = pytest.mark.skipif(not (BIN / "claude").exists() or not (BIN / "codex").exists(),
                                reason="the agents are not installed: npm ci --prefix .ci/agents")

RUN = {run.name: run for run in RUNS}


@pytest.mark.parametrize(("name", "files"), [
    ("claude_default", {"f.txt": "hi\n", "g.txt": "written by Write\n"}),
    ("codex_gpt55", {"f.txt": "hi\n", "g.txt": "written by apply_patch\n"}),
])
def test_agents_run_their_tools_for_real_then_finish_with_text(tmp_path, name, files):
    entry = capture(RUN[name], tmp_path, tmp_path)
    assert entry["exit_status"] == 0, entry["stderr_tail"]
    assert entry["files"] == files
    assert entry["requests"] == 3  # one request per turn: two tool turns, then the text
    assert "Done" in entry["stdout_tail"]
    requests = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert all(r["method"] == "POST" for r in requests)


@pytest.mark.parametrize(("keepalive", "waited"), [("in_progress", True), ("unknown", True), ("comment", False), ("none", False)])
def test_codex_idle_timer_counts_data_events_not_comments(keepalive, waited):
    result = probe("codex", keepalive, 6.0, every=0.5, idle_ms=2000)
    assert result["exit_status"] == 0, result["stderr_tail"]
    assert result["waited"] is waited, result
