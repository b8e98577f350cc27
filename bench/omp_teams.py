"""Decode steps made from one thread against the same steps alternating between two threads.

Why ringserve's runner owns one engine thread (``ringserve/engine/thread.py``,
issue 19): llama.cpp's CPU backend, built with OpenMP as llama-cpp-python
builds it, keeps an OpenMP team per calling thread, and libgomp spins in the
barriers between graph nodes only while its threads fit the CPUs.
``trio.to_thread.run_sync`` hands a call to whichever cached thread is idle,
so a step could run on the thread that had just tokenized a prompt.

Each round runs two fresh processes, in alternating order (one per side, so
the second team of one side never exists in the other): a
:class:`~ringserve.engine.llama.LlamaEngine` with ``--seqs`` greedy
sequences of the raw loop's prompt, one untimed warm-up generation, then
``--tokens`` timed steps of one token per sequence,

* **one**: every decode made from one :class:`~ringserve.engine.thread.EngineThread` (what the runner does);
* **two**: decodes alternating between two of them (what a thread pool can do).

Prints the mean step time of each side per round and the per-round ratio
two / one; the median ratio is the summary. Run from the repository root::

    .venv/bin/python bench/omp_teams.py [--seqs 8] [--tokens 128] [--rounds 5] [--threads 2]

Writes ``bench/results/omp_teams.json`` and ``bench/results/omp_teams.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import figure, machine, machine_line, median, save_figure, write_json  # noqa: E402
from bench.raw_decode import PROMPT  # noqa: E402
from ringserve.core.batch import SlotFeed  # noqa: E402
from ringserve.core.events import SamplingParams  # noqa: E402
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling  # noqa: E402
from ringserve.engine.llama import LlamaEngine  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402
from ringserve.engine.thread import EngineThread  # noqa: E402

SIDES = ("one", "two")


def side_run(side: str, seqs: int, tokens: int, threads: int) -> float:
    """Mean seconds per timed step of one side, in this process (a warm-up generation first).

    The calls go through :class:`~ringserve.engine.thread.EngineThread`, the runner's own: one of
    them, or two taking turns.
    """
    engine = LlamaEngine(default_model_path(), n_slots=seqs, n_ctx=seqs * 2048, n_threads=threads)
    prompt = tuple(engine.tokenize(PROMPT, add_special=True, parse_special=True))

    async def generate(workers: list[EngineThread], n: int) -> float:
        for s in range(seqs):
            engine.begin(s, resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS))
        out = await workers[0].run(engine.decode, [SlotFeed(s, prompt, 0, True) for s in range(seqs)])
        last, pos, total = [o.token for o in out], len(prompt), 0.0
        for k in range(n):
            feeds = [SlotFeed(s, (last[s],), pos, True) for s in range(seqs)]
            t0 = time.perf_counter()
            out = await workers[k % len(workers)].run(engine.decode, feeds)
            total += time.perf_counter() - t0
            last, pos = [o.token for o in out], pos + 1
        for s in range(seqs):
            engine.release(s)
        return total / n

    async def both() -> float:
        workers = [EngineThread(f"decode {i}") for i in range(2 if side == "two" else 1)]
        for w in workers:
            w.start()
        await generate(workers, min(tokens, 16))
        seconds = await generate(workers, tokens)
        for w in workers:
            w.stop()
        return seconds

    seconds = trio.run(both)
    engine.close()
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=128, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of one process per side")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (0: every core but one)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process: one side
    args = ap.parse_args(argv)
    if args.side:
        print(json.dumps(side_run(args.side, args.seqs, args.tokens, args.threads)))
        return {}
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = [sys.executable, __file__, "--side", side, "--seqs", str(args.seqs), "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            row[side] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        row["ratio"] = row["two"] / row["one"]
        rounds.append(row)
        print(f"round {r}: one {row['one'] * 1e3:.1f} ms/step, two {row['two'] * 1e3:.1f} ms/step, "
              f"two / one {row['ratio']:.2f}", flush=True)
    info = machine()
    payload = {
        "benchmark": "omp_teams", "machine": info, "seqs": args.seqs, "tokens": args.tokens, "threads": args.threads,
        "rounds": rounds,
        "summary": {"one_step_seconds": median(r["one"] for r in rounds),
                    "two_step_seconds": median(r["two"] for r in rounds),
                    "ratio": median(r["ratio"] for r in rounds)},
    }
    print(machine_line(info))
    print(f"median two / one: {payload['summary']['ratio']:.2f} (per round: "
          + ", ".join(f"{r['ratio']:.2f}" for r in rounds) + ")")
    print(f"wrote {write_json('omp_teams', payload)}")
    fig, ax = figure(width=6, height=3.5)
    axis = ax[0][0]
    for side in SIDES:
        axis.plot(range(len(rounds)), [r[side] * 1e3 for r in rounds], marker="o", label=f"{side} calling thread(s)")
    axis.set(xlabel="round", ylabel="ms per decode step",
             title=f"{args.seqs} sequences, {args.threads} llama.cpp threads")
    axis.set_ylim(bottom=0)
    axis.legend()
    print(f"wrote {save_figure(fig, 'omp_teams', info)}")
    return payload


if __name__ == "__main__":
    main()
