"""The CPU time of rendering a chat template, per template of llama.cpp's corpus, in two source trees.

``python bench/template_render.py [--tree DIR ...] [--templates DIR] [--turns 100] [--tools 1] [--rounds 3]``

Renders one request with every template of llama.cpp's ``models/templates`` (``--templates``; by
default the test suite's copy from the llama-cpp-python sdist) through ``ChatTemplate.render``
of each source tree (default: this checkout; give another checkout of ringserve, a ``git
worktree`` of an older commit say, to compare): a system turn, then ``--turns`` times a user
turn, an assistant turn with reasoning and a call, its result and an answer (about 4,400
characters a turn), and Claude Code's 12 tools (``tests/data/agents/claude_default.jsonl``)
``--tools`` times over. Each tree renders in a process of its own, the trees interleaved in every
round; the figure is the least CPU time (not wall time: other load changes it less) of 10
renders, and the ratio is per template against the first tree, the median of the rounds.
This is what the render bounds of issue 43 (``formats/template/bounds.py``) cost.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "data" / "agents" / "claude_default.jsonl"


def _request(turns: int, tool_copies: int) -> tuple[list[Any], list[Any]]:
    from ringserve.core.events import ChatMessage, Role, ToolCall, ToolSpec

    body = next(r["body"] for r in map(json.loads, AGENT.open()) if isinstance(r.get("body"), dict)
                and r["body"].get("tools"))
    tools = [ToolSpec(f"{t['name']}{k}", t.get("description", ""), json.dumps(t["input_schema"]))
             for k in range(tool_copies) for t in body["tools"]]
    rnd = random.Random(1)
    words = "the quick brown fox jumps over a lazy dog while writing some code and tests".split()

    def text(chars: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(chars // 5))

    messages = [ChatMessage(Role.SYSTEM, text(6000))]
    for i in range(turns):
        call = ToolCall(f"call{i:05d}", "Bash0", json.dumps({"command": text(60)}))
        messages += [ChatMessage(Role.USER, text(1500)),
                     ChatMessage(Role.ASSISTANT, text(200), tool_calls=(call,), reasoning=text(300)),
                     ChatMessage(Role.TOOL, text(1500), tool_call_id=call.call_id),
                     ChatMessage(Role.ASSISTANT, text(400))]
    messages.append(ChatMessage(Role.USER, text(1500)))
    return messages, tools


def _worker(templates: Path, turns: int, tool_copies: int) -> None:
    """In the tree on ``PYTHONPATH`` (the script's own is not on the path): print ``{template:
    least CPU ms of 10 renders}`` as JSON."""
    from ringserve.formats.template import ChatTemplate

    messages, tools = _request(turns, tool_copies)
    out = {}
    for path in sorted(templates.glob("*.jinja")):
        template = ChatTemplate(path.read_text())
        times = []
        for _ in range(10):
            start = time.process_time()
            try:
                template.render(messages, tools=tools)
            except Exception:  # Gemma 2 refuses a tool turn
                break
            times.append(time.process_time() - start)
        if times:
            out[path.stem] = min(times) * 1e3
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", help="a ringserve checkout (default: this one)")
    ap.add_argument("--templates", type=Path, help="llama.cpp's models/templates folder")
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--tools", type=int, default=1, help="copies of Claude Code's 12 tools")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.templates, args.turns, args.tools)
        return
    sys.path.insert(0, str(ROOT))
    from bench.common import machine, machine_line, python, table, write_json
    from tests.support.llama_sdist import llama_cpp_templates

    templates = args.templates or llama_cpp_templates()
    trees = [tree.resolve() for tree in args.tree or [ROOT]]
    info = machine()
    print(machine_line(info))
    runs: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            command = [python(), str(ROOT / "bench" / "template_render.py"), "--worker", "--templates",
                       str(templates), "--turns", str(args.turns), "--tools", str(args.tools)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=tree,
                                  env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
            runs[tree].append(json.loads(done.stdout))
    base = trees[0]
    names = sorted(runs[base][0])
    rows, results = [], {}
    for tree in trees:
        ms = {name: statistics.median(r[name] for r in runs[tree]) for name in names}
        pairs = list(zip(runs[tree], runs[base], strict=True))
        ratio = {name: statistics.median(r[name] / b[name] for r, b in pairs) for name in names}
        ratios = sorted(ratio.values())
        worst = max(names, key=ratio.__getitem__)
        results[str(tree)] = {"ms": ms, "median_ratio": statistics.median(ratios), "worst": worst}
        rows.append([str(tree), f"{sum(ms.values()):.0f}", f"{statistics.median(ratios):.2f}",
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}", worst])
    print(table(["tree", "all templates, ms", "median ratio", "ratios", "worst"], rows))
    payload = {"machine": info, "turns": args.turns, "tool_copies": args.tools, "rounds": args.rounds,
               "results": results}
    print(f"wrote {write_json('template_render', payload)}")


if __name__ == "__main__":
    main()
