"""The GPU run's results as Markdown, ready for docs/benchmarks.md.

``python bench/gpu/report.py OUT`` reads ``OUT/http_streams.json`` (``bench/http_streams.py``'s
figures: medians of rounds, ratios as medians of per-round ratios) and ``OUT/stages.tsv``
(``bench/gpu/run.sh``'s stage times) and prints: one line naming the run (GPU, CPU, commit, model,
settings), a table per stream count (tok/s of ringserve, llama-server and the raw loop, ringserve's
ratios to each with every round's, TTFT p50 of both, ringserve's engine-idle share), and the stage
times. ``run.sh`` writes it to ``OUT/gpu_run.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import fmt, machine_line  # noqa: E402


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _rounds(values: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in values) or "-"


def results_table(payload: dict[str, Any]) -> list[str]:
    """The per-stream-count table of an ``http_streams.json`` payload, as Markdown lines."""
    other = next((o for o in ("llama-server", "llama_cpp.server") if o in payload["servers"]), None)
    head = ["streams", "ringserve tok/s"]
    if other:
        head += [f"{other} tok/s", f"ringserve / {other} (rounds)"]
    head += ["raw loop tok/s", "ringserve / raw loop (rounds)", "TTFT p50 ms ringserve"
             + (f" / {other}" if other else ""), "engine idle share"]
    lines = [_row(head), _row(["---"] * len(head))]
    for n, s in sorted(payload["summary"].items(), key=lambda kv: int(kv[0])):
        ring = s["ringserve"]
        cells = [n, fmt(ring["tokens_per_second"])]
        if other:
            cells += [fmt(s[other]["tokens_per_second"]),
                      f"{fmt(s['ratio_tokens_per_second'][other], digits=2)}"
                      f" ({_rounds(s['round_ratios_tokens_per_second'][other])})"]
        ttft = fmt(ring["ttft_p50"], 1e3, 0) + (f" / {fmt(s[other]['ttft_p50'], 1e3, 0)}" if other else "")
        cells += [fmt(s.get("raw_loop_tokens_per_second")),
                  f"{fmt(s.get('ratio_raw_loop'), digits=2)} ({_rounds(s.get('round_ratios_raw_loop', []))})",
                  ttft, fmt(ring.get("engine_idle_share"), digits=3)]
        lines.append(_row(cells))
    return lines


def stages_table(path: Path) -> list[str]:
    """``run.sh``'s ``stages.tsv`` as a Markdown table, with the total."""
    with path.open() as f:
        stages = list(csv.DictReader(f, delimiter="\t"))
    lines = [_row(["stage", "status", "seconds", "budget s"]), _row(["---"] * 4)]
    lines += [_row([s["stage"], s["status"], s["seconds"], s["budget"]]) for s in stages]
    lines.append(_row(["all", "", str(sum(int(s["seconds"]) for s in stages)), ""]))
    return lines


def report(out: Path) -> str:
    """The Markdown for the results in ``out`` (module docstring)."""
    payload = json.loads((out / "http_streams.json").read_text())
    info = payload["machine"]
    lines = [
        f"GPU run ({info['when']}, ringserve `{info['ringserve_commit']}`, llama-cpp-python"
        f" {info['llama_cpp_python']}): {machine_line(info)}.",
        "",
        f"`bash bench/gpu/run.sh`: model `{payload['model']}`, {payload['max_tokens']} tokens per request,"
        f" {payload['rounds_run']} rounds, {payload['ringserve_slots']} slots,"
        f" {payload['threads']} CPU threads per server,"
        f" flash attention {payload['flash_attn']}, ringserve overlap {payload['ringserve_overlap']}"
        " (medians of rounds; ratios are medians of per-round ratios, every round's in brackets):",
        "",
        *results_table(payload),
    ]
    stages = out / "stages.tsv"
    if stages.exists():
        lines += ["", "Stage times (seconds):", "", *stages_table(stages)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the run's results folder (run.sh's OUT)")
    args = ap.parse_args(argv)
    sys.stdout.write(report(args.out))


if __name__ == "__main__":
    main()
