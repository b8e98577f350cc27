"""Resume: replay latency of a reconnect at the start, middle and end of a 2,000-token message.

On the fake engine (no model; what is measured is the stream log and the HTTP
path, which do not depend on the model): ``bench/fake_server.py`` in a
subprocess, a fake reply of ``--tokens`` tokens of 4 bytes each, created with
``Prefer: respond-async`` on the OpenAI surface and left to complete. Then a
client reconnects with ``GET /v1/messages/{id}/stream`` and ``Last-Event-ID``,
on a new TCP connection each time (httpx, no keep-alive), at three places:

* **start**: after the first event (``seq 0``, the role chunk): the whole
  text is replayed;
* **middle**: after the event that holds token ``tokens/2``;
* **end**: after the last event with text: only the terminal events come.

For each it times the first byte of the body (from sending the request) and
the whole replay (to the end of the stream, which is the terminal
``[DONE]``), ``--repeats`` times, positions interleaved. Two stream settings:
the default coalescing (``flush_tokens = 16``: an entry per 16 tokens when
tokens come fast) and ``flush_tokens = 1`` (an entry per token, the most
entries a 2,000-token message can have).

Run from the repository root::

    .venv/bin/python bench/resume.py [--tokens 2000] [--repeats 50]

Writes ``bench/results/resume.json`` and ``bench/results/resume.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RINGSERVE_READY,
    ROOT,
    ServerProcess,
    figure,
    fmt,
    machine,
    machine_line,
    pct,
    python,
    ringserve_config,
    save_figure,
    table,
    write_json,
)
from ringserve.core.sse import SSEParser  # noqa: E402

POSITIONS = ("start", "middle", "end")
VARIANTS = {"flush_tokens=16 (default)": 16, "flush_tokens=1": 1}
PIECE_BYTES = 4


def read_stream(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> tuple[float, float, bytes]:
    """GET an SSE stream to its end: (seconds to the first body byte, seconds to the end, body)."""
    body = bytearray()
    first = None
    t0 = time.perf_counter()
    with client.stream("GET", url, headers=headers) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_raw():
            if first is None:
                first = time.perf_counter() - t0
            body += chunk
    return first or 0.0, time.perf_counter() - t0, bytes(body)


def resume_points(events: list[Any], tokens: int) -> dict[str, str]:
    """The ``Last-Event-ID`` for each position, from the whole stream's events."""
    text_ids, seen = [], 0
    middle = None
    for ev in events:
        if not ev.data or ev.data == "[DONE]":
            continue
        choices = json.loads(ev.data).get("choices") or [{}]
        content = (choices[0].get("delta") or {}).get("content") or ""
        if content:
            seen += len(content.encode()) // PIECE_BYTES
            text_ids.append(ev.id)
            if middle is None and seen >= tokens // 2:
                middle = ev.id
    return {"start": events[0].id, "middle": middle, "end": text_ids[-1]}


def start_server(tmp: Path, name: str, tokens: int, stream: dict[str, Any]) -> ServerProcess:
    """``bench/fake_server.py`` replying ``tokens`` tokens, with the ``[stream]`` table ``stream`` (files ``tmp/name.*``)."""
    cfg = ringserve_config(tmp / f"{name}.toml", {
        "server": {"port": 0},
        "engine": {"slots": 1, "ctx_per_slot": tokens + 256},
        "stream": {"ttl_seconds": 3600.0, **stream},
        "store": {"path": str(tmp / f"{name}.sqlite3")},
        "limits": {"max_readers_per_client": 0},
    })
    return ServerProcess(
        [python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(cfg),
         "--fake", json.dumps({"piece_bytes": PIECE_BYTES}), "--reply-bytes", str(tokens * PIECE_BYTES)],
        tmp / f"{name}.log",
        ready_pattern=RINGSERVE_READY,
    )


