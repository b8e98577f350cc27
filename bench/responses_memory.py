"""Memory of a server that has stored many Responses (issue 15): RSS, ring bytes and store size.

``python bench/responses_memory.py [--responses 10000] [--checkpoints 1000,5000,10000]
[--reply-bytes 256] [--ttl 60] [--memory-cap-mib 256] [--retention] [--workers 8]``

Starts ``bench/fake_server.py`` (the fake engine, replies of ``--reply-bytes`` bytes, 4 bytes a
token) and creates ``--responses`` responses through ``POST /v1/responses``, in turn plain,
``stream`` (read to the end) and ``background``, ``--workers`` at a time. At each checkpoint,
once no generation runs, it reads the server's RSS (``/proc``) and ``/metrics``
(``ringserve_ring_bytes``, ``ringserve_ring_logs``, ``ringserve_store_bytes``,
``ringserve_active_generations``); then once more after the log TTL has passed (every completed
log expired) and, with ``--retention``, in a restarted server whose store retention deleted them all
(no retention runs while they are created, so every response stays stored). It also reports what the
store keeps per response (the answer's text, the render trace and the renderer's arguments that
rebuild its stream, from the database). Writes ``bench/results/responses_memory.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import (
    RINGSERVE_READY,
    ServerProcess,
    figure,
    fmt,
    machine,
    machine_line,
    python,
    ringserve_config,
    rss_bytes,
    save_figure,
    table,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("ringserve_ring_bytes", "ringserve_ring_logs", "ringserve_ring_memory_cap_bytes", "ringserve_store_bytes",
           "ringserve_active_generations", "ringserve_store_swept_messages")
MODES = ("plain", "stream", "background")


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for name in METRICS:
        m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def create(client: httpx.Client, i: int) -> None:
    """Response ``i``: plain, stream or background by ``i`` mod 3."""
    body: dict[str, Any] = {"model": "fake", "input": f"request {i}", "metadata": {"n": str(i)}}
    match MODES[i % 3]:
        case "plain":
            client.post("/v1/responses", json=body).raise_for_status()
        case "stream":
            with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
                resp.raise_for_status()
                for _ in resp.iter_raw():
                    pass
        case "background":
            client.post("/v1/responses", json={**body, "background": True}).raise_for_status()


def settle(client: httpx.Client, seconds: float = 0.0) -> dict[str, float]:
    """The metrics once no generation runs (and ``seconds`` later)."""
    while (figures := metrics(client))["ringserve_active_generations"] > 0:
        time.sleep(0.05)
    if seconds:
        time.sleep(seconds)
        figures = metrics(client)
    return figures


def point(server: ServerProcess, client: httpx.Client, label: str, created: int, seconds: float = 0.0) -> dict[str, Any]:
    figures = settle(client, seconds)
    return {"label": label, "responses": created, "rss_bytes": rss_bytes(server.pid), **figures}


def store_costs(path: Path) -> dict[str, float]:
    """Mean bytes per stored response: its text, its trace, its renderer arguments, its request."""
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT count(*), avg(length(text)), avg(length(trace)), avg(length(render)),"
                         " avg(length(request)) FROM messages WHERE surface = 'responses'").fetchone()
    finally:
        db.close()
    count, text, trace, render, request = row
    return {"rows": count, "text": text or 0, "trace": trace or 0, "render": render or 0, "request": request or 0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=10_000)
    ap.add_argument("--checkpoints", default="1000,5000,10000")
    ap.add_argument("--reply-bytes", type=int, default=256)
    ap.add_argument("--ttl", type=float, default=60.0, help="[stream] ttl_seconds")
    ap.add_argument("--memory-cap-mib", type=float, default=256.0, help="[stream] memory_cap_bytes in MiB")
    ap.add_argument("--retention", action="store_true",
                    help="measure once more after a restart whose retention deleted every response")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args(argv)
    checkpoints = sorted({int(c) for c in args.checkpoints.split(",") if int(c) <= args.responses} | {args.responses})
    info = machine()
    print(f"Responses memory, fake engine: {args.responses} responses ({'/'.join(MODES)} in turn) of"
          f" {args.reply_bytes} bytes, ttl {args.ttl} s, memory cap {args.memory_cap_mib} MiB")
    print(machine_line(info), flush=True)
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringserve-respmem-") as tmp:
        store = Path(tmp) / "store.sqlite3"

        def start(max_age: float) -> ServerProcess:
            cfg = ringserve_config(Path(tmp) / "config.toml", {
                "server": {"port": 0},
                "engine": {"slots": 4, "ctx_per_slot": args.reply_bytes // 4 + 256, "queue_size": 4096},
                "stream": {"ttl_seconds": args.ttl, "memory_cap_bytes": int(args.memory_cap_mib * 1024 * 1024)},
                "store": {"path": str(store), "max_age_seconds": max_age},
            })
            return ServerProcess([python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(cfg),
                                  "--reply-bytes", str(args.reply_bytes)],
                                 Path(tmp) / "server.log", ready_pattern=RINGSERVE_READY)

        server = start(0.0)  # no retention while they are created: every response stays stored
        try:
            with httpx.Client(base_url=server.url, timeout=300,
                              limits=httpx.Limits(max_connections=args.workers + 2)) as client:
                points.append(point(server, client, "start", 0))
                started = time.monotonic()
                created = 0
                with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
                    for mark in checkpoints:
                        list(pool.map(lambda i: create(client, i), range(created, mark)))
                        created = mark
                        points.append(point(server, client, f"{mark}", created))
                        print(f"  {mark} responses after {time.monotonic() - started:.0f} s", flush=True)
                costs = store_costs(store)
                points.append(point(server, client, "after ttl", created, seconds=args.ttl + 2.0))
        finally:
            server.stop()
        if args.retention:
            # a restart whose first sweep deletes every finished response (older than 1 ms)
            server = start(0.001)
            try:
                with httpx.Client(base_url=server.url, timeout=300) as client:
                    points.append(point(server, client, "after retention (restart)", created, seconds=1.0))
            finally:
                server.stop()
    rows = [[p["label"], str(p["responses"]), fmt(p["rss_bytes"], 2**-20), fmt(p["ringserve_ring_bytes"], 2**-20),
             str(int(p["ringserve_ring_logs"])), fmt(p["ringserve_store_bytes"], 2**-20),
             str(int(p["ringserve_store_swept_messages"]))] for p in points]
    print(table(["point", "responses", "RSS MiB", "ring MiB", "ring logs", "store MiB", "swept"], rows))
    print(f"store per response (mean bytes): text {costs['text']:.0f}, render trace {costs['trace']:.0f},"
          f" renderer arguments {costs['render']:.0f}, request {costs['request']:.0f}"
          f" ({costs['rows']} rows)")
    payload = {"machine": info, "args": vars(args), "points": points, "store_per_response": costs}
    fig, axes = figure(width=8, height=3.5)
    ax = axes[0][0]
    labels = [p["label"] for p in points]
    ax.plot(labels, [p["rss_bytes"] / 2**20 for p in points], marker="o", label="RSS")
    ax.plot(labels, [p["ringserve_ring_bytes"] / 2**20 for p in points], marker="o", label="ring bytes")
    ax.plot(labels, [p["ringserve_store_bytes"] / 2**20 for p in points], marker="o", label="store (SQLite)")
    ax.set_ylabel("MiB")
    ax.set_xlabel("responses created")
    ax.legend()
    print(f"wrote {write_json('responses_memory', payload)} and {save_figure(fig, 'responses_memory', info)}")
    return payload


if __name__ == "__main__":
    main()
