"""Server CPU time per streamed token on the fake engine: the cost of ringserve's own Python path.

``python bench/cpu_per_token.py [--tree DIR ...] [--streams 4] [--tokens 2000] [--rounds 3] [--step-ms MS]``

Starts ``bench/fake_server.py`` of each source tree (default: this checkout;
give another checkout of ringserve, a ``git worktree`` of an older commit
say, to compare), streams ``--streams`` concurrent replies of ``--tokens``
tokens (one byte each) on each surface, and divides the server process's
CPU time (user + system, ``/proc/PID/stat``) by the tokens it sent. The fake
engine's decode costs next to nothing, so the figure is the per-token work
of the runner, the producer chain, the SSE encoder and the HTTP writes:
what issue 19 calls the Python time that takes CPU from llama.cpp's decode
threads. CPU time, not wall time, so other load on the machine changes it
less; the trees are interleaved in every round, and the ratios are per round.

The fake engine decodes at once by default, so the coalescer gathers many
tokens into each SSE entry. ``--step-ms`` makes every decode call take that
long (``FakeEngine(step_seconds=...)``), as a real model's steps do: with
steps longer than ``[stream] flush_ms`` each token is an entry of its own, one
HTTP write per stream per step, which is issue 19's case. The table then also
gives the event loop's CPU per decode step (the main thread's CPU time over
the increase of ``ringserve_decode_steps``): with overlap ``off`` that work
runs between two decode calls, so it adds to every step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RINGSERVE_READY,
    ROOT,
    ServerProcess,
    cpu_seconds,
    figure,
    machine,
    machine_line,
    median,
    python,
    ringserve_config,
    save_figure,
    scrape,
    table,
    write_json,
)

SURFACES = {
    "anthropic": ("/v1/messages", lambda n: {"model": "fake", "max_tokens": n, "stream": True,
                                              "messages": [{"role": "user", "content": "go"}]}),
    "openai": ("/v1/chat/completions", lambda n: {"model": "fake", "max_tokens": n, "stream": True,
                                                   "messages": [{"role": "user", "content": "go"}]}),
}


def start(tree: Path, tmp: Path, tag: str, streams: int, tokens: int, step_ms: float) -> ServerProcess:
    cfg = ringserve_config(tmp / f"{tag}.toml", {
        "server": {"port": 0},
        "engine": {"slots": streams, "ctx_per_slot": tokens + 64},
        "store": {"path": str(tmp / f"{tag}.sqlite3")},
    })
    return ServerProcess([python(), str(tree / "bench" / "fake_server.py"), "--config", str(cfg),
                          "--fake", json.dumps({"piece_bytes": 1, "step_seconds": step_ms / 1000}),
                          "--reply-bytes", str(tokens + 16)],
                         tmp / f"{tag}.log", ready_pattern=RINGSERVE_READY)


def stream_once(url: str, path: str, body: dict[str, Any]) -> int:
    with httpx.stream("POST", url + path, json=body, timeout=300) as resp:
        resp.raise_for_status()
        return sum(len(chunk) for chunk in resp.iter_raw())


def measure(server: ServerProcess, surface: str, streams: int, tokens: int) -> tuple[float, float]:
    """For ``streams`` concurrent streams of ``tokens`` tokens: server CPU microseconds per token,
    and the event loop's (main thread's) CPU microseconds per decode step."""
    path, body = SURFACES[surface]
    stream_once(server.url, path, body(8))  # warm up the route
    steps_before = scrape(server.url)["ringserve_decode_steps_total"]
    before, loop_before = cpu_seconds(server.pid), cpu_seconds(server.pid, server.pid)
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda _: stream_once(server.url, path, body(tokens)), range(streams)))
    per_token = (cpu_seconds(server.pid) - before) / (streams * tokens) * 1e6
    steps = scrape(server.url)["ringserve_decode_steps_total"] - steps_before
    return per_token, (cpu_seconds(server.pid, server.pid) - loop_before) / steps * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", help="a ringserve source tree (repeatable; default: this one)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="each fake decode step takes this long (ms; 0: at once)")
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    info = machine()
    print(f"server CPU per token, fake engine: {args.streams} streams x {args.tokens} tokens, {args.rounds} rounds,"
          f" decode steps of {args.step_ms:g} ms")
    print(machine_line(info), flush=True)
    results: dict[str, dict[str, list[float]]] = {str(t): {s: [] for s in SURFACES} for t in trees}
    per_step: dict[str, dict[str, list[float]]] = {str(t): {s: [] for s in SURFACES} for t in trees}
    with tempfile.TemporaryDirectory(prefix="ringserve-cpu-") as tmp:
        servers = {t: start(t, Path(tmp), f"s{i}", args.streams, args.tokens, args.step_ms)
                   for i, t in enumerate(trees)}
        try:
            for _ in range(args.rounds):
                for surface in SURFACES:
                    for tree, server in servers.items():
                        us, loop_us = measure(server, surface, args.streams, args.tokens)
                        results[str(tree)][surface].append(us)
                        per_step[str(tree)][surface].append(loop_us)
        finally:
            for server in servers.values():
                server.stop()
    base = str(trees[0])
    rows = []
    for tree in map(str, trees):
        for surface in SURFACES:
            us, loop = results[tree][surface], per_step[tree][surface]
            ratios = [u / b for u, b in zip(us, results[base][surface], strict=True)]
            loop_ratios = [u / b for u, b in zip(loop, per_step[base][surface], strict=True)]
            rows.append([tree, surface, " ".join(f"{u:.1f}" for u in us), f"{median(us):.1f}",
                         " ".join(f"{r:.2f}" for r in ratios),
                         " ".join(f"{u:.0f}" for u in loop), f"{median(loop):.0f}",
                         " ".join(f"{r:.2f}" for r in loop_ratios)])
    print(table(["tree", "surface", "µs/token per round", "median", f"ratio to {Path(base).name} per round",
                 "event loop µs/step per round", "median", "ratio per round"], rows))
    payload = {"machine": info, "streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
               "results": results, "event_loop_us_per_step": per_step}
    fig, axes = figure(width=7, height=3.5)
    ax = axes[0][0]
    labels = [f"{Path(tree).name}\n{surface}" for tree in results for surface in SURFACES]
    ax.bar(labels, [median(results[tree][surface]) or 0 for tree in results for surface in SURFACES])
    ax.set_ylabel("server CPU µs per token (median)")
    print(f"wrote {write_json('cpu_per_token', payload)} and {save_figure(fig, 'cpu_per_token', info)}")
    return payload


if __name__ == "__main__":
    main()
