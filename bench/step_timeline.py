"""Where a decode step's time goes: ringserve's step timeline against the raw loop's (issue 42).

``python bench/step_timeline.py [--streams 1 4 8] [--tokens 128] [--rounds 3] [--threads 2]
[--kv unified|split] [--overlap auto|on|off] [--llama-server PATH]``

Per round and stream count, interleaved: a burst of that many streamed chat
completions on a ringserve server whose process carries a probe (below), the
raw llama-cpp-python loop (:class:`bench.raw_decode.RawDecoder`, the same probe
on its decode calls) and, with ``--llama-server``, llama.cpp's server (its own
``timings.predicted_per_token_ms``). The clients are raw sockets on one
``selectors`` loop (``bench/gpu_proxy.py``'s ``burst``: no HTTP library while
they stream), each prompt made unique (no prefix-cache hit), greedy,
``--tokens`` tokens each. The same KV layout on every side: ``--kv unified``
(ringserve's default ``[model] kv_unified``, llama-server's ``-kvu``, the raw
loop's ``kv_unified``; 2,048 cells per slot) or ``split`` (one pool per
sequence of 2,048 cells, llama-server's default with ``-np``).

The probe (``step_timeline.py serve``: ``ringserve serve`` with the probe
installed, in its own process) wraps, without changing them, the runner's
step (``Runner._step``, ``_step_sync``, ``_after_submit``), the engine
thread's hand-over (``EngineThread.run``), ``llama_decode`` itself and the
serial mode's ``wait_all_tasks_blocked``, and adds a Trio instrument. Per decode
step it records, on the ``time.perf_counter`` clock:

* **hop in**: from the runner handing the step to the engine thread to that
  thread starting it;
* **before**: the engine thread's work before ``llama_decode`` (slots cleared
  and begun, the batch filled and checked);
* **llama_decode**: the call itself;
* **sampling**: ``decode()`` after ``llama_decode`` (a token per sequence);
* **hop out**: from the engine thread's end to the runner running again;
* **tokens**: the runner's pass over the step's tokens (``Runner._step`` after
  the hop);
* **consumers**: ``_after_submit`` (tokens into events, the producers' pass) and,
  with overlap off, ``wait_all_tasks_blocked`` (the readers, the HTTP writes);
* **rest**: releases, the plan, until the next step is handed over;
* during ``llama_decode``: the event loop's wake-ups (``after_io_wait``), the
  Trio thread's CPU time, and the run-queue wait of every other thread of the
  process (the decode threads waiting for a core:
  ``/proc/self/task/*/schedstat``), and which tasks ran.

Steady steps only: those that decode exactly one token per stream (no
prefill, every stream still running). Medians over them per burst, then
medians over rounds. ``serve`` dumps what it recorded to ``--out`` on
``SIGUSR1`` and starts over.

Writes ``bench/results/step_timeline.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RINGSERVE_READY,
    ServerProcess,
    figure,
    fmt,
    llama_server,
    machine,
    machine_line,
    median,
    pct,
    python,
    ringserve_config,
    save_figure,
    table,
    write_json,
)
from bench.http_streams import CTX_PER_SLOT, SETTLE_SECONDS, chatml, messages  # noqa: E402
from bench.raw_decode import RawDecoder  # noqa: E402
from ringserve.engine._native import llama_cpp as lc  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402

FLASH_ATTN = {"on": True, "off": False, "auto": None}
"""``--flash-attn`` as :class:`RawDecoder` takes it."""

PARTS = ("hop_in", "before", "llama_decode", "sampling", "hop_out", "tokens", "consumers", "rest")
"""A step's parts in order (module docstring); they add up to the time from one hand-over to the next."""

RAW_PARTS = ("before", "llama_decode", "sampling", "rest")
"""The raw loop's: filling the batch, the call, sampling, and the loop's bookkeeping until the next one."""


