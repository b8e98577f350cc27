"""Gateway capacity on the fake engine: SSE streams held with heartbeats, and fan-out throughput.

No model: the server runs :class:`ringserve.engine.fake.FakeEngine` through
:func:`ringserve.server.serve` in a subprocess (``bench/fake_server.py``, the
same server as ``ringserve serve`` with the engine swapped), so what is
measured is ringserve's HTTP and stream-log side: hypercorn, quart-trio, the
ring log and one reader task per connection. The clients are raw
non-blocking sockets on one ``epoll`` loop in this process (cheaper per event
than the server, so the server is what saturates), each sending
``GET /v1/messages/{id}/stream`` over HTTP/1.1 and counting SSE entries
(``id:`` lines) and heartbeats (``: ping``) as bytes arrive.

Two experiments, for 100, 1,000 and 5,000 concurrent streams:

* **hold**: one message whose generation never produces a token (the fake
  engine is held at its start gate), ``heartbeat_interval = --heartbeat``
  seconds. Streams connect in waves; once all are open the server's RSS is
  read and, for ``--hold-seconds``, every ping's arrival is timed. Reported: RSS per
  stream (RSS with the streams minus RSS before them, over the count), the
  gap between pings per stream (p50/p99/max; nominal ``--heartbeat``), the streams that
  got no ping in the window, and the server's CPU share meanwhile.
* **fan-out**: ``--messages`` messages (``Prefer: respond-async``), the
  streams spread evenly over them. The fake engine is held at its start gate
  until every stream is open, then released: each message gets a new entry
  ``--entry-rate`` times a second (fake engine step time ``1/entry-rate``),
  and every stream follows live. Over a ``--fanout-seconds`` window
  starting one second after the release: entries
  delivered per second over all streams (offered: streams x entry-rate), the
  gap between consecutive entries at one stream (p50/p99; nominal
  ``1/entry-rate``), and the fan-out spread (last stream's arrival minus
  first stream's arrival of the same entry, p50/p99), with the CPU share
  of the server and of the clients (one core is 100%), which tells which
  side saturated.

Each stream count gets a fresh server. ``--rounds`` repeats everything;
figures are medians over rounds.

Run from the repository root::

    .venv/bin/python bench/gateway.py [--streams 100 1000 5000] [--rounds 3]

Writes ``bench/results/gateway.json`` and ``bench/results/gateway.png``.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RINGSERVE_READY,
    ROOT,
    ServerProcess,
    cpu_seconds,
    figure,
    fmt,
    machine,
    machine_line,
    median,
    pct,
    python,
    raise_fd_limit,
    ringserve_config,
    rss_bytes,
    save_figure,
    table,
    write_json,
)

WAVE = 50
"""Streams opened at once while connecting (under hypercorn's listen backlog of 100, so no
SYN is dropped and retried a second later)."""

ENTRY_MARK = b"id: "
"""Every SSE entry ringserve writes starts with its ``id:`` line; pings have none."""

PING_MARK = b": ping"


@attrs.define(eq=False)
class Stream:
    """One client connection and what it has seen."""

    sock: socket.socket
    group: int
    request: bytes
    sent: int = 0
    head: bytes = b""
    status: int | None = None
    tail: bytes = b""
    entries: int = 0
    pings: int = 0
    last_entry: float | None = None
    last_ping: float | None = None
    closed: bool = False


@attrs.define(eq=False)
class Recorder:
    """What is recorded while a window is open (seconds on ``time.monotonic``)."""

    entry_gaps: list[float] = attrs.Factory(list)
    ping_gaps: list[float] = attrs.Factory(list)
    entries: int = 0
    pings: int = 0
    first: dict[tuple[int, int], float] = attrs.Factory(dict)
    last: dict[tuple[int, int], float] = attrs.Factory(dict)
    spread: bool = False
    window: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0


class Clients:
    """Many SSE readers on one epoll loop (blocking calls, no threads, no Trio)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = parts.netloc
        self.sel = selectors.DefaultSelector()
        self.streams: list[Stream] = []
        self.rec: Recorder | None = None
        self.failures: list[str] = []

    def open(self, paths: list[tuple[str, int]], *, wait: str, timeout: float = 120.0) -> None:
        """Open one stream per ``(path, group)``, ``WAVE`` at a time.

        Each wave waits until every stream of it has its response head and,
        with ``wait="entry"``, its first entry too.

        Raises:
            RuntimeError: a stream was refused or did not answer in time.
        """
        for i in range(0, len(paths), WAVE):
            wave = []
            for path, group in paths[i : i + WAVE]:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                err = sock.connect_ex(self.addr)
                if err not in (0, errno.EINPROGRESS):
                    raise RuntimeError(f"connect: {os.strerror(err)}")
                req = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAccept: text/event-stream\r\n\r\n".encode()
                s = Stream(sock, group, req)
                self.streams.append(s)
                wave.append(s)
                self.sel.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ, s)
            deadline = time.monotonic() + timeout

            def ready(s: Stream) -> bool:
                return s.status is not None and (wait != "entry" or s.entries > 0)

            while not all(ready(s) for s in wave):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{sum(not ready(s) for s in wave)} streams did not open in {timeout:.0f} s")
                self.poll(0.5)
            bad = [s.status for s in wave if s.status != 200]
            if bad:
                raise RuntimeError(f"{len(bad)} streams refused (HTTP {sorted(set(bad))})")

    def poll(self, timeout: float) -> None:
        """Handle what is ready within ``timeout`` seconds."""
        events = self.sel.select(timeout)
        now = time.monotonic()
        for key, mask in events:
            s: Stream = key.data
            if mask & selectors.EVENT_WRITE and s.sent < len(s.request):
                s.sent += s.sock.send(s.request[s.sent :])
                if s.sent == len(s.request):
                    self.sel.modify(s.sock, selectors.EVENT_READ, s)
            if mask & selectors.EVENT_READ:
                self._read(s, now)

    def _read(self, s: Stream, now: float) -> None:
        try:
            data = s.sock.recv(262144)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data = b""
            self.failures.append(str(exc))
        if not data:
            s.closed = True
            self.sel.unregister(s.sock)
            s.sock.close()
            return
        if s.status is None:
            s.head += data
            end = s.head.find(b"\r\n\r\n")
            if end < 0:
                return
            s.status = int(s.head.split(b" ", 2)[1])
            data = s.head[end + 4 :]
            s.head = b""
        buf = s.tail + data
        s.tail = buf[-5:]
        n = buf.count(ENTRY_MARK)
        p = buf.count(PING_MARK)
        rec = self.rec
        if n:
            if rec is not None:
                rec.entries += n
                if s.last_entry is not None:
                    rec.entry_gaps.append(now - s.last_entry)
                if rec.spread:
                    for seq in range(s.entries, s.entries + n):
                        key = (s.group, seq)
                        if key not in rec.first:
                            rec.first[key] = now
                        rec.last[key] = now
            s.entries += n
            s.last_entry = now
        if p:
            if rec is not None:
                rec.pings += p
                if s.last_ping is not None:
                    rec.ping_gaps.append(now - s.last_ping)
            s.pings += p
            s.last_ping = now

    def record(self, seconds: float, server_pid: int, *, spread: bool = False) -> Recorder:
        """Poll for ``seconds`` while recording, and the CPU both sides used meanwhile."""
        for s in self.streams:  # gaps count from the window's start
            s.last_entry = s.last_ping = None
        rec = self.rec = Recorder(spread=spread)
        server0, client0 = cpu_seconds(server_pid), time.process_time()
        t0 = time.monotonic()
        while (left := t0 + seconds - time.monotonic()) > 0:
            self.poll(min(left, 0.2))
        rec.window = time.monotonic() - t0
        rec.server_cpu = (cpu_seconds(server_pid) - server0) / rec.window
        rec.client_cpu = (time.process_time() - client0) / rec.window
        self.rec = None
        return rec

    def close(self) -> None:
        for s in self.streams:
            if not s.closed:
                self.sel.unregister(s.sock)
                s.sock.close()
                s.closed = True
        self.streams.clear()
        self.sel.close()


