"""End-to-end streaming over HTTP: ringserve against llama-cpp-python's own server, side by side.

Both servers run as subprocesses on the same model file and the same two CPU
threads' worth of llama.cpp work:

* ``python -m ringserve serve --slots 8 --port 0 --config ...`` (default
  ``[stream]`` coalescing: one SSE entry per 25 ms or 16 tokens);
* ``python -m llama_cpp.server --model PATH --n_ctx 2048 --n_threads T
  --n_threads_batch T --interrupt_requests False`` (the ``server`` extra of
  llama-cpp-python; its default ``interrupt_requests=True`` would end a
  stream as soon as another request arrives, so it is turned off; it serves
  one request at a time).

Real clients (httpx, async, one connection per stream) send the same
OpenAI Chat Completions request (a system and a user message, greedy,
``max_tokens`` tokens, ``stream: true``; each prompt made unique by a tag
at its start, the same tags for both servers) at 1, 2, 4, 8 and 16 concurrent
streams, each client ``--requests`` requests back to back. Measured at the
client: TTFT (request sent to the first chunk with text), time between
chunks (consecutive chunks with text, per stream), time per output token
(per stream: last chunk minus first chunk over tokens - 1), and aggregate
tokens/s (all tokens over the wall time of the level). Tokens come from
``usage`` when the server sends it (ringserve, ``stream_options``), else
``max_tokens`` for a ``length`` finish, else one per chunk.

Each round also runs, in this process while both servers idle, the raw
llama-cpp-python decode loop (``bench/raw_decode.py``) for every stream count
up to ``--slots``, as ``--tokens`` tokens per sequence with its prefill timed
in, the ceiling an HTTP server on this engine could reach ("end to end over
HTTP" ratio of the engine issue).

Rounds alternate which server goes first; figures are medians over rounds and
ratios (ringserve / llama_cpp.server, ringserve / raw loop) medians of
per-round ratios. For ringserve each level also reads, from ``/metrics``, the
wall time of its decode calls and the time its engine waited between them
while it had work (``ringserve_engine_idle_seconds_total``): the engine-idle
share, idle over idle plus decode, is the share of a busy engine's time that a
GPU would sit idle for the Python side.

Run from the repository root (needs ``pip install -e '.[bench]'``)::

    .venv/bin/python bench/http_streams.py [--streams 1 2 4 8 16] [--tokens 128] [--rounds 5]

Writes ``bench/results/http_streams.json`` and ``bench/results/http_streams.png``;
``--logs DIR`` keeps the servers' logs there (``ringserve.log``, ``llama-server.log``...).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RINGSERVE_READY,
    ServerProcess,
    cpu_seconds,
    figure,
    fmt,
    free_port,
    llama_server,
    machine,
    machine_line,
    median,
    pct,
    python,
    ringserve_config,
    save_figure,
    scrape,
    table,
    write_json,
)
from bench.raw_decode import raw_decode_run  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402
from ringserve.engine.runner import ENGINE_IDLE_SECONDS  # noqa: E402


def messages(tag: str) -> list[dict[str, str]]:
    """The conversation a request sends; ``tag`` makes each prompt unique.

    The tag leads the system message so no two prompts share more than the
    template's first tokens: llama-cpp-python reuses the KV cells of the
    previous prompt's common prefix, which would hide its prefill on repeated
    prompts. The explicit system message makes both servers' chat templates
    render the same prompt.
    """
    return [
        {"role": "system", "content": f"Request {tag}. You are a helpful assistant."},
        {"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."},
    ]


def chatml(tag: str) -> str:
    """:func:`messages` as the bundled model's chat template (ChatML) renders them, with the generation
    prompt: the raw loop's prompt, as many tokens as the servers prefill."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages(tag)) + "<|im_start|>assistant\n"


