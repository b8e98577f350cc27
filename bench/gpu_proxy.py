"""The GPU-rate proxy (issue 35): does one process deliver the engine's token rate at 64-256 streams?

``python bench/gpu_proxy.py [--tree DIR ...] [--levels 64:10:300 128:10:300 256:25:200]
[--surfaces anthropic openai responses] [--rounds 3] [--profile]``

A GPU decodes a batch while the CPU is free; the fake engine stands in for it:
every decode call sleeps ``step_seconds`` with the GIL released
(``FakeEngine(step_seconds=...)``, ``bench/fake_server.py``), so the engine
alone would make ``streams / step`` tokens a second. Each level
``STREAMS:STEP_MS:TOKENS`` starts one server per source tree with
``[engine] slots`` = STREAMS (``overlap`` as ``auto`` decides, which is ``on``
here: the fake engine takes no core), a KV pool (``[model] ctx_size``) that holds
every stream at once, ``[limits] max_readers_per_client = 0``
and the default ``[stream]`` flush settings, then, per round and surface,
STREAMS clients each stream one reply of TOKENS tokens (4 bytes each) at once.

The clients are raw sockets on one ``selectors`` loop in this process (no
HTTP library while they stream: they only ``recv`` and keep the bytes; the
replies are parsed after the burst, with ``h11`` and the Python client's wire
readers, to check that every stream got its TOKENS tokens and its terminal
event). The machine's cores are shared by the server and this client, so
both CPU times are recorded.

Per burst:

* **ratio** delivered / engine-bound rate: the ideal wall time
  ``(TOKENS + 1) * step`` (a prefill step, then one token per step) over the
  burst's wall time, from sending the requests to the last stream's end;
* delivered tokens per second over all streams;
* the server's CPU per streamed token (µs; user + system of every thread,
  ``/proc/PID/stat``), and the event loop's (the main thread's) alone;
* the client's CPU as a share of one core over the burst;
* the engine's busy share: ``ringserve_decode_seconds_total`` over the wall
  time (what a GPU would be busy for), and decode steps;
* the engine's idle share between steps: ``ringserve_engine_idle_seconds_total``
  over itself plus the decode seconds (None for a tree without that metric), and
  the part of it the engine waited for the event loop after a step
  (``ringserve_loop_lag_seconds_total``, issue 42);
* the gap a reader sees: between two reads of one stream that brought bytes (p50, p99);
* first byte p50 / p99 and the spread of the streams' ends.

Trees are interleaved (A, B, then B, A in the next round), so a neighbour's
load hits both alike; the summary gives medians over rounds and, with two
trees or more, each tree's figures over the first tree's per round.
``--profile`` records the first tree's server with ``py-spy`` (its bench
extra) during every burst of the first round (``--idle``, all threads, raw
samples: ``bench/results/gpu_proxy-<level>-<surface>.txt``, folded stacks).

Goal (issue 42, after issue 35's): a ratio of at least 0.95 at 64 streams and 0.90 at 128 with
10 ms steps, 0.85 at 256 streams with 25 ms steps, on every surface; at most
60 µs of server CPU per token at every count. The readers' gap (between two reads of one
stream that brought bytes, after the first) is printed beside it: what coalescing costs a reader.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
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
    save_figure,
    scrape,
    table,
    write_json,
)
from ringserve.client._wires import WIRES, Reading  # noqa: E402
from ringserve.core.sse import SSEParser  # noqa: E402

PIECE_BYTES = 4
"""Bytes per fake token (ASCII: 4 characters)."""

WAVE = 50
"""Connections opened at once (under hypercorn's listen backlog of 100)."""

GOALS = {(64, 10.0): 0.95, (128, 10.0): 0.90, (256, 25.0): 0.85}
"""Issue 42's delivered / engine-bound ratio goals, by (streams, step ms)."""

CPU_GOAL_US = 60.0
"""Issue 42's goal for the server's CPU per streamed token at every stream count (µs)."""


@attrs.frozen
class Level:
    """``streams`` concurrent replies of ``tokens`` tokens each, with decode steps of ``step_ms``."""

    streams: int
    step_ms: float
    tokens: int

    @classmethod
    def parse(cls, text: str) -> Level:
        streams, step_ms, tokens = text.split(":")
        return cls(int(streams), float(step_ms), int(tokens))

    @property
    def name(self) -> str:
        return f"{self.streams}x{self.step_ms:g}ms"

    @property
    def ideal_seconds(self) -> float:
        """The engine-bound wall time: one prefill step, then one step per token."""
        return (self.tokens + 1) * self.step_ms / 1000


@attrs.define(eq=False)
class Stream:
    """One client connection, the bytes it got and when (``time.monotonic``) each read got them."""

    sock: socket.socket
    request: bytes
    sent: int = 0
    chunks: list[bytes] = attrs.Factory(list)
    times: list[float] = attrs.Factory(list)
    first: float | None = None
    end: float | None = None


def request_bytes(host: str, surface: str, tokens: int) -> bytes:
    """The HTTP/1.1 request of one stream (``Connection: close``: its end is the server's close)."""
    wire = WIRES[surface]
    body = json.dumps(wire.body([{"role": "user", "content": "go"}], model="fake", max_tokens=tokens,
                                system=None, params={})).encode()
    head = (f"POST {wire.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def burst(url: str, request: bytes | Sequence[bytes], n: int, timeout: float) -> tuple[list[Stream], float]:
    """Connect ``n`` sockets, send ``request`` on each at once (or the ``i``-th of a sequence of
    ``n`` on the ``i``-th), read until every one is closed.

    Returns the streams and the time (``time.monotonic``) the first request was sent.

    Raises:
        RuntimeError: a connection failed, or the streams did not end within ``timeout`` seconds.
    """
    parts = urlsplit(url)
    addr = (parts.hostname or "127.0.0.1", parts.port or 80)
    sel = selectors.DefaultSelector()
    streams: list[Stream] = []
    requests = [request] * n if isinstance(request, bytes) else list(request)
    try:
        for i in range(0, n, WAVE):  # connect in waves, and wait until each wave is connected
            wave = []
            for j in range(i, min(n, i + WAVE)):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                err = sock.connect_ex(addr)
                if err not in (0, errno.EINPROGRESS):
                    raise RuntimeError(f"connect: {os.strerror(err)}")
                s = Stream(sock, requests[j])
                wave.append(s)
                sel.register(sock, selectors.EVENT_WRITE, s)
            pending = set(wave)
            deadline = time.monotonic() + 30
            while pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(pending)} connections not made in 30 s")
                for key, _ in sel.select(1.0):
                    s = key.data
                    if s in pending:
                        err = s.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err:
                            raise RuntimeError(f"connect: {os.strerror(err)}")
                        pending.discard(s)
                        sel.modify(s.sock, selectors.EVENT_READ, s)
            streams += wave
        t0 = time.monotonic()
        for s in streams:  # a request of a few hundred bytes fits the socket's buffer: sent at once
            s.sent = s.sock.send(s.request)
            if s.sent < len(s.request):
                sel.modify(s.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, s)
        open_ = len(streams)
        deadline = t0 + timeout
        while open_:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{open_} of {n} streams did not end in {timeout:.0f} s")
            events = sel.select(1.0)
            now = time.monotonic()
            for key, mask in events:
                s = key.data
                if mask & selectors.EVENT_WRITE and s.sent < len(s.request):
                    s.sent += s.sock.send(s.request[s.sent:])
                    if s.sent == len(s.request):
                        sel.modify(s.sock, selectors.EVENT_READ, s)
                if not mask & selectors.EVENT_READ:
                    continue
                try:
                    data = s.sock.recv(262144)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    if s.first is None:
                        s.first = now
                    s.chunks.append(data)
                    s.times.append(now)
                    continue
                s.end = now
                sel.unregister(s.sock)
                s.sock.close()
                open_ -= 1
        return streams, t0
    finally:
        for s in streams:
            if s.end is None:
                s.sock.close()
        sel.close()


def check(surface: str, raw: bytes) -> tuple[int, str | None]:
    """The tokens of text one stream's response carried, and what was wrong with it (None: nothing)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    status, body = None, bytearray()
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif event in (h11.NEED_DATA, h11.PAUSED) or isinstance(
                event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    if status != 200:
        return 0, f"HTTP {status}: {bytes(body[:200])!r}"
    wire, reading, text = WIRES[surface], Reading(), []
    for sse in SSEParser().feed(bytes(body)):
        text.append(wire.read(sse.event, wire.decode(sse.data), reading).text)
    chars = len("".join(text))
    if reading.error is not None or not reading.terminal:
        return chars // PIECE_BYTES, f"ended without its terminal event: {reading.error}"
    return chars // PIECE_BYTES, None


def start(tree: Path, tmp: Path, tag: str, level: Level, extra: Sequence[str] = ()) -> ServerProcess:
    """A fake-engine server of ``tree`` for ``level``; ``extra``: ``TABLE.KEY=JSON`` settings over its
    config."""
    tables: dict[str, dict[str, Any]] = {
        "server": {"port": 0},
        # the KV pool every slot shares holds every stream at once (the fake engine's default, 16,384
        # cells, admitted 63 streams of 300 tokens and queued the others behind them)
        "model": {"ctx_size": level.streams * (level.tokens + 64)},
        "engine": {"slots": level.streams, "ctx_per_slot": level.tokens + 64, "queue_size": level.streams},
        "store": {"path": str(tmp / f"{tag}.sqlite3")},
        "limits": {"max_readers_per_client": 0},
    }
    cfg = ringserve_config(tmp / f"{tag}.toml", tables, extra)
    fake = {"piece_bytes": PIECE_BYTES, "step_seconds": level.step_ms / 1000}
    return ServerProcess([python(), str(tree / "bench" / "fake_server.py"), "--config", str(cfg),
                          "--fake", json.dumps(fake),
                          "--reply-bytes", str(PIECE_BYTES * (level.tokens + 16))],
                         tmp / f"{tag}.log", ready_pattern=RINGSERVE_READY)


def profiler(pid: int, name: str) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of process ``pid`` into ``bench/results/NAME.txt`` (folded stacks), or None
    without py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("  (no py-spy: pip install -e '.[bench]')")
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([spy, "record", "-p", str(pid), "--idle", "--threads", "--rate", "250",
                             "--format", "raw", "-o", str(RESULTS / f"{name}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(server: ServerProcess, surface: str, level: Level, spy_name: str | None = None) -> dict[str, Any]:
    """One burst of ``level`` on ``surface``: the figures the module docstring lists."""
    host = urlsplit(server.url).netloc
    warm, _ = burst(server.url, request_bytes(host, surface, 4), 1, 30)  # the route, the JSON encoders
    assert check(surface, b"".join(warm[0].chunks))[1] is None, f"warm-up failed on {surface}"
    request = request_bytes(host, surface, level.tokens)
    before = scrape(server.url)
    cpu0, loop0, client0 = cpu_seconds(server.pid), cpu_seconds(server.pid, server.pid), time.process_time()
    spy = profiler(server.pid, spy_name) if spy_name else None
    streams, t0 = burst(server.url, request, level.streams, timeout=60 + 20 * level.ideal_seconds)
    client = time.process_time() - client0
    cpu, loop = cpu_seconds(server.pid) - cpu0, cpu_seconds(server.pid, server.pid) - loop0
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    after = scrape(server.url)
    ends = [s.end for s in streams if s.end is not None]
    wall = max(ends) - t0
    counted = [check(surface, b"".join(s.chunks)) for s in streams]
    errors = sorted({e for _, e in counted if e is not None})
    short = sum(n != level.tokens for n, _ in counted)
    tokens = level.streams * level.tokens
    gaps = [b - a for s in streams for a, b in itertools.pairwise(s.times[1:])]  # after the head's read
    decode = after["ringserve_decode_seconds_total"] - before["ringserve_decode_seconds_total"]
    idle_key, lag_key = "ringserve_engine_idle_seconds_total", "ringserve_loop_lag_seconds_total"
    idle = after[idle_key] - before[idle_key] if idle_key in after else None
    lag = after[lag_key] - before[lag_key] if lag_key in after else None
    return {
        "wall_seconds": wall,
        "ratio": level.ideal_seconds / wall,
        "tokens_per_second": tokens / wall,
        "ideal_tokens_per_second": tokens / level.ideal_seconds,
        "server_cpu_us_per_token": cpu / tokens * 1e6,
        "event_loop_cpu_us_per_token": loop / tokens * 1e6,
        "server_cpu_share": cpu / wall,
        "client_cpu_share": client / wall,
        "decode_busy_share": decode / wall,
        "engine_idle_share": None if idle is None else idle / (idle + decode),
        "loop_lag_share": None if idle is None or lag is None else lag / (idle + decode),
        "decode_steps": after["ringserve_decode_steps_total"] - before["ringserve_decode_steps_total"],
        "gap_p50": pct(gaps, 50),
        "gap_p99": pct(gaps, 99),
        "gap_max": max(gaps, default=None),
        "reads_per_stream": median(len(s.times) for s in streams),
        "first_byte_p50": pct((s.first - t0 for s in streams if s.first is not None), 50),
        "first_byte_p99": pct((s.first - t0 for s in streams if s.first is not None), 99),
        "end_spread": max(ends) - min(ends),
        "streams_short": short,
        "errors": errors[:5],
        "load_average_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append",
                    help="a ringserve source tree (repeatable; default: this one)")
    ap.add_argument("--levels", type=Level.parse, nargs="+",
                    default=[Level(64, 10, 300), Level(128, 10, 300), Level(256, 25, 200)],
                    help="STREAMS:STEP_MS:TOKENS (default: 64:10:300 128:10:300 256:25:200)")
    ap.add_argument("--surfaces", nargs="+", choices=sorted(WIRES),
                    default=["anthropic", "openai", "responses"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", action="append", default=[],
                    help="TABLE.KEY=JSON over every server's config (repeatable), e.g. stream.flush_ms=50")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy the first tree's server in the first round")
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    names = [t.name if list(map(lambda x: x.name, trees)).count(t.name) == 1 else str(t) for t in trees]
    raise_fd_limit(2 * max(level.streams for level in args.levels) + 200)
    info = machine()
    print(f"GPU-rate proxy (fake engine, decode steps sleep without the GIL): levels"
          f" {' '.join(f'{lv.name}x{lv.tokens}tok' for lv in args.levels)},"
          f" surfaces {' '.join(args.surfaces)},"
          f" {args.rounds} round(s), trees {' '.join(names)}" + "".join(f", {c}" for c in args.config))
    print(machine_line(info), flush=True)
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {
        name: {lv.name: {s: [] for s in args.surfaces} for lv in args.levels} for name in names}
    with tempfile.TemporaryDirectory(prefix="ringserve-gpu-proxy-") as tmp:
        for level in args.levels:
            servers = {}
            try:
                for i, tree in enumerate(trees):
                    servers[names[i]] = start(tree, Path(tmp), f"{level.name}-{i}", level, args.config)
                for r in range(args.rounds):
                    order = names if r % 2 == 0 else names[::-1]
                    for surface in args.surfaces:
                        for name in order:
                            profiled = args.profile and r == 0 and name == names[0]
                            spy = f"gpu_proxy-{level.name}-{surface}" if profiled else None
                            m = measure(servers[name], surface, level, spy)
                            runs[name][level.name][surface].append(m)
                            print(f"  round {r + 1} {level.name} {surface:>9} {name}: ratio {m['ratio']:.2f},"
                                  f" {m['tokens_per_second']:.0f} tok/s"
                                  f" of {m['ideal_tokens_per_second']:.0f},"
                                  f" server {m['server_cpu_us_per_token']:.0f} µs/token (loop"
                                  f" {m['event_loop_cpu_us_per_token']:.0f}),"
                                  f" decode busy {m['decode_busy_share']:.2f}"
                                  f" (idle between steps {fmt(m['engine_idle_share'], digits=2)},"
                                  f" of which the loop's lag {fmt(m['loop_lag_share'], digits=2)}),"
                                  f" gap p50/p99 {fmt(m['gap_p50'], 1e3)}/{fmt(m['gap_p99'], 1e3)} ms,"
                                  f" client CPU {m['client_cpu_share']:.2f}, load {m['load_average_1m']:.1f}"
                                  + (f", {m['streams_short']} streams short, {m['errors']}"
                                     if m["streams_short"] or m["errors"] else ""),
                                  flush=True)
            finally:
                for server in servers.values():
                    server.stop()

    def series(name: str, level: Level, surface: str, key: str) -> list[float]:
        return [m[key] for m in runs[name][level.name][surface]]

    rows = []
    for level in args.levels:
        goal = GOALS.get((level.streams, level.step_ms))
        for surface in args.surfaces:
            for name in names:
                ratio = series(name, level, surface, "ratio")
                us = series(name, level, surface, "server_cpu_us_per_token")
                row = [level.name, level.tokens, surface, name, " ".join(f"{x:.2f}" for x in ratio),
                       f"{median(ratio):.2f}",
                       "-" if goal is None else f"{goal:.2f}",
                       f"{median(series(name, level, surface, 'tokens_per_second')):.0f}",
                       " ".join(f"{x:.0f}" for x in us), f"{median(us):.0f}",
                       f"{median(series(name, level, surface, 'event_loop_cpu_us_per_token')):.0f}",
                       f"{median(series(name, level, surface, 'decode_busy_share')):.2f}",
                       fmt(median(series(name, level, surface, "engine_idle_share")), digits=2),
                       f"{fmt(median(series(name, level, surface, 'gap_p50')), 1e3)}"
                       f"/{fmt(median(series(name, level, surface, 'gap_p99')), 1e3)}",
                       f"{median(series(name, level, surface, 'client_cpu_share')):.2f}"]
                if len(names) > 1:
                    base_ratio = series(names[0], level, surface, "ratio")
                    base_us = series(names[0], level, surface, "server_cpu_us_per_token")
                    gap, base_gap = (series(name, level, surface, "gap_p50"),
                                     series(names[0], level, surface, "gap_p50"))
                    row += [" ".join(f"{a / b:.2f}" for a, b in zip(ratio, base_ratio, strict=True)),
                            " ".join(f"{a / b:.2f}" for a, b in zip(us, base_us, strict=True)),
                            " ".join(f"{a / b:.2f}" for a, b in zip(gap, base_gap, strict=True) if a and b)]
                rows.append(row)
    headers = ["level", "tokens", "surface", "tree", "ratio per round", "median", "goal", "tok/s",
               "server µs/token per round", "median", "loop µs/token", "decode busy", "engine idle",
               "read gap p50/p99 ms", "client CPU"]
    if len(names) > 1:
        headers += [f"ratio / {names[0]} per round", f"µs/token / {names[0]} per round",
                    f"gap p50 / {names[0]} per round"]
    goals = ", ".join(f"{g:.2f} at {s}x{st:g}ms" for (s, st), g in GOALS.items())
    print(f"\ndelivered / engine-bound rate (goal: {goals};"
          f" server CPU <= {CPU_GOAL_US:.0f} µs/token)")
    print(table(headers, rows))
    payload = {"benchmark": "gpu_proxy", "machine": info, "trees": [str(t) for t in trees], "names": names,
               "levels": [attrs.asdict(lv) for lv in args.levels], "surfaces": args.surfaces,
               "rounds": args.rounds, "config": args.config, "runs": runs}
    fig, axes = figure(ncols=2, width=11, height=4)
    ax, ax2 = axes[0]
    labels = [f"{lv.name}\n{s}" for lv in args.levels for s in args.surfaces]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(labels))]
        cells = [(lv, s) for lv in args.levels for s in args.surfaces]
        ax.bar(xs, [median(series(name, lv, s, "ratio")) or 0 for lv, s in cells], width, label=name)
        ax2.bar(xs, [median(series(name, lv, s, "server_cpu_us_per_token")) or 0 for lv, s in cells],
                width, label=name)
    for a, ylabel in ((ax, "delivered / engine-bound rate"), (ax2, "server CPU µs per token")):
        a.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=6)
        a.set_ylabel(ylabel)
        a.legend(fontsize=7)
    ax.axhline(0.95, ls=":", color="0.5")
    ax2.axhline(CPU_GOAL_US, ls=":", color="0.5")
    print(f"wrote {write_json('gpu_proxy', payload)} and {save_figure(fig, 'gpu_proxy', info)}")
    return payload


if __name__ == "__main__":
    main()