def _schedstat(skip: int) -> tuple[float, float]:
    """(CPU seconds of thread ``skip``, run-queue wait seconds of every other thread of this process)
    so far."""
    own, waited = 0.0, 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{task}/schedstat").read_text().split()
        except OSError:  # the thread ended
            continue
        if int(task) == skip:
            own = int(fields[0]) / 1e9
        else:
            waited += int(fields[1]) / 1e9
    return own, waited


class DecodeProbe:
    """Times each ``llama_decode`` of this process, with the Trio thread's CPU and the others' run-queue
    wait across it (:func:`_schedstat`; ``main`` is the thread whose CPU is taken)."""

    def __init__(self, main: int) -> None:
        self.main = main
        self.calls: list[dict[str, float]] = []
        self.decoding = False
        real = lc.llama_decode

        @functools.wraps(real)
        def llama_decode(ctx: Any, batch: Any) -> int:
            cpu0, wait0 = _schedstat(self.main)
            self.decoding = True
            t0 = time.perf_counter()
            try:
                return real(ctx, batch)
            finally:
                t1 = time.perf_counter()
                self.decoding = False
                cpu1, wait1 = _schedstat(self.main)
                self.calls.append(
                    {
                        "start": t0,
                        "end": t1,
                        "tokens": batch.n_tokens,
                        "main_cpu": cpu1 - cpu0,
                        "others_wait": wait1 - wait0,
                    }
                )

        lc.llama_decode = llama_decode


