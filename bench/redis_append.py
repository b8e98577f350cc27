"""Redis log backend: append throughput and latency, pipelined per flush vs one round trip per entry.

Against a local ``redis-server`` this script starts itself (Debian's, on a free
loopback port, no persistence). ``--streams`` message logs each get
``--entries`` appends of ``--bytes`` bytes (a coalesced SSE event is ~100-300
bytes), interleaved across the streams as concurrent generations would
interleave them, in two ways:

* **pipelined**: through :class:`ringserve.logs.redis.RedisLogStore`
  as the server does: ``append`` is synchronous and queues; the flusher sends
  everything queued, for every stream, in one pipelined round trip at most
  once per ``flush_ms``. The producer yields to Trio after each round of one
  entry per stream. Latency of an entry: from its ``append`` to the end of
  the round trip that carried it.
* **per entry**: the same ``XADD`` (explicit id, ``MAXLEN ~``) awaited once
  per entry on one coredis client. Latency: that call.

Throughput is entries written per second of wall time, from the first append
to the last entry acknowledged by Redis. ``--repeats`` rounds, the two modes
interleaved; medians are reported.

Run from the repository root::

    .venv/bin/python bench/redis_append.py [--streams 64] [--entries 200] [--repeats 3]

Writes ``bench/results/redis_append.json`` and ``bench/results/redis_append.png``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coredis  # noqa: E402
from coredis.tokens import PureToken  # noqa: E402

from bench.common import (  # noqa: E402
    figure,
    fmt,
    free_port,
    machine,
    machine_line,
    median,
    pct,
    save_figure,
    table,
    write_json,
)
from ringserve.config import StreamConfig  # noqa: E402
from ringserve.logs.redis import RedisLogStore, stream_key  # noqa: E402


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """Debian's redis-server on a free loopback port; (process, URL) once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL)
    for _ in range(400):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)  # an external process: poll its port
    proc.terminate()
    raise SystemExit("redis-server did not answer")


class TimedStore(RedisLogStore):
    """The store, noting when each round trip that carried an entry ended (``appended`` is filled by the caller)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.appended: dict[tuple[str, int], float] = {}
        self.latencies: list[float] = []

    async def _send(self, ops: list) -> None:
        await super()._send(ops)
        done = time.perf_counter()
        for op in ops:
            started = self.appended.pop((op.key, getattr(op, "seq", None)), None)
            if started is not None:
                self.latencies.append(done - started)


async def pipelined(url: str, streams: int, entries: int, size: int, round_no: int) -> dict[str, Any]:
    store = TimedStore(StreamConfig(), url)
    appended, latencies = store.appended, store.latencies
    data = b"x" * size
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        logs = [store.create(f"p{round_no}-{i}") for i in range(streams)]
        started = time.perf_counter()
        for _ in range(entries):
            for log in logs:
                appended[stream_key(log.message_id), log.next_seq] = time.perf_counter()
                log.append(data)
            await trio.lowlevel.checkpoint()
        while appended:  # every entry acknowledged by Redis
            await trio.sleep(0.001)
        seconds = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return {"entries_per_s": streams * entries / seconds, "p50_ms": pct(latencies, 50) * 1000,
            "p99_ms": pct(latencies, 99) * 1000, "round_trips": store.round_trips_total}


async def per_entry(url: str, streams: int, entries: int, size: int, round_no: int) -> dict[str, Any]:
    client = coredis.Redis.from_url(url)
    data = b"x" * size
    latencies: list[float] = []
    async with client:
        started = time.perf_counter()
        for seq in range(entries):
            for i in range(streams):
                t = time.perf_counter()
                await client.xadd(stream_key(f"e{round_no}-{i}"), {b"d": data}, identifier=f"{seq + 1}-0",
                                  trim_strategy=PureToken.MAXLEN, threshold=8192, trim_operator=PureToken.APPROXIMATELY)
                latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - started
    return {"entries_per_s": streams * entries / seconds, "p50_ms": pct(latencies, 50) * 1000,
            "p99_ms": pct(latencies, 99) * 1000, "round_trips": streams * entries}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/redis_append.py", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--entries", type=int, default=200, help="entries per stream")
    ap.add_argument("--bytes", type=int, default=200, help="bytes per entry")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    info = machine()
    rounds: dict[str, list[dict[str, Any]]] = {"pipelined": [], "per_entry": []}
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = start_redis(workdir)
        try:
            for r in range(args.repeats):
                rounds["pipelined"].append(trio.run(pipelined, url, args.streams, args.entries, args.bytes, r))
                rounds["per_entry"].append(trio.run(per_entry, url, args.streams, args.entries, args.bytes, r))
        finally:
            proc.terminate()
            proc.wait(10)
    summary = {mode: {key: median(r[key] for r in rs) for key in ("entries_per_s", "p50_ms", "p99_ms", "round_trips")}
               for mode, rs in rounds.items()}
    print(machine_line(info))
    print(f"{args.streams} streams x {args.entries} entries of {args.bytes} bytes, {args.repeats} rounds (medians)")
    print(table(["mode", "entries/s", "p50 ms", "p99 ms", "round trips"],
                [[mode, fmt(s["entries_per_s"], digits=0), fmt(s["p50_ms"], digits=2), fmt(s["p99_ms"], digits=2),
                  fmt(s["round_trips"], digits=0)] for mode, s in summary.items()]))
    write_json("redis_append", {"machine": info, "args": vars(args), "rounds": rounds, "summary": summary})
    fig, axes = figure(ncols=2)
    left, right = axes[0]
    modes = list(summary)
    left.bar(modes, [summary[m]["entries_per_s"] for m in modes])
    left.set_ylabel("entries/s")
    left.set_title("append throughput")
    right.bar([f"{m} p50" for m in modes] + [f"{m} p99" for m in modes],
              [summary[m]["p50_ms"] for m in modes] + [summary[m]["p99_ms"] for m in modes])
    right.set_ylabel("ms")
    right.set_title("append latency")
    save_figure(fig, "redis_append", info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