def complete_message(client: httpx.Client, url: str, tokens: int) -> tuple[str, bytes]:
    """Create a message (``Prefer: respond-async``) on the server at ``url`` and read it to its end: (id, the stream)."""
    body = {"model": "fake", "max_tokens": tokens + 1, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    created = client.post(f"{url}/v1/chat/completions", json=body, headers={"Prefer": "respond-async"})
    created.raise_for_status()
    mid = created.json()["id"]
    _, _, whole = read_stream(client, f"{url}/v1/messages/{mid}/stream")  # follows to the end: the message is complete
    return mid, whole


def measure(tmp: Path, name: str, flush_tokens: int, tokens: int, repeats: int) -> dict[str, Any]:
    server = start_server(tmp, str(flush_tokens), tokens, {"flush_tokens": flush_tokens})
    try:
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            mid, whole = complete_message(client, server.url, tokens)
            url = f"{server.url}/v1/messages/{mid}/stream"
            events = SSEParser().feed(whole)
            points = resume_points(events, tokens)
            seqs = {e.id: i for i, e in enumerate(events)}
            samples: dict[str, dict[str, list[float]]] = {p: {"first": [], "total": []} for p in POSITIONS}
            sizes = {}
            for _ in range(repeats):
                for pos in POSITIONS:
                    first, total, data = read_stream(client, url, {"Last-Event-ID": points[pos]})
                    samples[pos]["first"].append(first)
                    samples[pos]["total"].append(total)
                    sizes[pos] = {"bytes": len(data), "events": len(events) - 1 - seqs[points[pos]]}
    finally:
        server.stop()
    return {
        "variant": name,
        "flush_tokens": flush_tokens,
        "message_events": len(events),
        "message_bytes": len(whole),
        "positions": {
            pos: {
                "last_event_id": points[pos],
                **sizes[pos],
                "first_byte_p50": pct(samples[pos]["first"], 50),
                "first_byte_p99": pct(samples[pos]["first"], 99),
                "total_p50": pct(samples[pos]["total"], 50),
                "total_p99": pct(samples[pos]["total"], 99),
                "samples": samples[pos],
            }
            for pos in POSITIONS
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens in the message")
    ap.add_argument("--repeats", type=int, default=50, help="reconnects per position")
    args = ap.parse_args(argv)
    info = machine()
    print(f"resume replay on the fake engine: a {args.tokens}-token message, {args.repeats} reconnects per position,"
          " each on a new connection")
    print(machine_line(info), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="ringserve-resume-") as tmp_name:
        for name, flush in VARIANTS.items():
            results[name] = measure(Path(tmp_name), name, flush, args.tokens, args.repeats)
            print(f"  {name}: {results[name]['message_events']} events, {results[name]['message_bytes']} bytes",
                  flush=True)

    rows = []
    for name, r in results.items():
        for pos in POSITIONS:
            p = r["positions"][pos]
            rows.append([name, pos, p["events"], p["bytes"],
                         f"{fmt(p['first_byte_p50'], 1e3, 2)}/{fmt(p['first_byte_p99'], 1e3, 2)}",
                         f"{fmt(p['total_p50'], 1e3, 2)}/{fmt(p['total_p99'], 1e3, 2)}"])
    print()
    print(table(["stream setting", "resume at", "events replayed", "bytes", "first byte p50/p99 ms",
                 "whole replay p50/p99 ms"], rows))
    payload = {
        "benchmark": "resume",
        "machine": info,
        "engine": "ringserve.engine.fake.FakeEngine (no model)",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "results": results,
    }
    print(f"\nwrote {write_json('resume', payload)}")

    fig, axes = figure(width=7, height=3.8)
    ax = axes[0][0]
    width = 0.38
    for i, (name, r) in enumerate(results.items()):
        xs = [k + (i - 0.5) * width for k in range(len(POSITIONS))]
        p50 = [1e3 * r["positions"][p]["total_p50"] for p in POSITIONS]
        p99 = [1e3 * r["positions"][p]["total_p99"] for p in POSITIONS]
        ax.bar(xs, p50, width, label=f"{name} p50")
        ax.scatter(xs, p99, marker="_", s=200, color="k", zorder=3, label="p99" if i == 0 else None)
    ax.set_xticks(range(len(POSITIONS)), [f"resume at {p}" for p in POSITIONS])
    ax.set_ylabel("whole replay, ms (new connection)")
    ax.set_title(f"Reconnect replay of a {args.tokens}-token message (fake engine)")
    ax.legend(fontsize=7)
    print(f"wrote {save_figure(fig, 'resume', info)}")
    return payload


if __name__ == "__main__":
    main()
