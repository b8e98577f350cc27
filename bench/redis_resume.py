"""Cross-replica resume: first byte and whole replay of a 2,000-token message resumed on another replica.

On the fake engine (what is measured is the log and the HTTP path, not the
model), in one run: a local ``redis-server`` this script starts (Debian's, on a
free loopback port, no persistence), two ``bench/fake_server.py`` replicas A and
B with ``[stream] backend = "redis"`` on it, and one replica M with the memory
backend. A message of ``--tokens`` tokens (4 bytes each) is created with
``Prefer: respond-async`` on the OpenAI surface on A, and one on M, and both
are left to complete. Then a client reconnects with
``GET /v1/messages/{id}/stream`` and ``Last-Event-ID`` on a new TCP connection
each time (httpx, no keep-alive), at the start, middle and end of the message
(as ``bench/resume.py``), ``--repeats`` times, interleaved:

* **redis, on B** (the replica that did not generate it): B holds no copy
  between resumes (a copy nobody reads is let go), so every resume loads the
  stream from Redis (one ``XRANGE`` of the whole stream, bounded by MAXLEN)
  before its first byte;
* **redis, on A** (the owner): from A's memory, as with one box;
* **memory, on M**: the memory backend on one replica, the baseline.

First byte is timed from sending the request to the first body byte; whole
replay to the end of the stream. Default coalescing (``flush_tokens = 16``).

Run from the repository root::

    .venv/bin/python bench/redis_resume.py [--tokens 2000] [--repeats 30]

Writes ``bench/results/redis_resume.json`` and ``bench/results/redis_resume.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ServerProcess,
    figure,
    fmt,
    machine,
    machine_line,
    pct,
    save_figure,
    table,
    write_json,
)
from bench.redis_append import start_redis  # noqa: E402
from bench.resume import POSITIONS, complete_message, read_stream, resume_points, start_server  # noqa: E402
from ringserve.core.sse import SSEParser  # noqa: E402

#: Where each measured resume goes: (backend, the replica asked, the replica that generated it).
TARGETS = {"redis, on B (other replica)": ("b", "a"), "redis, on A (owner)": ("a", "a"), "memory, on M": ("m", "m")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens in the message")
    ap.add_argument("--repeats", type=int, default=30, help="reconnects per position and target")
    args = ap.parse_args(argv)
    info = machine()
    print(f"cross-replica resume on the fake engine: a {args.tokens}-token message, {args.repeats} reconnects per"
          " position and target, each on a new connection")
    print(machine_line(info), flush=True)
    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="ringserve-redis-resume-") as tmp_name:
        tmp = Path(tmp_name)
        redis, redis_url = start_redis(tmp_name)
        try:
            for name in ("a", "b"):
                servers[name] = start_server(tmp, name, args.tokens, {"backend": "redis", "redis_url": redis_url})
            servers["m"] = start_server(tmp, "m", args.tokens, {})
            with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                messages = {owner: complete_message(client, servers[owner].url, args.tokens) for owner in ("a", "m")}
                points, sizes = {}, {}
                for owner, (_, whole) in messages.items():
                    events = SSEParser().feed(whole)
                    points[owner] = resume_points(events, args.tokens)
                    seqs = {e.id: i for i, e in enumerate(events)}
                    sizes[owner] = {"events": len(events), "bytes": len(whole),
                                    "replayed": {p: len(events) - 1 - seqs[points[owner][p]] for p in POSITIONS}}
                samples = {t: {p: {"first": [], "total": []} for p in POSITIONS} for t in TARGETS}
                for _ in range(args.repeats):
                    for pos in POSITIONS:
                        for target, (asked, owner) in TARGETS.items():
                            mid, whole = messages[owner]
                            first, total, data = read_stream(client, f"{servers[asked].url}/v1/messages/{mid}/stream",
                                                             {"Last-Event-ID": points[owner][pos]})
                            assert data == whole[len(whole) - len(data):], f"{target}: the replay differs"
                            samples[target][pos]["first"].append(first)
                            samples[target][pos]["total"].append(total)
        finally:
            for server in servers.values():
                server.stop()
            redis.terminate()
            redis.wait(10)

    results = {
        target: {
            pos: {
                "events_replayed": sizes[owner]["replayed"][pos],
                "first_byte_p50": pct(samples[target][pos]["first"], 50),
                "first_byte_p99": pct(samples[target][pos]["first"], 99),
                "total_p50": pct(samples[target][pos]["total"], 50),
                "total_p99": pct(samples[target][pos]["total"], 99),
                "samples": samples[target][pos],
            }
            for pos in POSITIONS
        }
        for target, (_, owner) in TARGETS.items()
    }
    rows = [[target, pos, r[pos]["events_replayed"],
             f"{fmt(r[pos]['first_byte_p50'], 1e3, 2)}/{fmt(r[pos]['first_byte_p99'], 1e3, 2)}",
             f"{fmt(r[pos]['total_p50'], 1e3, 2)}/{fmt(r[pos]['total_p99'], 1e3, 2)}"]
            for target, r in results.items() for pos in POSITIONS]
    print()
    print(f"message: {sizes['a']['events']} events, {sizes['a']['bytes']} bytes")
    print(table(["resumed through", "resume at", "events replayed", "first byte p50/p99 ms",
                 "whole replay p50/p99 ms"], rows))
    payload = {
        "benchmark": "redis_resume",
        "machine": info,
        "engine": "ringserve.engine.fake.FakeEngine (no model)",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "message": sizes,
        "results": results,
    }
    print(f"\nwrote {write_json('redis_resume', payload)}")

    fig, axes = figure(width=8, height=3.8)
    ax = axes[0][0]
    width = 0.8 / len(TARGETS)
    for i, (target, r) in enumerate(results.items()):
        xs = [k + (i - (len(TARGETS) - 1) / 2) * width for k in range(len(POSITIONS))]
        ax.bar(xs, [1e3 * r[p]["first_byte_p50"] for p in POSITIONS], width, label=f"{target} p50")
        ax.scatter(xs, [1e3 * r[p]["first_byte_p99"] for p in POSITIONS], marker="_", s=200, color="k", zorder=3,
                   label="p99" if i == 0 else None)
    ax.set_xticks(range(len(POSITIONS)), [f"resume at {p}" for p in POSITIONS])
    ax.set_ylabel("first byte, ms (new connection)")
    ax.set_title(f"Resume of a {args.tokens}-token message: another replica (Redis) vs one box (fake engine)")
    ax.legend(fontsize=7)
    print(f"wrote {save_figure(fig, 'redis_resume', info)}")
    return payload


if __name__ == "__main__":
    main()
