"""Engine efficiency: ringserve's Runner + LlamaEngine against the raw llama-cpp-python decode loop.

In one process and one run, for 1, 4 and 8 concurrent sequences, on the
bundled model (or ``--model``) and the same prompt tokens:

* **raw**: :class:`bench.raw_decode.RawDecoder`, the low-level batched
  greedy loop (one context, one batch, one sampler per sequence), the ceiling.
* **ringserve**: a :class:`ringserve.engine.runner.Runner` owning a
  :class:`ringserve.engine.llama.LlamaEngine`, driven through Trio exactly as
  the server drives it: every sequence submitted at once, events read from
  each :class:`~ringserve.engine.generation.Generation` (detokenizer and stop
  matcher included). No HTTP.

Both sides are greedy over the same prompt tokens (the raw loop's
``PROMPT``, submitted to the runner as a ready :class:`Prepared`) and
produce ``--tokens`` decode steps after the prefill, untimed warm-up excluded
(the raw loop takes one untimed step; the runner does one short generation
first). Aggregate tokens/s counts the tokens sampled after the batched
prefill, over the wall time from the first tokens to the last. TTFT is the
prefill (raw) or submit to first text (ringserve); time between tokens is
each decode step (raw) or each text event's gap divided by the tokens it
carries (ringserve).

Both sides stay loaded side by side and take turns: ``--bursts`` pairs
of one raw run and one runner generation, alternating which goes first, so a
neighbour's load spike on a shared machine lands on both sides alike.
Tokens/s is the median over bursts and the ratio the median of per-burst
ratios (the interquartile range is printed too); TTFT and time between
tokens are percentiles pooled over all bursts.

Run from the repository root::

    .venv/bin/python bench/engine.py [--seqs 1 4 8] [--tokens 64] [--bursts 15]

Writes ``bench/results/engine.json`` and ``bench/results/engine.png``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import figure, fmt, machine, machine_line, median, pct, save_figure, table, write_json  # noqa: E402
from bench.raw_decode import N_BATCH, PROMPT, RawDecoder, RawRun, _ctx_per_seq  # noqa: E402
from ringserve.config import EngineConfig  # noqa: E402
from ringserve.core.events import BlockDelta, ChatMessage, Failure, Finish, GenerationRequest, SamplingParams  # noqa: E402
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling  # noqa: E402
from ringserve.engine.generation import Generation, Prepared  # noqa: E402
from ringserve.engine.llama import LlamaEngine  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402
from ringserve.engine.runner import Runner  # noqa: E402

GOAL_RATIO = 0.95
"""The engine issue's goal for ringserve / raw aggregate tokens/s (printed, never asserted)."""


@attrs.frozen
class Side:
    """One side's figures for one burst (seconds, tokens/s)."""

    tokens_per_second: float
    ttft: list[float]
    tbt: list[float]


@attrs.define
class _Trace:
    """What one consumer saw: perf_counter times of submit, each text event and the end."""

    submitted: float
    deltas: list[tuple[float, int]] = attrs.Factory(list)
    finished: float = 0.0
    output_tokens: int = 0
    stop_reason: str = ""


async def _consume(gen: Generation, trace: _Trace) -> None:
    async for event in gen:
        now = time.perf_counter()
        if isinstance(event, BlockDelta):
            trace.deltas.append((now, event.tokens))
        elif isinstance(event, Finish | Failure):
            trace.finished = now
            trace.output_tokens = event.usage.output_tokens
            trace.stop_reason = event.stop_reason.value if isinstance(event, Finish) else f"failure:{event.kind}"


async def _generate_all(runner: Runner, prepared: Prepared, n_seqs: int) -> list[_Trace]:
    """Submit ``n_seqs`` copies at once (before the runner can plan), read them all, wait for the slots."""
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        traces = []
        for _ in range(n_seqs):
            trace = _Trace(time.perf_counter())
            gen = await stack.enter_async_context(runner.submit(prepared))
            traces.append(trace)
            nursery.start_soon(_consume, gen, trace)
    await runner.wait_idle()
    return traces


def _runner_side(traces: list[_Trace]) -> Side:
    """Tokens after the batched prefill over the time from the first tokens to the last."""
    first = [t.deltas[0][0] for t in traces]
    start = max(first)
    end = max(t.finished for t in traces)
    after_first = sum(t.output_tokens - t.deltas[0][1] for t in traces)
    tbt = []
    for t in traces:
        for (a, _), (b, k) in itertools.pairwise(t.deltas):
            if k:
                tbt += [(b - a) / k] * k
    return Side(after_first / (end - start), [f - t.submitted for f, t in zip(first, traces, strict=True)], tbt)