def start_server(
    tmp: Path, tag: str, fake: dict[str, Any], reply_bytes: int, gate_after: int, heartbeat: float
) -> ServerProcess:
    cfg = ringserve_config(tmp / f"{tag}.toml", {
        "server": {"port": 0, "heartbeat_interval": heartbeat},
        "engine": {"slots": 4, "queue_size": 64, "ctx_per_slot": 16384},
        "stream": {"ttl_seconds": 3600.0},
        "store": {"path": str(tmp / f"{tag}.sqlite3")},
        "limits": {"max_readers_per_message": 0, "max_readers_per_client": 0},
    })
    return ServerProcess(
        [python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(cfg), "--fake", json.dumps(fake),
         "--reply-bytes", str(reply_bytes), "--gate-after", str(gate_after)],
        tmp / f"{tag}.log",
        ready_pattern=RINGSERVE_READY,
    )


def create_message(url: str, max_tokens: int) -> str:
    """Start a generation that keeps going without readers; return its message id."""
    body = {"model": "fake", "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Prefer": "respond-async"}, timeout=30)
    resp.raise_for_status()
    return resp.json()["id"]


def hold(tmp: Path, n: int, seconds: float, heartbeat: float) -> dict[str, Any]:
    """``n`` idle streams on one message that never produces a token."""
    server = start_server(tmp, f"hold{n}", {}, 64, gate_after=1, heartbeat=heartbeat)
    clients = Clients(server.url)
    try:
        mid = create_message(server.url, 16)
        time.sleep(0.5)  # let the server settle before the baseline
        base = rss_bytes(server.pid)
        t0 = time.monotonic()
        clients.open([(f"/v1/messages/{mid}/stream", 0)] * n, wait="entry")
        connect = time.monotonic() - t0
        rec = clients.record(seconds, server.pid)
        rss = rss_bytes(server.pid)
        pingless = sum(s.last_ping is None for s in clients.streams)
        alive = sum(not s.closed for s in clients.streams)
    finally:
        clients.close()
        os.kill(server.pid, signal.SIGUSR1)  # let the message finish, so the drain is quick
        server.stop()
    return {
        "streams": n,
        "alive": alive,
        "connect_seconds": connect,
        "rss_base_bytes": base,
        "rss_bytes": rss,
        "rss_per_stream_bytes": (rss - base) / n,
        "window_seconds": rec.window,
        "pings": rec.pings,
        "ping_gap_p50": pct(rec.ping_gaps, 50),
        "ping_gap_p99": pct(rec.ping_gaps, 99),
        "ping_gap_max": max(rec.ping_gaps, default=None),
        "streams_without_ping": pingless,
        "server_cpu_share": rec.server_cpu,
        "client_cpu_share": rec.client_cpu,
        "client_failures": clients.failures[:5],
    }


