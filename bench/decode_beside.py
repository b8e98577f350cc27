"""The raw decode loop with Python work beside it: does work on another thread stretch a decode step?

``python bench/decode_beside.py [--seqs 8] [--tokens 64] [--rounds 5] [--threads 2] [--work-ms 2]
[--kv split|unified]``

Issue 42's hypothesis: where llama.cpp's decode threads take every core, the
event loop's work during a decode preempts one of them, and the others spin
at the next barrier until it runs again, so the whole step waits for it. This
tests it without ringserve: the raw llama-cpp-python loop
(:class:`bench.raw_decode.RawDecoder`, the same process, the same switch
interval as a ringserve server) with a Python thread beside it that does, per
decode step:

* ``alone``: nothing (the thread is not started);
* ``during``: ``--work-ms`` of pure-Python work, started as the step starts
  (what the event loop does while a decode runs, overlap ``on``);
* ``between``: the same work strictly between two steps: the loop waits for it
  before the next step (overlap ``off``: the work adds to the step);
* ``wakeups``: the same work cut in ``--wakeups`` pieces spread over the step
  (one every ``step / wakeups``, the last step's length: an event loop woken by
  many tasks);
* ``busy``: a thread that runs pure Python all along (a core taken away).

Per mode it prints the step time (p50 of the timed steps, then the median
over rounds), its ratio to ``alone`` per round (interleaved: every round runs
every mode on the same loaded context, in an order that alternates), and the
time the decode threads spent waiting for a core during the timed steps
(``/proc/self/task/*/schedstat``, the run-queue wait of every thread but the
main one and the worker, per step): the preemption itself.

Writes ``bench/results/decode_beside.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fmt, machine, machine_line, median, table, write_json  # noqa: E402
from bench.raw_decode import RawDecoder  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402
from ringserve.server import SWITCH_INTERVAL_SECONDS  # noqa: E402

MODES = ("alone", "during", "between", "wakeups", "busy")
"""What the worker thread does beside the decode loop (module docstring)."""


def python_work(seconds: float) -> None:
    """Pure-Python work (it holds the GIL, as rendering and writing streams do) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(64))


def run_queue_wait(skip: set[int]) -> dict[int, float]:
    """Seconds each thread of this process (but those in ``skip``) has waited on a run queue so far."""
    waits = {}
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        if tid in skip:
            continue
        try:
            fields = Path(f"/proc/self/task/{task}/schedstat").read_text().split()
        except OSError:  # the thread ended
            continue
        waits[tid] = int(fields[1]) / 1e9
    return waits


class Worker:
    """The thread beside the loop, told per step what to do (see the module docstring)."""

    def __init__(self, mode: str, work: float, wakeups: int) -> None:
        self.mode = mode
        self.work = work
        self.wakeups = wakeups
        self.step = 0.0  # the last step's length (seconds), to spread the wakeups over
        self._go = threading.Event()
        self._done = threading.Event()
        self._stop = False
        self.tid = 0
        self._thread = threading.Thread(target=self._run, name="beside", daemon=True)
        if mode != "alone":
            self._thread.start()
            while not self.tid:
                time.sleep(0.001)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        if self.mode == "busy":
            while not self._stop:
                python_work(0.01)
            return
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            if self.mode == "wakeups":
                piece, gap = self.work / self.wakeups, self.step / self.wakeups
                start = time.perf_counter()
                for k in range(self.wakeups):
                    pause = start + k * gap - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    python_work(piece)
            else:
                python_work(self.work)
            self._done.set()

    def step_starts(self) -> None:
        if self.mode in ("during", "wakeups"):
            self._go.set()

    def step_ended(self) -> None:
        if self.mode == "between":
            self._done.clear()
            self._go.set()
            self._done.wait()

    def stop(self) -> None:
        self._stop = True
        self._go.set()
        if self._thread.is_alive():
            self._thread.join()