SETTLE_SECONDS = ENGINE_IDLE_SECONDS + 0.5
"""Pause before each level and raw run: ringserve's engine thread, and the OpenMP team that spins
beside it, ends after ``ENGINE_IDLE_SECONDS`` idle, so no side decodes beside the last one's spinning."""

CTX_PER_SLOT = 2048
"""KV cells per slot in every server (and the raw loop): ringserve's ``[engine] ctx_per_slot`` and
``[model] ctx_size`` = slots x this, llama-server's ``-c``."""

SERVERS = ("ringserve", "llama-server", "llama_cpp.server")
"""Every server this script can run; ringserve's ratios are taken against each of the others."""


@attrs.define
class StreamTrace:
    """One streamed request as its client saw it (perf_counter seconds)."""

    sent: float
    chunks: list[float] = attrs.Factory(list)
    ended: float = 0.0
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def _tokens(usage: dict[str, Any] | None, finish_reason: str | None, chunks: int, max_tokens: int) -> int:
    if usage and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"])
    if finish_reason == "length":
        return max_tokens
    return chunks


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamTrace:
    """POST a streamed chat completion and time every chunk that carries text."""
    trace = StreamTrace(time.perf_counter())
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return trace
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    trace.error = str(chunk["error"])[:200]
                    break
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        trace.chunks.append(time.perf_counter())
                    trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.ended = time.perf_counter()
    trace.tokens = _tokens(usage, trace.finish_reason, len(trace.chunks), body["max_tokens"])
    return trace