def compare(path: Path, n_seqs: int, n_tokens: int, n_threads: int, bursts: int) -> list[dict[str, Any]]:
    """Interleave ``bursts`` raw runs and runner generations, both kept loaded; one record per pair.

    Both sides hold their own context on the same model file. The runner's
    loop runs all along; a raw run blocks the Trio thread while the runner is
    idle and its engine thread has ended (so no OpenMP team of the runner's
    spins beside the raw loop; the raw loop's own ends with its thread). Each burst pair alternates which side goes first, so a neighbour's
    load spike lands on both sides alike over the bursts.
    """
    with RawDecoder(path, n_seqs, n_tokens, n_threads=n_threads) as raw, LlamaEngine(
        path, n_slots=n_seqs, n_ctx=n_seqs * _ctx_per_seq(n_tokens), n_batch=N_BATCH, n_threads=n_threads
    ) as engine:
        prompt = tuple(engine.tokenize(PROMPT, add_special=True, parse_special=True))
        assert list(prompt) == raw.prompt, "both sides must decode the same prompt tokens"
        request = GenerationRequest(
            messages=(ChatMessage("user", PROMPT),), max_tokens=n_tokens + 1, sampling=SamplingParams(temperature=0)
        )
        greedy = resolve_sampling(request.sampling, LLAMA_SERVER_DEFAULTS)
        warm = Prepared(attrs.evolve(request, max_tokens=2), prompt, 2, greedy)
        timed = Prepared(request, prompt, n_tokens + 1, greedy)
        config = EngineConfig(slots=n_seqs, n_batch=N_BATCH, prefill_chunk=N_BATCH, queue_size=n_seqs)

        async def main() -> list[dict[str, Any]]:
            runner = Runner(engine, config)
            records = []
            async with trio.open_nursery() as nursery:
                await nursery.start(runner.run)

                async def raw_run() -> RawRun:
                    while runner.engine_thread_alive:  # its OpenMP team spins until the thread ends
                        await trio.sleep(0.05)
                    return raw.run()

                await _generate_all(runner, warm, n_seqs)
                await raw_run()  # warm-up
                for b in range(bursts):
                    if b % 2 == 0:
                        r = await raw_run()
                        traces = await _generate_all(runner, timed, n_seqs)
                    else:
                        traces = await _generate_all(runner, timed, n_seqs)
                        r = await raw_run()
                    ours = _runner_side(traces)
                    records.append({
                        "raw": Side(r.tokens_per_second, [r.prefill_seconds] * n_seqs, list(r.step_seconds)),
                        "ringserve": ours,
                        "ratio": ours.tokens_per_second / r.tokens_per_second,
                        "stop_reasons": sorted({t.stop_reason for t in traces}),
                        "load_average_1m": os.getloadavg()[0],
                    })
                nursery.cancel_scope.cancel()
            return records

        return trio.run(main)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median tokens/s per side, median of per-burst ratios, pooled TTFT and TBT percentiles."""
    out: dict[str, Any] = {}
    for side in ("raw", "ringserve"):
        ttft = [x for r in records for x in r[side].ttft]
        tbt = [x for r in records for x in r[side].tbt]
        out[side] = {
            "tokens_per_second": median(r[side].tokens_per_second for r in records),
            "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99),
            "tbt_p50": pct(tbt, 50),
            "tbt_p99": pct(tbt, 99),
        }
    ratios = [r["ratio"] for r in records]
    out["ratio"] = median(ratios)
    out["ratio_p25"] = pct(ratios, 25)
    out["ratio_p75"] = pct(ratios, 75)
    out["stop_reasons"] = sorted({x for r in records for x in r["stop_reasons"]})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 8], help="concurrent sequences")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps per sequence and burst")
    ap.add_argument("--bursts", type=int, default=15, help="interleaved raw/ringserve pairs per concurrency")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    threads = args.threads or os.cpu_count() or 1
    info = machine()
    print(f"engine vs raw decode: {path.name}, {args.tokens} tokens/seq per burst, {args.bursts} burst pairs,"
          f" {threads} threads")
    print(machine_line(info), flush=True)

    records: dict[int, list[dict[str, Any]]] = {}
    summary: dict[int, dict[str, Any]] = {}
    for n in args.seqs:
        records[n] = compare(path, n, args.tokens, args.threads, args.bursts)
        summary[n] = summarize(records[n])
        s = summary[n]
        print(f"  seqs {n}: raw {s['raw']['tokens_per_second']:.1f} tok/s, ringserve"
              f" {s['ringserve']['tokens_per_second']:.1f} tok/s, ratio {s['ratio']:.3f}"
              f" (p25-p75 {s['ratio_p25']:.3f}-{s['ratio_p75']:.3f})", flush=True)

    headers = ["seqs", "raw tok/s", "ringserve tok/s", "ratio", "(p25-p75)",
               "raw TTFT ms", "rs TTFT p50/p99 ms", "raw TBT p50/p99 ms", "rs TBT p50/p99 ms"]
    rows = []
    for n in args.seqs:
        s = summary[n]
        raw, ours = s["raw"], s["ringserve"]
        rows.append([
            n, fmt(raw["tokens_per_second"]), fmt(ours["tokens_per_second"]), fmt(s["ratio"], digits=3),
            f"{s['ratio_p25']:.3f}-{s['ratio_p75']:.3f}",
            fmt(raw["ttft_p50"], 1e3),
            f"{fmt(ours['ttft_p50'], 1e3)}/{fmt(ours['ttft_p99'], 1e3)}",
            f"{fmt(raw['tbt_p50'], 1e3, 2)}/{fmt(raw['tbt_p99'], 1e3, 2)}",
            f"{fmt(ours['tbt_p50'], 1e3, 2)}/{fmt(ours['tbt_p99'], 1e3, 2)}",
        ])
    print()
    print(f"tokens/s: medians of {args.bursts} bursts; ratio = median of per-burst ringserve / raw"
          f" (goal >= {GOAL_RATIO}); TTFT and TBT pooled over bursts:")
    print(table(headers, rows))

    payload = {
        "benchmark": "engine",
        "machine": info,
        "model": path.name,
        "tokens_per_sequence": args.tokens,
        "bursts": args.bursts,
        "threads": threads,
        "goal_ratio": GOAL_RATIO,
        "summary": {str(n): v for n, v in summary.items()},
        "bursts_raw": {
            str(n): [
                {"raw_tokens_per_second": r["raw"].tokens_per_second,
                 "ringserve_tokens_per_second": r["ringserve"].tokens_per_second,
                 "ratio": r["ratio"], "stop_reasons": r["stop_reasons"], "load_average_1m": r["load_average_1m"]}
                for r in recs
            ]
            for n, recs in records.items()
        },
    }
    print(f"\nwrote {write_json('engine', payload)}")

    fig, axes = figure(ncols=2, width=10, height=3.8)
    ax, ax2 = axes[0]
    xs = list(range(len(args.seqs)))
    width = 0.38
    raw_tps = [summary[n]["raw"]["tokens_per_second"] for n in args.seqs]
    our_tps = [summary[n]["ringserve"]["tokens_per_second"] for n in args.seqs]
    ax.bar([x - width / 2 for x in xs], raw_tps, width, label="raw llama-cpp-python loop")
    bars = ax.bar([x + width / 2 for x in xs], our_tps, width, label="ringserve Runner + LlamaEngine")
    for bar, n in zip(bars, args.seqs, strict=True):
        ax.annotate(f"{summary[n]['ratio']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [str(n) for n in args.seqs])
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("aggregate tokens/s (median)")
    ax.set_title("Decode throughput")
    ax.legend(fontsize=8)
    for i, side in enumerate(("raw", "ringserve")):
        ax2.plot(xs, [1e3 * summary[n][side]["tbt_p50"] for n in args.seqs], marker="o", color=f"C{i}",
                 label=f"{side} p50")
        ax2.plot(xs, [1e3 * summary[n][side]["tbt_p99"] for n in args.seqs], marker="x", ls="--", color=f"C{i}",
                 label=f"{side} p99")
    ax2.set_xticks(xs, [str(n) for n in args.seqs])
    ax2.set_xlabel("concurrent sequences")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title("Time between tokens")
    ax2.legend(fontsize=8)
    print(f"wrote {save_figure(fig, 'engine', info)}")
    return payload


if __name__ == "__main__":
    main()
