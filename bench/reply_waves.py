"""Memory of waves of large replies (issue 43 item 8): peak and retained RSS against the text in flight.

``python bench/reply_waves.py [--waves 3] [--messages 60] [--reply-mb 3] [--memory-cap-mib 64]
[--slots 8] [--ttl 20] [--env NAME=VALUE ...]``

Starts ``bench/fake_server.py`` (the fake engine, replies of ``--reply-mb`` MB in tokens of 4 KiB,
``[stream] memory_cap_bytes`` of ``--memory-cap-mib``) and sends ``--waves`` waves of
``--messages`` requests at once, in turn streamed (Anthropic, OpenAI Chat, Responses) and not,
each read to its end. It samples the server's RSS every 0.2 s: the peak of each wave, the RSS
2 s after the wave ended (nothing runs; its logs are held), and once the logs' TTL (``--ttl``)
has passed after the last wave (the traffic over: what the process gives back). The text in flight is
messages x reply size. Writes ``bench/results/reply_waves.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import (
    RINGSERVE_READY,
    ServerProcess,
    figure,
    machine,
    machine_line,
    python,
    ringserve_config,
    rss_bytes,
    save_figure,
    scrape,
    table,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
PIECE_BYTES = 4096
#: Seconds after a wave's last generation ended that its RSS is read (the log store's sweep,
#: every second, gives the memory freed back then: ``logs/heap.py``).
AFTER_SECONDS = 2.0


def request(i: int, tokens: int) -> tuple[str, dict[str, Any]]:
    """Request ``i`` of a wave: its route and body (streamed on three surfaces, or not)."""
    text = f"wave request {i}"
    match i % 4:
        case 0:
            return "/v1/messages", {"model": "fake", "max_tokens": tokens, "stream": True,
                                    "messages": [{"role": "user", "content": text}]}
        case 1:
            return "/v1/chat/completions", {"model": "fake", "max_tokens": tokens, "stream": True,
                                            "messages": [{"role": "user", "content": text}]}
        case 2:
            return "/v1/responses", {"model": "fake", "max_output_tokens": tokens, "stream": True,
                                     "input": text}
        case _:
            return "/v1/messages", {"model": "fake", "max_tokens": tokens,
                                    "messages": [{"role": "user", "content": text}]}


def send(url: str, route: str, body: dict[str, Any]) -> int:
    """Send one request and read its body to the end; the bytes read."""
    with httpx.Client(base_url=url, timeout=600) as client, client.stream("POST", route, json=body) as resp:
        resp.raise_for_status()
        return sum(len(chunk) for chunk in resp.iter_raw())


def idle(url: str) -> None:
    while scrape(url).get("ringserve_active_generations", 0) > 0:
        time.sleep(0.2)


def sample(pid: int, stop: threading.Event, peaks: list[int]) -> None:
    """Keep the largest RSS of process ``pid`` in ``peaks[0]``, every 0.2 s until ``stop``."""
    while not stop.wait(0.2):
        peaks[0] = max(peaks[0], rss_bytes(pid))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--messages", type=int, default=60)
    ap.add_argument("--reply-mb", type=float, default=3.0)
    ap.add_argument("--memory-cap-mib", type=float, default=64.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ttl", type=float, default=20.0, help="[stream] ttl_seconds")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the server (e.g. MALLOC_ARENA_MAX=2)")
    args = ap.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    reply_bytes = int(args.reply_mb * 1e6) // PIECE_BYTES * PIECE_BYTES
    tokens = reply_bytes // PIECE_BYTES + 8
    in_flight = args.messages * reply_bytes
    info = machine()
    print(f"Reply waves, fake engine: {args.waves} waves of {args.messages} replies"
          f" of {reply_bytes / 1e6:.1f} MB"
          f" ({in_flight / 1e6:.0f} MB of text in flight), memory cap {args.memory_cap_mib:g} MiB,"
          f" {args.slots} slots{', ' + ' '.join(args.env) if env else ''}")
    print(machine_line(info), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringserve-waves-") as tmp:
        cfg = ringserve_config(Path(tmp) / "config.toml", {
            "server": {"port": 0},
            "model": {"ctx_size": args.slots * (tokens + 64)},
            "engine": {"slots": args.slots, "queue_size": args.messages},
            "stream": {"memory_cap_bytes": int(args.memory_cap_mib * 1024 * 1024), "ttl_seconds": args.ttl},
            "store": {"path": str(Path(tmp) / "store.sqlite3")},
        })
        server = ServerProcess([python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(cfg),
                                "--reply-bytes", str(reply_bytes),
                                "--fake", json.dumps({"piece_bytes": PIECE_BYTES})],
                               Path(tmp) / "server.log", ready_pattern=RINGSERVE_READY, env=env)
        try:
            start = rss_bytes(server.pid)
            rows.append({"when": "start", "rss_mb": start / 1e6, "peak_mb": start / 1e6})
            for wave in range(args.waves):
                sampling = threading.Event()
                peaks = [0]
                sampler = threading.Thread(target=sample, args=(server.pid, sampling, peaks))
                sampler.start()
                began = time.monotonic()
                with concurrent.futures.ThreadPoolExecutor(args.messages) as pool:
                    read = sum(pool.map(lambda i: send(server.url, *request(i, tokens)),
                                        range(args.messages)))
                idle(server.url)
                time.sleep(AFTER_SECONDS)
                sampling.set()
                sampler.join()
                metrics = scrape(server.url)
                rss = rss_bytes(server.pid)
                rows.append({"when": f"wave {wave + 1}", "seconds": time.monotonic() - began,
                             "read_mb": read / 1e6, "peak_mb": max(peaks[0], rss) / 1e6, "rss_mb": rss / 1e6,
                             "ring_mb": metrics.get("ringserve_ring_bytes", 0) / 1e6})
                print(f"  wave {wave + 1}: peak {rows[-1]['peak_mb']:.0f} MB, after {rss / 1e6:.0f} MB,"
                      f" ring {rows[-1]['ring_mb']:.0f} MB, {time.monotonic() - began:.0f} s", flush=True)
            time.sleep(args.ttl + 3)  # every log expired, and a sweep or two after
            rss = rss_bytes(server.pid)
            metrics = scrape(server.url)
            rows.append({"when": f"idle, {args.ttl + 3:g} s later", "rss_mb": rss / 1e6,
                         "ring_mb": metrics.get("ringserve_ring_bytes", 0) / 1e6})
        finally:
            server.stop()
    print(table(["", "peak RSS, MB", "RSS after, MB", "ring, MB", "peak / text in flight"], [
        [r["when"], f"{r['peak_mb']:.0f}" if "peak_mb" in r else "-", f"{r['rss_mb']:.0f}",
         f"{r['ring_mb']:.0f}" if "ring_mb" in r else "-",
         f"{(r['peak_mb'] * 1e6 - start) / in_flight:.2f}" if "read_mb" in r else "-"]
        for r in rows
    ]))
    payload = {"bench": "reply_waves", "machine": info, "args": vars(args), "text_in_flight_bytes": in_flight,
               "rows": rows}
    print(f"wrote {write_json('reply_waves', payload)}")
    fig, axes = figure()
    ax = axes[0][0]
    labels = [r["when"] for r in rows]
    ax.bar(labels, [r.get("peak_mb", 0) for r in rows], label="peak RSS")
    ax.bar(labels, [r["rss_mb"] for r in rows], label=f"RSS {AFTER_SECONDS:g} s after / once idle", alpha=0.8)
    ax.axhline(in_flight / 1e6, color="0.3", linestyle="--", label="text in flight")
    ax.set_ylabel("MB")
    ax.legend()
    ax.set_title("Waves of large replies (fake engine)")
    print(f"wrote {save_figure(fig, 'reply_waves', info)}")
    return payload


if __name__ == "__main__":
    main()