class ServerProbe:
    """The probe of a ringserve server process (module docstring), installed by :meth:`install`."""

    def __init__(self) -> None:
        self.decode = DecodeProbe(threading.main_thread().native_id or 0)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.decode.calls = []
        self.runs: list[dict[str, float]] = []  # EngineThread.run of a _step_sync: call, return
        self.jobs: list[dict[str, float]] = []  # _step_sync on the engine thread: start, decoded, end
        self.steps: list[tuple[float, float]] = []  # Runner._step: enter, exit
        self.consumers: list[tuple[float, float]] = []  # _after_submit, wait_all_tasks_blocked
        self.wakeups: list[float] = []  # the event loop's returns from its I/O wait
        self.ran: collections.Counter[str] = collections.Counter()  # task steps during llama_decode

    def install(self) -> None:
        import trio
        import trio.testing

        from ringserve.engine import runner as runner_module
        from ringserve.engine.llama import LlamaEngine
        from ringserve.engine.runner import Runner
        from ringserve.engine.thread import EngineThread

        probe = self

        def timed_async(fn: Callable[..., Any], into: Callable[[float, float], None]) -> Callable[..., Any]:
            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    into(t0, time.perf_counter())

            return wrapper

        def timed(fn: Callable[..., Any], into: Callable[[float, float], None]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    into(t0, time.perf_counter())

            return wrapper

        step_sync = Runner._step_sync
        decode = LlamaEngine.decode
        run = EngineThread.run

        @functools.wraps(step_sync)
        def _step_sync(self: Runner, *args: Any) -> Any:
            job = {"start": time.perf_counter()}
            try:
                return step_sync(self, *args)
            finally:
                job["end"] = time.perf_counter()
                probe.jobs.append(job)

        @functools.wraps(decode)
        def decode_(self: LlamaEngine, feeds: Any) -> Any:
            try:
                return decode(self, feeds)
            finally:
                probe.decoded = time.perf_counter()

        @functools.wraps(run)
        async def run_(self: EngineThread, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await run(self, fn, *args, **kwargs)
            finally:
                if fn.__name__ == "_step_sync":
                    probe.runs.append({"call": t0, "return": time.perf_counter(), "decoded": probe.decoded})

        class Instrument(trio.abc.Instrument):
            def after_io_wait(self, timeout: float) -> None:
                probe.wakeups.append(time.perf_counter())

            def before_task_step(self, task: trio.lowlevel.Task) -> None:
                if probe.decode.decoding:
                    probe.ran[task.name.rsplit(".", 1)[-1]] += 1

        real_run = Runner.run

        @functools.wraps(real_run)
        async def runner_run(self: Runner, **kwargs: Any) -> None:
            trio.lowlevel.add_instrument(Instrument())
            await real_run(self, **kwargs)

        self.decoded = 0.0
        Runner._step_sync = _step_sync  # type: ignore[method-assign]
        Runner._step = timed_async(Runner._step, lambda a, b: probe.steps.append((a, b)))  # type: ignore[method-assign]
        Runner._after_submit = timed(
            Runner._after_submit,  # type: ignore[method-assign]
            lambda a, b: probe.consumers.append((a, b)),
        )
        Runner.run = runner_run  # type: ignore[method-assign]
        LlamaEngine.decode = decode_  # type: ignore[method-assign]
        EngineThread.run = run_  # type: ignore[method-assign]
        runner_module.trio.testing.wait_all_tasks_blocked = timed_async(  # type: ignore[attr-defined]
            trio.testing.wait_all_tasks_blocked, lambda a, b: probe.consumers.append((a, b))
        )

    def dump(self, path: Path) -> None:
        payload = {
            "calls": self.decode.calls,
            "runs": self.runs,
            "jobs": self.jobs,
            "steps": self.steps,
            "consumers": self.consumers,
            "wakeups": self.wakeups,
            "ran": dict(self.ran),
        }
        self.reset()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.rename(path)


def serve(argv: list[str]) -> int:
    """``step_timeline.py serve --config FILE --out FILE``: ringserve with the probe."""
    import logging

    from ringserve.config import Config
    from ringserve.server import run_process

    ap = argparse.ArgumentParser(prog="bench/step_timeline.py serve")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    probe = ServerProbe()
    probe.install()
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: probe.dump(args.out))
    return run_process(Config.from_toml(args.config))


def _within(times: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of the intervals in ``times`` that start within [lo, hi)."""
    return sum(b - a for a, b in times if lo <= a < hi)


def server_steps(rec: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The steady steps of one burst (``n`` tokens, one per stream), each part in seconds (module
    docstring)."""
    calls, runs, jobs, steps = rec["calls"], rec["runs"], rec["jobs"], rec["steps"]
    wakeups, consumers = rec["wakeups"], rec["consumers"]
    out = []
    # the k-th run, job, step and llama_decode call are one step (each _step_sync decodes once,
    # unless a begin failed, which a benchmark does not do)
    k_max = min(len(calls), len(runs), len(jobs), len(steps)) - 1
    for k in range(k_max):
        call, run, job, step, nxt = calls[k], runs[k], jobs[k], steps[k], runs[k + 1]
        if call["tokens"] != n or calls[k + 1]["tokens"] != n:
            continue
        overlapped = _within(consumers, run["call"], run["return"])  # overlap on: during the decode
        serial = _within(consumers, step[1], nxt["call"])  # overlap off: between the steps
        out.append(
            {
                "hop_in": job["start"] - run["call"],
                "before": call["start"] - job["start"],
                "llama_decode": call["end"] - call["start"],
                "sampling": run["decoded"] - call["end"],
                "hop_out": run["return"] - job["end"],
                "tokens": step[1] - run["return"],
                "consumers": serial + overlapped,
                "rest": nxt["call"] - step[1] - serial,
                "overlapped": overlapped,
                "between_decodes": calls[k + 1]["start"] - call["end"],
                "wakeups_during_decode": sum(call["start"] <= w < call["end"] for w in wakeups),
                "trio_cpu_during_decode": call["main_cpu"],
                "decode_threads_run_queue_wait": call["others_wait"],
                "step": nxt["call"] - run["call"],
            }
        )
    return out


def raw_steps(
    calls: list[dict[str, float]], marks: list[tuple[float, float]], n: int
) -> list[dict[str, Any]]:
    """The raw loop's timed steps: ``marks`` are each step's (start, end) around its fill, decode and
    samples."""
    steady = [c for c in calls if c["tokens"] == n][1:]  # after the warm-up step
    out = []
    for (start, end), (nstart, _), call, nxt in zip(marks, marks[1:], steady, steady[1:], strict=False):
        out.append(
            {
                "before": call["start"] - start,
                "llama_decode": call["end"] - call["start"],
                "sampling": end - call["end"],
                "rest": nstart - end,
                "between_decodes": nxt["start"] - call["end"],
                "wakeups_during_decode": 0,
                "trio_cpu_during_decode": 0.0,
                "decode_threads_run_queue_wait": call["others_wait"],
                "step": nstart - start,
            }
        )
    return out


class TimedRaw(RawDecoder):
    """:class:`RawDecoder` that marks each step's start and end."""

    marks: list[tuple[float, float]] = []

    def _step(self, last: list[int], pos: int) -> None:
        t0 = time.perf_counter()
        super()._step(last, pos)
        self.marks.append((t0, time.perf_counter()))


def request_bytes(host: str, tag: str, tokens: int) -> bytes:
    """One streamed, greedy OpenAI chat completion (``Connection: close``)."""
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": messages(tag),
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


TEXT = re.compile(rb'"content":"[^"]')
TIMINGS = re.compile(rb'"predicted_per_token_ms":([0-9.]+)')


def client_level(url: str, n: int, tokens: int, tag: str) -> dict[str, Any]:
    """A burst of ``n`` streams: tok/s (``n * tokens`` over the wall time), TTFT p50 (the first read that
    held text), and llama-server's own time per token where it says it."""
    from bench.gpu_proxy import burst

    host = urlsplit(url).netloc
    streams, t0 = burst(url, [request_bytes(host, f"{tag}-{i}", tokens) for i in range(n)], n, 600)
    ends = [s.end for s in streams if s.end is not None]
    ttft, per_token = [], []
    for s in streams:
        seen = b""
        for data, when in zip(s.chunks, s.times, strict=True):
            seen += data
            if TEXT.search(seen):
                ttft.append(when - t0)
                break
        per_token += [float(x) / 1e3 for x in TIMINGS.findall(b"".join(s.chunks))]
    return {
        "tokens_per_second": n * tokens / (max(ends) - t0),
        "ttft_p50": pct(ttft, 50),
        "server_per_token": median(per_token),
        "load_average_1m": os.getloadavg()[0],
    }


def summarize(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    keys = steps[0].keys() if steps else []
    return {k: median(s[k] for s in steps) for k in keys} | {"steps": len(steps)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        sys.exit(serve(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="decode threads on every side (0: every core)")
    ap.add_argument("--kv", choices=["unified", "split"], default="unified")
    ap.add_argument(
        "--overlap", choices=["auto", "on", "off"], default="auto", help="ringserve's [engine] overlap"
    )
    ap.add_argument(
        "--flash-attn",
        choices=["auto", "on", "off"],
        default="off",
        help="flash attention on every side: ringserve's [model] flash_attn, llama-server's -fa",
    )
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        help="TABLE.KEY=JSON added to ringserve's config (repeatable), e.g. stream.flush_ms=50",
    )
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    args = ap.parse_args(argv)
    model = args.model or default_model_path()
    threads = args.threads or os.cpu_count() or 1
    slots = max(args.streams)
    unified = args.kv == "unified"
    info = machine()
    print(
        f"step timeline: {model.name}, streams {args.streams}, {args.tokens} tokens, {args.rounds} rounds,"
        f" {threads} threads, KV {args.kv}, flash attention {args.flash_attn}, overlap {args.overlap}"
        + (f", config {' '.join(args.config)}" if args.config else "")
    )
    print(machine_line(info), flush=True)
    sides = ["ringserve", "raw loop"] + (["llama-server"] if args.llama_server else [])
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {s: {n: [] for n in args.streams} for s in sides}
    with tempfile.TemporaryDirectory(prefix="ringserve-timeline-") as tmp_name:
        tmp = Path(tmp_name)
        tables: dict[str, dict[str, Any]] = {
            "model": {
                "path": str(model),
                "n_threads": threads,
                "ctx_size": slots * CTX_PER_SLOT,
                "kv_unified": unified,
                "flash_attn": args.flash_attn,
            },
            "engine": {"slots": slots, "ctx_per_slot": CTX_PER_SLOT, "overlap": args.overlap},
            "store": {"path": str(tmp / "store.sqlite3")},
            "limits": {"max_readers_per_client": 0},
            "server": {"port": 0},  # a free port: not 8080, which another server may hold
        }
        cfg = ringserve_config(tmp / "ringserve.toml", tables, args.config)
        out = tmp / "probe.json"
        servers = {
            "ringserve": ServerProcess(
                [python(), __file__, "serve", "--config", str(cfg), "--out", str(out)],
                tmp / "ringserve.log",
                ready_pattern=RINGSERVE_READY,
            )
        }
        try:
            if args.llama_server:
                servers["llama-server"] = llama_server(
                    args.llama_server,
                    model,
                    tmp / "llama-server.log",
                    slots=slots,
                    ctx_per_slot=CTX_PER_SLOT,
                    threads=threads,
                    kv_unified=unified,
                    flash_attn=args.flash_attn,
                )
            print(
                "  " + next(line.strip() for line in servers["ringserve"].lines if "ready:" in line),
                flush=True,
            )
            for name, server in servers.items():
                client_level(server.url, 1, 4, f"warm-{name}")
            raw = TimedRaw(
                model,
                slots,
                args.tokens,
                n_threads=threads,
                kv_unified=unified,
                n_ctx=slots * CTX_PER_SLOT,
                flash_attn=FLASH_ATTN[args.flash_attn],
                prompt=chatml("raw"),
            )
            probe = DecodeProbe(threading.main_thread().native_id or 0)
            try:
                for r in range(args.rounds):
                    for n in args.streams:
                        for side in sides if r % 2 == 0 else sides[::-1]:
                            time.sleep(SETTLE_SECONDS)
                            if side == "raw loop":
                                runs[side][n].append(raw_level(raw, probe, n, args.tokens))
                                continue
                            level = client_level(servers[side].url, n, args.tokens, f"{r}-{n}")
                            if side == "ringserve":
                                level["timeline"] = summarize(server_steps(collect(servers[side], out), n))
                            runs[side][n].append(level)
                        print(
                            f"  round {r + 1}, {n} streams: "
                            + "; ".join(f"{s} {runs[s][n][-1]['tokens_per_second']:.1f} tok/s" for s in sides)
                            + f"; load {os.getloadavg()[0]:.1f}",
                            flush=True,
                        )
            finally:
                raw.close()
        finally:
            for server in servers.values():
                server.stop()
    return report(args, info, runs, sides, threads)


def raw_level(raw: TimedRaw, probe: DecodeProbe, n: int, tokens: int) -> dict[str, Any]:
    """The raw loop with ``n`` sequences (its own decoder per count: a batch holds every sequence)."""
    raw.marks, probe.calls = [], []
    if raw.n_seqs != n:
        raw.n_seqs = n  # the context holds the most; fewer sequences decode in the same context
    run = raw.run()
    steps = raw_steps(probe.calls, raw.marks[1:], n)  # the first mark is the warm-up step
    prefill = run.prefill_seconds
    return {
        "tokens_per_second": n * tokens / (prefill + sum(run.step_seconds)),
        "ttft_p50": prefill,
        "timeline": summarize(steps),
        "load_average_1m": os.getloadavg()[0],
    }


def collect(server: ServerProcess, out: Path) -> dict[str, Any]:
    """Have the probed server dump what it recorded (SIGUSR1); read it."""
    out.unlink(missing_ok=True)
    os.kill(server.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not out.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the probed server wrote no timeline")
        time.sleep(0.05)
    return json.loads(out.read_text())


def report(
    args: argparse.Namespace,
    info: dict[str, Any],
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    sides: list[str],
    threads: int,
) -> dict[str, Any]:
    def med(side: str, n: int, key: str, part: str | None = None) -> float | None:
        rows = runs[side][n]
        return median(
            (x["timeline"].get(part) if part else x.get(key)) for x in rows if part is None or "timeline" in x
        )

    headers = [
        "streams",
        "side",
        "tok/s",
        "TTFT ms",
        "step ms",
        *[f"{p} ms" for p in PARTS],
        "between decodes ms",
        "wake-ups in a decode",
        "Trio CPU in a decode ms",
        "decode threads waiting ms",
    ]
    rows = []
    for n in args.streams:
        for side in sides:
            row = [n, side, fmt(med(side, n, "tokens_per_second")), fmt(med(side, n, "ttft_p50"), 1e3)]
            if side == "llama-server":
                rows.append(
                    [*row, fmt(med(side, n, "server_per_token"), 1e3, 2)] + ["-"] * (len(headers) - 5)
                )
                continue
            parts = PARTS if side == "ringserve" else RAW_PARTS
            row.append(fmt(med(side, n, "", "step"), 1e3, 2))
            row += [fmt(med(side, n, "", p), 1e3, 2) if p in parts else "-" for p in PARTS]
            row += [
                fmt(med(side, n, "", "between_decodes"), 1e3, 2),
                fmt(med(side, n, "", "wakeups_during_decode"), digits=0),
                fmt(med(side, n, "", "trio_cpu_during_decode"), 1e3, 2),
                fmt(med(side, n, "", "decode_threads_run_queue_wait"), 1e3, 2),
            ]
            rows.append(row)
    print(
        f"\nmedians over {args.rounds} rounds of each burst's steady-step medians (llama-server: its"
        " predicted_per_token_ms as the step)"
    )
    print(table(headers, rows))
    ratio_rows = []
    for n in args.streams:
        rs = [x["tokens_per_second"] for x in runs["ringserve"][n]]
        row = [
            n,
            " ".join(
                f"{a / b:.2f}"
                for a, b in zip(rs, (x["tokens_per_second"] for x in runs["raw loop"][n]), strict=True)
            ),
        ]
        if "llama-server" in sides:
            row.append(
                " ".join(
                    f"{a / b:.2f}"
                    for a, b in zip(
                        rs, (x["tokens_per_second"] for x in runs["llama-server"][n]), strict=True
                    )
                )
            )
        ratio_rows.append(row)
    print("\nringserve tok/s over the others', per round")
    print(
        table(["streams", "/ raw loop", *(["/ llama-server"] if "llama-server" in sides else [])], ratio_rows)
    )
    payload = {
        "benchmark": "step_timeline",
        "machine": info,
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "threads": threads,
        "kv": args.kv,
        "flash_attn": args.flash_attn,
        "overlap": args.overlap,
        "config": args.config,
        "sides": sides,
        "runs": {s: {str(n): v for n, v in by_n.items()} for s, by_n in runs.items()},
    }
    fig, axes = figure(ncols=len(args.streams), width=4 * len(args.streams), height=4)
    for ax, n in zip(axes[0], args.streams, strict=True):
        bottom = [0.0, 0.0]
        for i, part in enumerate(PARTS):
            heights = [1e3 * (med(side, n, "", part) or 0.0) for side in ("ringserve", "raw loop")]
            ax.bar(["ringserve", "raw loop"], heights, bottom=bottom, label=part, color=f"C{i}")
            bottom = [a + b for a, b in zip(bottom, heights, strict=True)]
        ax.set_title(f"{n} streams: one decode step")
        ax.set_ylabel("ms (medians)")
    axes[0][0].legend(fontsize=7)
    print(f"wrote {write_json('step_timeline', payload)} and {save_figure(fig, 'step_timeline', info)}")
    return payload


if __name__ == "__main__":
    main()