class BesideDecoder(RawDecoder):
    """:class:`RawDecoder` whose decode steps tell a :class:`Worker` when they start and end, and
    that sums the run-queue wait of the decoding threads over its timed steps."""

    worker: Worker | None = None
    waited = 0.0
    _timed = 0
    _waits: dict[int, float] = {}

    def run_with(self, worker: Worker) -> tuple[list[float], float]:
        """One run beside ``worker``: the timed steps (seconds) and the run-queue wait per step."""
        self.worker, self.waited, self._timed = worker, 0.0, -1  # step -1 is the warm-up
        run = self.run()
        self.worker = None
        return list(run.step_seconds), self.waited / len(run.step_seconds)

    def _step(self, last: list[int], pos: int) -> None:
        worker = self.worker
        assert worker is not None
        skip = {threading.main_thread().native_id or 0, worker.tid}
        if self._timed == 0:
            self._waits = run_queue_wait(skip)
        t0 = time.perf_counter()
        worker.step_starts()
        super()._step(last, pos)
        worker.step = time.perf_counter() - t0
        worker.step_ended()
        if self._timed == self.n_tokens - 1:
            after = run_queue_wait(skip)
            self.waited = sum(after[t] - w for t, w in self._waits.items() if t in after)
        self._timed += 1


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="decode threads (0: every core)")
    ap.add_argument("--work-ms", type=float, default=2.0, help="Python work per step (ms)")
    ap.add_argument(
        "--wakeups", type=int, default=16, help="pieces of that work per step in the wakeups mode"
    )
    ap.add_argument(
        "--kv",
        choices=["split", "unified"],
        default="unified",
        help="one KV pool for all sequences (ringserve's default) or one per sequence",
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = ap.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)  # as a ringserve server runs
    path = args.model or default_model_path()
    threads = args.threads or os.cpu_count() or 1
    info = machine()
    print(
        f"raw decode loop with Python work beside it: {path.name}, {args.seqs} sequences,"
        f" {args.tokens} steps,"
        f" {threads} threads, {args.work_ms:g} ms of work per step, KV {args.kv}, {args.rounds} rounds"
    )
    print(machine_line(info), flush=True)
    kv = {"kv_unified": True, "n_ctx": args.seqs * 2048} if args.kv == "unified" else {}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    with BesideDecoder(path, args.seqs, args.tokens, n_threads=threads, **kv) as decoder:
        for r in range(args.rounds):
            for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
                worker = Worker(mode, args.work_ms / 1000, args.wakeups)
                try:
                    steps, waited = decoder.run_with(worker)
                finally:
                    worker.stop()
                runs[mode].append(
                    {
                        "step_p50": statistics.median(steps),
                        "step_mean": statistics.fmean(steps),
                        "run_queue_wait_per_step": waited,
                        "load_average_1m": os.getloadavg()[0],
                    }
                )
                time.sleep(0.2)
            print(
                f"  round {r + 1}: "
                + ", ".join(f"{m} {runs[m][-1]['step_p50'] * 1e3:.1f} ms" for m in args.modes)
                + f"; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    rows = []
    for mode in args.modes:
        p50 = [x["step_p50"] for x in runs[mode]]
        ratio = (
            [a / b for a, b in zip(p50, (x["step_p50"] for x in runs["alone"]), strict=True)]
            if "alone" in runs
            else []
        )
        rows.append(
            [
                mode,
                fmt(median(p50), 1e3, 2),
                " ".join(f"{x:.2f}" for x in ratio) or "-",
                fmt(median(ratio), digits=2),
                fmt(median(x["run_queue_wait_per_step"] for x in runs[mode]), 1e3, 2),
            ]
        )
    print(f"\nstep time, p50 of each run's steps, median over {args.rounds} rounds; ratio to alone per round")
    print(
        table(
            ["mode", "step ms", "/ alone per round", "median", "decode threads' run-queue wait ms/step"], rows
        )
    )
    payload = {
        "benchmark": "decode_beside",
        "machine": info,
        "model": path.name,
        "seqs": args.seqs,
        "tokens": args.tokens,
        "threads": threads,
        "work_ms": args.work_ms,
        "wakeups": args.wakeups,
        "kv": args.kv,
        "runs": runs,
    }
    print(f"wrote {write_json('decode_beside', payload)}")
    return payload


if __name__ == "__main__":
    main()