def fanout(tmp: Path, n: int, messages: int, rate: float, seconds: float, heartbeat: float) -> dict[str, Any]:
    """``n`` streams over ``messages`` live messages, ``rate`` entries/s each."""
    tokens = int(rate * (seconds + 30)) + 50  # outlasts the window
    server = start_server(tmp, f"fan{n}", {"step_seconds": 1.0 / rate, "piece_bytes": 4}, tokens * 4,
                          gate_after=messages, heartbeat=heartbeat)
    clients = Clients(server.url)
    try:
        ids = [create_message(server.url, tokens + 1) for _ in range(messages)]
        t0 = time.monotonic()
        paths = [(f"/v1/messages/{ids[i % messages]}/stream", i % messages) for i in range(n)]
        clients.open(paths, wait="entry")
        connect = time.monotonic() - t0
        os.kill(server.pid, signal.SIGUSR1)  # open the gate: every message generates from now on
        clients.record(1.0, server.pid)  # settle
        rec = clients.record(seconds, server.pid, spread=True)
        rss = rss_bytes(server.pid)
        alive = sum(not s.closed for s in clients.streams)
        for mid in ids:
            httpx.post(f"{server.url}/v1/messages/{mid}/cancel", timeout=30)
    finally:
        clients.close()
        server.stop()
    spreads = [rec.last[k] - rec.first[k] for k in rec.first]
    return {
        "streams": n,
        "alive": alive,
        "messages": messages,
        "entry_rate_per_message": rate,
        "offered_entries_per_second": n * rate,
        "connect_seconds": connect,
        "window_seconds": rec.window,
        "entries": rec.entries,
        "delivered_entries_per_second": rec.entries / rec.window,
        "delivered_share": rec.entries / rec.window / (n * rate),
        "entry_gap_p50": pct(rec.entry_gaps, 50),
        "entry_gap_p99": pct(rec.entry_gaps, 99),
        "spread_p50": pct(spreads, 50),
        "spread_p99": pct(spreads, 99),
        "rss_bytes": rss,
        "server_cpu_share": rec.server_cpu,
        "client_cpu_share": rec.client_cpu,
        "client_failures": clients.failures[:5],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--heartbeat", type=float, default=5.0, help="server.heartbeat_interval (seconds, >= 1)")
    ap.add_argument("--hold-seconds", type=float, default=12.0, help="heartbeat window per stream count")
    ap.add_argument("--messages", type=int, default=4, help="live messages the fan-out streams follow")
    ap.add_argument("--entry-rate", type=float, default=20.0, help="entries per second per message")
    ap.add_argument("--fanout-seconds", type=float, default=10.0, help="measured window per stream count")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of both experiments")
    args = ap.parse_args(argv)
    limit = raise_fd_limit(2 * max(args.streams) + 1000)
    if limit < max(args.streams) + 100:
        sys.exit(f"the open-file limit is {limit}, too low for {max(args.streams)} streams (raise the hard limit)")
    info = machine()
    print(f"gateway on the fake engine: streams {args.streams}, heartbeat {args.heartbeat:g} s, fan-out over {args.messages}"
          f" messages at {args.entry_rate:g} entries/s each, {args.rounds} round(s)")
    print(machine_line(info), flush=True)

    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"hold": {}, "fanout": {}}
    with tempfile.TemporaryDirectory(prefix="ringserve-gateway-") as tmp_name:
        tmp = Path(tmp_name)
        for r in range(args.rounds):
            for n in args.streams:
                h = hold(tmp, n, args.hold_seconds, args.heartbeat)
                runs["hold"].setdefault(n, []).append(h)
                print(f"  round {r + 1} hold {n:>5}: {h['rss_per_stream_bytes'] / 1024:.1f} KiB/stream,"
                      f" ping gap p99 {fmt(h['ping_gap_p99'], 1e3, 0)} ms, connected in {h['connect_seconds']:.1f} s",
                      flush=True)
                f = fanout(tmp, n, args.messages, args.entry_rate, args.fanout_seconds, args.heartbeat)
                runs["fanout"].setdefault(n, []).append(f)
                print(f"  round {r + 1} fan-out {n:>5}: {f['delivered_entries_per_second']:.0f} entries/s"
                      f" of {f['offered_entries_per_second']:.0f} offered, gap p99 {fmt(f['entry_gap_p99'], 1e3, 0)} ms,"
                      f" spread p99 {fmt(f['spread_p99'], 1e3, 0)} ms", flush=True)

    def med(kind: str, n: int, key: str) -> float | None:
        return median(x[key] for x in runs[kind][n])

    hold_keys = ["rss_per_stream_bytes", "rss_bytes", "ping_gap_p50", "ping_gap_p99", "ping_gap_max",
                 "streams_without_ping", "server_cpu_share", "connect_seconds"]
    fan_keys = ["delivered_entries_per_second", "offered_entries_per_second", "delivered_share", "entry_gap_p50",
                "entry_gap_p99", "spread_p50", "spread_p99", "rss_bytes", "server_cpu_share", "client_cpu_share"]
    summary = {
        n: {"hold": {k: med("hold", n, k) for k in hold_keys}, "fanout": {k: med("fanout", n, k) for k in fan_keys}}
        for n in args.streams
    }
    print(f"\nheld streams (medians of {args.rounds} round(s)):")
    print(table(
        ["streams", "RSS MiB", "KiB/stream", "ping gap p50/p99/max ms", "no ping", "server CPU", "connect s"],
        [[n, fmt(s["hold"]["rss_bytes"], 2**-20), fmt(s["hold"]["rss_per_stream_bytes"], 1 / 1024),
          (f"{fmt(s['hold']['ping_gap_p50'], 1e3, 0)}/{fmt(s['hold']['ping_gap_p99'], 1e3, 0)}"
           f"/{fmt(s['hold']['ping_gap_max'], 1e3, 0)}"),
          fmt(s["hold"]["streams_without_ping"], digits=0), f"{100 * s['hold']['server_cpu_share']:.0f}%",
          fmt(s["hold"]["connect_seconds"])]
         for n, s in summary.items()],
    ))
    print(f"\nfan-out (medians of {args.rounds} round(s)):")
    print(table(
        ["streams", "delivered entries/s", "offered", "share", "gap p50/p99 ms", "spread p50/p99 ms",
         "server/client CPU"],
        [[n, fmt(s["fanout"]["delivered_entries_per_second"], digits=0),
          fmt(s["fanout"]["offered_entries_per_second"], digits=0), f"{100 * s['fanout']['delivered_share']:.0f}%",
          f"{fmt(s['fanout']['entry_gap_p50'], 1e3, 0)}/{fmt(s['fanout']['entry_gap_p99'], 1e3, 0)}",
          f"{fmt(s['fanout']['spread_p50'], 1e3, 0)}/{fmt(s['fanout']['spread_p99'], 1e3, 0)}",
          f"{100 * s['fanout']['server_cpu_share']:.0f}%/{100 * s['fanout']['client_cpu_share']:.0f}%"]
         for n, s in summary.items()],
    ))

    payload = {
        "benchmark": "gateway",
        "machine": info,
        "engine": "ringserve.engine.fake.FakeEngine (no model)",
        "heartbeat_interval_seconds": args.heartbeat,
        "messages": args.messages,
        "entry_rate_per_message": args.entry_rate,
        "summary": {str(n): v for n, v in summary.items()},
        "runs": {kind: {str(n): v for n, v in by_n.items()} for kind, by_n in runs.items()},
    }
    print(f"\nwrote {write_json('gateway', payload)}")

    fig, axes = figure(ncols=2, width=10, height=3.8)
    ax, ax2 = axes[0]
    ns = args.streams
    ax.plot(ns, [summary[n]["hold"]["rss_per_stream_bytes"] / 1024 for n in ns], marker="o", label="KiB per stream")
    ax.set_xscale("log")
    ax.set_xlabel(f"concurrent SSE streams (idle, {args.heartbeat:g} s heartbeats)")
    ax.set_ylabel("server RSS per stream (KiB)")
    ax.set_title("Streams held")
    axb = ax.twinx()
    axb.plot(ns, [1e3 * (summary[n]["hold"]["ping_gap_p99"] or math.nan) for n in ns], marker="x", ls="--", color="C1",
             label="ping gap p99 (ms)")
    axb.set_ylabel("ping gap p99 (ms)")
    ax.legend(loc="upper left", fontsize=7)
    axb.legend(loc="upper right", fontsize=7)
    ax2.plot(ns, [summary[n]["fanout"]["offered_entries_per_second"] for n in ns], ls=":", color="0.5",
             label="offered")
    ax2.plot(ns, [summary[n]["fanout"]["delivered_entries_per_second"] for n in ns], marker="o", label="delivered")
    for n in ns:
        ax2.annotate(f"p99 gap {fmt(summary[n]['fanout']['entry_gap_p99'], 1e3, 0)} ms",
                     (n, summary[n]["fanout"]["delivered_entries_per_second"]), fontsize=7,
                     textcoords="offset points", xytext=(0, 6), ha="center")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrent SSE streams")
    ax2.set_ylabel("entries/s")
    ax2.set_title(f"Fan-out ({args.messages} messages, {args.entry_rate:g} entries/s each)")
    ax2.legend(fontsize=7)
    print(f"wrote {save_figure(fig, 'gateway', info)}")
    return payload


if __name__ == "__main__":
    main()