async def run_level(url: str, n_streams: int, requests: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """``n_streams`` clients at once, each sending ``requests`` streamed requests in turn.

    Request ``j`` of client ``i`` is tagged ``{tag}-{i}-{j}`` (see :func:`messages`).
    """
    traces: list[StreamTrace] = []
    limits = httpx.Limits(max_connections=n_streams, max_keepalive_connections=n_streams)

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        for j in range(requests):
            body = {
                "model": "smollm2",
                "messages": messages(f"{tag}-{i}-{j}"),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            traces.append(await one_stream(client, url, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n_streams):
                nursery.start_soon(client_loop, client, i)
        wall = time.perf_counter() - t0
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [t.chunks[0] - t.sent for t in ok]
    gaps = [b - a for t in ok for a, b in itertools.pairwise(t.chunks)]
    tpot = [(t.chunks[-1] - t.chunks[0]) / (t.tokens - 1) for t in ok if t.tokens > 1 and len(t.chunks) > 1]
    tokens = sum(t.tokens for t in ok)
    return {
        "streams": n_streams,
        "requests": len(traces),
        "errors": [t.error for t in traces if t.error is not None],
        "finish_reasons": sorted({str(t.finish_reason) for t in ok}),
        "tokens": tokens,
        "chunks": sum(len(t.chunks) for t in ok),
        "wall_seconds": wall,
        "tokens_per_second": tokens / wall,
        "load_average_1m": os.getloadavg()[0],
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "chunk_gap_p50": pct(gaps, 50),
        "chunk_gap_p99": pct(gaps, 99),
        "tpot_p50": pct(tpot, 50),
    }


def server_counters(server: ServerProcess, name: str) -> dict[str, float]:
    """The server's CPU seconds so far and, for ringserve, its decode counters (from ``/metrics``).

    Their increase over a level tells a slow level's cause apart: CPU the
    server did not get, decode calls that took long, or time outside decode
    (``engine_idle_seconds``: between decode calls while the loop had work).
    """
    counters = {"cpu_seconds": cpu_seconds(server.pid)}
    if name == "ringserve":
        samples = scrape(server.url)
        counters["decode_seconds"] = samples["ringserve_decode_seconds_total"]
        counters["decode_steps"] = samples["ringserve_decode_steps_total"]
        counters["engine_idle_seconds"] = samples["ringserve_engine_idle_seconds_total"]
    return counters


def engine_idle_share(level: dict[str, Any]) -> float | None:
    """ringserve's engine-idle share over one level: idle / (idle + decode) seconds (None: no decode)."""
    busy = level["server_engine_idle_seconds"] + level["server_decode_seconds"]
    return level["server_engine_idle_seconds"] / busy if busy > 0 else None


def raw_level(model: Path, n: int, tokens: int, threads: int, kv_unified: bool = True,
              slots: int | None = None, flash_attn: str = "off") -> dict[str, float]:
    """The raw decode loop's end-to-end rate for ``n`` sequences of ``tokens`` tokens.

    One :func:`bench.raw_decode.raw_decode_run` of ``tokens - 1`` steps (its
    prefill samples the first token); the rate counts the prefill too, as the
    HTTP figures do: ``n * tokens / (prefill + steps)``. Its prompt is the servers'
    (:func:`chatml`; with the bundled model the same tokens). Its KV cache is
    the servers': with ``kv_unified`` one pool of :data:`CTX_PER_SLOT` cells per slot of
    ``slots`` (default ``n``), else :data:`CTX_PER_SLOT` cells per sequence. Flash attention
    ``on``, ``off`` or ``auto`` as the servers'.
    """
    run = raw_decode_run(model, n, tokens - 1, n_threads=threads, kv_unified=kv_unified,
                         n_ctx=((slots or n) if kv_unified else n) * CTX_PER_SLOT,
                         flash_attn={"on": True, "off": False, "auto": None}[flash_attn], prompt=chatml("raw"))
    return {
        "tokens_per_second": n * tokens / (run.prefill_seconds + sum(run.step_seconds)),
        "decode_tokens_per_second": run.tokens_per_second,
        "prefill_seconds": run.prefill_seconds,
    }


def warm_up(url: str, max_tokens: int) -> dict[str, Any]:
    """One non-streamed request (loads caches); returns its usage, to compare prompts."""
    body = {"model": "smollm2", "messages": messages("warm-up"), "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    answer = resp.json()
    return {"usage": answer.get("usage"), "text_start": answer["choices"][0]["message"]["content"][:80]}


def start_servers(model: Path, threads: int, tmp: Path, slots: int, names: Sequence[str],
                  llama_server_binary: Path | None, overlap: str = "auto",
                  flash_attn: str = "off", logs: Path | None = None,
                  kv_unified: bool = True) -> dict[str, ServerProcess]:
    """Start the servers in ``names`` (ringserve always), stopping those started if one fails.

    ``llama-server`` runs as :func:`bench.common.llama_server` starts it: as many slots as ringserve,
    the same KV cache (:data:`CTX_PER_SLOT` cells per slot: ringserve's ``[model] ctx_size``,
    llama-server's ``-c``; at most that for one request; one pool that the slots share with
    ``kv_unified``, ringserve's default and llama-server's ``-kvu``, else one per slot), threads,
    batch and flash attention. ringserve has no limit on
    the readers of one client (every stream comes from this process). Their logs go to ``logs``
    (default ``tmp``), ringserve's config and store to ``tmp``.
    """
    logs = logs or tmp
    cfg = ringserve_config(tmp / "ringserve.toml", {
        "model": {"path": str(model), "n_threads": threads, "flash_attn": flash_attn,
                  "ctx_size": slots * CTX_PER_SLOT, "kv_unified": kv_unified},
        "engine": {"ctx_per_slot": CTX_PER_SLOT, "overlap": overlap},
        "store": {"path": str(tmp / "store.sqlite3")},
        "limits": {"max_readers_per_client": 0},  # every stream comes from one address: 64 by default
    })
    servers: dict[str, ServerProcess] = {}
    try:
        servers["ringserve"] = ServerProcess(
            [python(), "-m", "ringserve", "serve", "--slots", str(slots), "--port", "0", "--config", str(cfg)],
            logs / "ringserve.log",
            ready_pattern=RINGSERVE_READY,
        )
        if "llama-server" in names:
            assert llama_server_binary is not None
            servers["llama-server"] = llama_server(llama_server_binary, model, logs / "llama-server.log",
                                                   slots=slots, ctx_per_slot=CTX_PER_SLOT, threads=threads,
                                                   flash_attn=flash_attn, kv_unified=kv_unified)
        if "llama_cpp.server" in names:
            port = free_port()
            servers["llama_cpp.server"] = ServerProcess(
                [python(), "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
                 str(port), "--n_ctx", "2048", "--n_batch", "512", "--n_threads", str(threads),
                 "--n_threads_batch", str(threads), "--interrupt_requests", "False"],
                logs / "llama_cpp_server.log",
                ready_pattern=None,
                url=f"http://127.0.0.1:{port}",
                probe="/v1/models",
            )
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=1, help="requests per client, back to back")
    ap.add_argument("--rounds", type=int, default=5, help="repeats of the whole comparison")
    ap.add_argument("--slots", type=int, default=8, help="ringserve --slots")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads in both servers (0: all cores)")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                    help="servers to run (default: ringserve and llama-server when --llama-server is given, else"
                         " ringserve and llama_cpp.server; the tests' smoke run uses ringserve only)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="llama.cpp's llama-server binary (docs/benchmarks.md says how to build it)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="ringserve's [engine] overlap (auto: off when the threads take every core)")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="off",
                    help="flash attention in both servers: ringserve's [model] flash_attn, llama-server's -fa"
                         " and the raw loop (off: ringserve's default; llama-server's own default is auto)")
    ap.add_argument("--kv", choices=["unified", "split"], default="unified",
                    help="the KV cache of every side: one pool the slots share (ringserve's default"
                         " [model] kv_unified, llama-server's -kvu, the raw loop's kv_unified) or one per slot")
    ap.add_argument("--logs", type=Path, default=None, help="keep the servers' logs in this folder")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start: start no round that would end after it, if it took as"
                         " long as the last one (the first round always runs)")
    ap.add_argument("--replot", type=Path, help="only redraw the plot from this script's JSON")
    args = ap.parse_args(argv)
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    if args.replot is not None:
        payload = json.loads(args.replot.read_text())
        print(f"wrote {plot(payload)}")
        return payload
    if args.servers is None:
        args.servers = ["ringserve", "llama-server" if args.llama_server else "llama_cpp.server"]
    if "ringserve" not in args.servers:
        args.servers.insert(0, "ringserve")
    if "llama-server" in args.servers and args.llama_server is None:
        ap.error("--servers llama-server needs --llama-server PATH")
    others = [name for name in SERVERS[1:] if name in args.servers]
    model = args.model or default_model_path()
    threads = args.threads or os.cpu_count() or 1
    info = machine()
    print(f"HTTP streaming: {model.name}, max_tokens {args.tokens}, {args.requests} request(s) per client,"
          f" {args.rounds} rounds, ringserve --slots {args.slots} overlap {args.overlap}, {threads} threads each,"
          f" flash attention {args.flash_attn}, KV {args.kv}")
    print(machine_line(info), flush=True)

    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {s: {n: [] for n in args.streams} for s in SERVERS}
    raw_rounds: dict[int, list[dict[str, float]]] = {n: [] for n in args.streams if n <= args.slots}
    with tempfile.TemporaryDirectory(prefix="ringserve-bench-") as tmp_name:
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
        servers = start_servers(model, threads, Path(tmp_name), args.slots, args.servers, args.llama_server,
                                args.overlap, args.flash_attn, args.logs, args.kv == "unified")
        try:
            warm = {name: warm_up(server.url, args.tokens) for name, server in servers.items()}
            for name, w in warm.items():
                print(f"  {name} at {servers[name].url}: warm-up usage {w['usage']}")
            rounds_run = 0
            for r in range(args.rounds):
                round_start = time.monotonic()
                order = [name for name in (SERVERS if r % 2 == 0 else SERVERS[::-1]) if name in servers]
                load = os.getloadavg()[0]
                for n in args.streams:
                    for name in order:
                        server = servers[name]
                        time.sleep(SETTLE_SECONDS)
                        before = server_counters(server, name)
                        level = trio.run(run_level, server.url, n, args.requests, args.tokens, f"{r}-{n}")
                        after = server_counters(server, name)
                        level.update({f"server_{k}": after[k] - before[k] for k in after})
                        idle = engine_idle_share(level) if name == "ringserve" else None
                        level["engine_idle_share"] = idle
                        rounds[name][n].append(level)
                        print(f"  round {r + 1} {name:>16} {n:>2} streams: {level['tokens_per_second']:6.1f} tok/s,"
                              f" TTFT p50 {fmt(level['ttft_p50'], 1e3)} ms, errors {len(level['errors'])}"
                              + ("" if idle is None else f", engine idle {idle:.3f}"),
                              flush=True)
                    if n <= args.slots:
                        time.sleep(SETTLE_SECONDS)
                        raw = raw_level(model, n, args.tokens, threads, args.kv == "unified", args.slots,
                                        args.flash_attn)
                        raw_rounds[n].append(raw)
                        print(f"  round {r + 1} {'raw loop':>16} {n:>2} streams: {raw['tokens_per_second']:6.1f} tok/s",
                              flush=True)
                print(f"  round {r + 1}: load average {load:.2f} at its start, {os.getloadavg()[0]:.2f} at its end",
                      flush=True)
                rounds_run = r + 1
                if deadline is not None and time.monotonic() + (time.monotonic() - round_start) > deadline:
                    if rounds_run < args.rounds:
                        print(f"  stopping after {rounds_run} of {args.rounds} rounds: another would pass --deadline",
                              flush=True)
                    break
        finally:
            for server in servers.values():
                server.stop()

    keys = ["tokens_per_second", "ttft_p50", "ttft_p99", "chunk_gap_p50", "chunk_gap_p99", "tpot_p50",
            "engine_idle_share"]

    def ratios(key: str, other: list[dict[str, Any]], n: int) -> list[float]:
        return [a[key] / b[key] for a, b in zip(rounds["ringserve"][n], other, strict=True) if a[key] and b[key]]

    summary: dict[int, dict[str, Any]] = {}
    for n in args.streams:
        s: dict[str, Any] = {name: {k: median(x[k] for x in rounds[name][n]) for k in keys} for name in SERVERS}
        s["ratio_tokens_per_second"] = {o: median(ratios("tokens_per_second", rounds[o][n], n)) for o in others}
        s["ratio_ttft_p50"] = {o: median(ratios("ttft_p50", rounds[o][n], n)) for o in others}
        s["round_ratios_tokens_per_second"] = {o: ratios("tokens_per_second", rounds[o][n], n) for o in others}
        if n in raw_rounds:
            s["raw_loop_tokens_per_second"] = median(x["tokens_per_second"] for x in raw_rounds[n])
            s["round_ratios_raw_loop"] = ratios("tokens_per_second", raw_rounds[n], n)
            s["ratio_raw_loop"] = median(s["round_ratios_raw_loop"])
        summary[n] = s

    headers = ["streams", "server", "tok/s", "TTFT p50/p99 ms", "chunk gap p50/p99 ms", "TPOT p50 ms",
               "engine idle"]
    rows = []
    for n in args.streams:
        for name in args.servers:
            x = summary[n][name]
            rows.append([n, name, fmt(x["tokens_per_second"]),
                         f"{fmt(x['ttft_p50'], 1e3)}/{fmt(x['ttft_p99'], 1e3)}",
                         f"{fmt(x['chunk_gap_p50'], 1e3)}/{fmt(x['chunk_gap_p99'], 1e3)}",
                         fmt(x["tpot_p50"], 1e3), fmt(x["engine_idle_share"], digits=3)])
        if n in raw_rounds:
            rows.append([n, "raw loop", fmt(summary[n]["raw_loop_tokens_per_second"]), "-", "-", "-", "-"])
    print(f"\nmedians of {rounds_run} rounds:")
    print(table(headers, rows))
    ratio_headers = ["streams", "vs raw loop tok/s", "per round"]
    for o in others:
        ratio_headers += [f"vs {o} tok/s", "per round", f"vs {o} TTFT p50"]
    ratio_rows = []
    for n in args.streams:
        row = [n, fmt(summary[n].get("ratio_raw_loop"), digits=2),
               " ".join(f"{x:.2f}" for x in summary[n].get("round_ratios_raw_loop", [])) or "-"]
        for o in others:
            row += [fmt(summary[n]["ratio_tokens_per_second"][o], digits=2),
                    " ".join(f"{x:.2f}" for x in summary[n]["round_ratios_tokens_per_second"][o]) or "-",
                    fmt(summary[n]["ratio_ttft_p50"][o], digits=2)]
        ratio_rows.append(row)
    print("\nringserve / the others (same run, medians of per-round ratios):")
    print(table(ratio_headers, ratio_rows))

    payload = {
        "benchmark": "http_streams",
        "machine": info,
        "model": model.name,
        "max_tokens": args.tokens,
        "requests_per_client": args.requests,
        "rounds_run": rounds_run,
        "servers": args.servers,
        "ringserve_slots": args.slots,
        "threads": threads,
        "ringserve_overlap": args.overlap,
        "flash_attn": args.flash_attn,
        "kv": args.kv,
        "warm_up": warm,
        "summary": {str(n): v for n, v in summary.items()},
        "rounds": {name: {str(n): v for n, v in by_n.items()} for name, by_n in rounds.items()},
        "raw_loop_rounds": {str(n): v for n, v in raw_rounds.items()},
    }
    print(f"\nwrote {write_json('http_streams', payload)}")

    print(f"wrote {plot(payload)}")
    return payload


def plot(payload: dict[str, Any]) -> Path:
    """Draw ``bench/results/http_streams.png`` from a payload (this script's JSON)."""
    summary = payload["summary"]
    streams = sorted(int(n) for n in summary)
    fig, axes = figure(ncols=2, width=10, height=3.8)
    ax, ax2 = axes[0]
    for i, (name, marker) in enumerate(zip(SERVERS, ("o", "s", "v"), strict=True)):
        if name not in payload.get("servers", SERVERS):
            continue
        color = f"C{i}"
        ax.plot(streams, [summary[str(n)][name]["tokens_per_second"] for n in streams], marker=marker, color=color,
                label=name)
        ax2.plot(streams, [1e3 * summary[str(n)][name]["ttft_p50"] for n in streams], marker=marker, color=color,
                 label=f"{name} p50")
        ax2.plot(streams, [1e3 * summary[str(n)][name]["ttft_p99"] for n in streams], marker=marker, color=color,
                 ls="--", alpha=0.5, label=f"{name} p99")
    raw = [n for n in streams if summary[str(n)].get("raw_loop_tokens_per_second")]
    ax.plot(raw, [summary[str(n)]["raw_loop_tokens_per_second"] for n in raw], ls="-.", marker="d", color="C3",
            label="raw llama-cpp-python loop, no HTTP")
    for ax_ in (ax, ax2):
        ax_.set_xscale("log", base=2)
        ax_.set_xticks(streams, [str(n) for n in streams])
        ax_.set_xlabel("concurrent streams")
        ax_.legend(fontsize=7)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("aggregate tokens/s (median)")
    ax.set_title(f"Streaming over HTTP ({payload['max_tokens']} tokens per request)")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("Time to first token (client-measured)")
    return save_figure(fig, "http_streams", payload["machine"])


if __name__ == "__main__":
    main()
