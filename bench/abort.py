"""Abort: how fast a client that hangs up frees its slot's KV cells, and what is decoded meanwhile.

On the real bundled model (or ``--model``), ringserve runs in this process
(:func:`ringserve.server.serve` with the llama.cpp engine, ``--slots`` slots,
the default ``abort`` disconnect policy) and an httpx client in the same Trio
run opens a streamed OpenAI chat completion, reads a few text chunks (1 to 8,
drawn with a fixed seed), and closes the connection. ``--cancels`` times, in
two settings: **idle** (the cancelled stream is the only one) and **loaded**
(``slots - 1`` other streams decode all along, so a decode step is usually in
flight when the cancel comes).

Per cancel it records:

* **cancel to KV freed** (server side): from the runner's cancel of the
  generation to its KV cells being removed, the value the runner passes to
  ``on_cancel_freed`` (the ``ringserve_cancel_to_kv_freed_seconds`` metric);
* **close to KV freed** (end to end): from the client closing the connection
  to that same moment (the client and the hook share ``time.perf_counter``),
  so it adds the time the server takes to notice the disconnect;
* **tokens decoded after cancel**: the runner's ``tokens_after_cancel_total``
  increase (a token whose decode was in flight at the cancel: 0 or 1);
* **tokens sampled after close**: the message's billed output tokens minus
  those sampled when the client closed (decoded while the server had not yet
  noticed the disconnect).

Run from the repository root::

    .venv/bin/python bench/abort.py [--cancels 100] [--slots 4]

Writes ``bench/results/abort.json`` and ``bench/results/abort.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    default_runner,
    figure,
    fmt,
    machine,
    machine_line,
    pct,
    save_figure,
    table,
    write_json,
)
from ringserve.config import Config  # noqa: E402
from ringserve.engine.llama import LlamaLoader  # noqa: E402
from ringserve.metrics import Metrics  # noqa: E402
from ringserve.server import serve  # noqa: E402

SETTINGS = ("idle", "loaded")


@attrs.define
class Freed:
    """What the runner's ``on_cancel_freed`` hook reports, as it happens."""

    times: list[tuple[float, float]] = attrs.Factory(list)
    """(perf_counter when the KV cells were freed, runner's cancel-to-free seconds)."""
    event: trio.Event = attrs.Factory(trio.Event)

    def install(self) -> None:
        """Wrap :meth:`Metrics.cancel_freed` (the runner's hook in ``serve``) for this process."""
        original = Metrics.cancel_freed
        freed = self

        def cancel_freed(metrics: Metrics, seconds: float) -> None:
            original(metrics, seconds)
            freed.times.append((time.perf_counter(), seconds))
            freed.event.set()

        Metrics.cancel_freed = cancel_freed  # type: ignore[method-assign]

    async def next(self, count: int, timeout: float = 30.0) -> tuple[float, float]:
        """Wait until ``count`` frees were reported; return the last."""
        with trio.fail_after(timeout):
            while len(self.times) < count:
                self.event = trio.Event()
                await self.event.wait()
        return self.times[count - 1]


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "smollm2", "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"Story {i}: write a long story about a lighthouse keeper."}],
    }


async def background(client: httpx.AsyncClient, stop: trio.Event, index: int) -> None:
    """Stream requests to their end, one after another, until ``stop``."""
    i = 0
    while not stop.is_set():
        async with client.stream("POST", "/v1/chat/completions", json=body(10_000 * index + i, 64)) as resp:
            async for _ in resp.aiter_raw():
                pass
        i += 1


async def cancels(state: Any, setting: str, n: int, slots: int, freed: Freed, rng: random.Random) -> list[dict]:
    """``n`` streams closed after a few chunks; the figures of each."""
    hub = state.hub
    url = state.urls[0]
    records = []
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client, trio.open_nursery() as nursery:
        stop = trio.Event()
        if setting == "loaded":
            for k in range(slots - 1):
                nursery.start_soon(background, client, stop, k + 1)
        i = 0
        while len(records) < n:
            i += 1
            chunks_wanted = rng.randint(1, 8)
            chunks = 0
            async with client.stream("POST", "/v1/chat/completions", json=body(i, 256)) as resp:
                mid = resp.headers["x-message-id"]
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        choices = json.loads(line[5:]).get("choices") or [{}]
                        if (choices[0].get("delta") or {}).get("content"):
                            chunks += 1
                            if chunks >= chunks_wanted:
                                break
                live = hub.live(mid)
                if live is None or live.done.is_set():  # it ended before the client left
                    continue
                sampled_at_close = live.snapshot().usage.output_tokens
                before = default_runner(hub).statistics().tokens_after_cancel_total
                closed = time.perf_counter()
            freed_at, runner_seconds = await freed.next(len(freed.times) + 1)
            await live.done.wait()
            records.append({
                "chunks_read": chunks,
                "cancel_to_free_seconds": runner_seconds,
                "close_to_free_seconds": freed_at - closed,
                "tokens_after_cancel": default_runner(hub).statistics().tokens_after_cancel_total - before,
                "tokens_after_close": live.snapshot().usage.output_tokens - sampled_at_close,
                "status": live.status,
            })
        stop.set()
    return records


async def run(config: Config, n: int, slots: int, seed: int) -> dict[str, list[dict]]:
    freed = Freed()
    freed.install()
    stop = trio.Event()
    rng = random.Random(seed)
    results = {}
    async with trio.open_nursery() as nursery:
        state = await nursery.start(lambda task_status: serve(
            config, LlamaLoader(), handle_signals=False, shutdown_trigger=stop, task_status=task_status))
        for setting in SETTINGS:
            results[setting] = await cancels(state, setting, n, slots, freed, rng)
            print(f"  {setting}: {n} cancels done", flush=True)
        stop.set()
    return results


def summarize(records: list[dict]) -> dict[str, Any]:
    c2f = [r["cancel_to_free_seconds"] for r in records]
    e2e = [r["close_to_free_seconds"] for r in records]
    after = [r["tokens_after_cancel"] for r in records]
    after_close = [r["tokens_after_close"] for r in records]
    return {
        "cancels": len(records),
        "cancel_to_free_p50": pct(c2f, 50),
        "cancel_to_free_p99": pct(c2f, 99),
        "cancel_to_free_max": max(c2f),
        "close_to_free_p50": pct(e2e, 50),
        "close_to_free_p99": pct(e2e, 99),
        "close_to_free_max": max(e2e),
        "tokens_after_cancel_total": sum(after),
        "tokens_after_cancel_max": max(after),
        "tokens_after_close_p50": pct(after_close, 50),
        "tokens_after_close_p99": pct(after_close, 99),
        "tokens_after_close_max": max(after_close),
        "statuses": sorted({r["status"] for r in records}),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--cancels", type=int, default=100, help="cancels per setting")
    ap.add_argument("--slots", type=int, default=4, help="engine slots (loaded: slots - 1 other streams)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the chunks read before each close")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp CPU threads (0: all cores)")
    args = ap.parse_args(argv)
    info = machine()
    print(f"abort on the real model: {args.cancels} cancels per setting, {args.slots} slots")
    print(machine_line(info), flush=True)
    with tempfile.TemporaryDirectory(prefix="ringserve-abort-") as tmp:
        config = (
            Config()
            .replace("server", port=0)
            .replace("engine", slots=args.slots, ctx_per_slot=1024)
            .replace("store", path=str(Path(tmp) / "store.sqlite3"))
            .replace("model", n_threads=args.threads)
        )
        if args.model is not None:
            config = config.replace("model", path=str(args.model))
        records = trio.run(run, config, args.cancels, args.slots, args.seed)
    summary = {setting: summarize(r) for setting, r in records.items()}
    rows = [[setting, s["cancels"],
             f"{fmt(s['cancel_to_free_p50'], 1e3, 2)}/{fmt(s['cancel_to_free_p99'], 1e3, 2)}",
             f"{fmt(s['close_to_free_p50'], 1e3, 2)}/{fmt(s['close_to_free_p99'], 1e3, 2)}",
             f"{s['tokens_after_cancel_total']} (max {s['tokens_after_cancel_max']})",
             (f"{fmt(s['tokens_after_close_p50'], digits=0)}/{fmt(s['tokens_after_close_p99'], digits=0)}"
              f" (max {s['tokens_after_close_max']})")]
            for setting, s in summary.items()]
    print()
    print(table(["setting", "cancels", "cancel->freed p50/p99 ms", "close->freed p50/p99 ms",
                 "tokens after cancel", "tokens after close p50/p99"], rows))
    payload = {
        "benchmark": "abort",
        "machine": info,
        "slots": args.slots,
        "summary": summary,
        "records": records,
    }
    print(f"\nwrote {write_json('abort', payload)}")

    fig, axes = figure(ncols=2, width=10, height=3.6)
    ax, ax2 = axes[0]
    for setting in SETTINGS:
        for key, ls in (("cancel_to_free_seconds", "-"), ("close_to_free_seconds", "--")):
            values = sorted(1e3 * r[key] for r in records[setting])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], ls=ls,
                    label=f"{setting}: {key.split('_seconds')[0].replace('_', ' ')}")
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_ylabel("share of cancels")
    ax.set_title("Time until the KV cells are freed (CDF)")
    ax.legend(fontsize=7)
    width = 0.38
    wasted = {s: [r["tokens_after_close"] + r["tokens_after_cancel"] for r in records[s]] for s in SETTINGS}
    top = max(max(counts) for counts in wasted.values())
    for i, setting in enumerate(SETTINGS):
        counts = wasted[setting]
        ax2.bar([k + (i - 0.5) * width for k in range(top + 1)], [counts.count(k) for k in range(top + 1)], width,
                label=setting)
    ax2.set_xticks(range(top + 1))
    ax2.set_xlabel("tokens decoded after the client closed")
    ax2.set_ylabel("cancels")
    ax2.set_title(f"Wasted decode per cancel ({args.cancels} cancels)")
    ax2.legend(fontsize=7)
    print(f"wrote {save_figure(fig, 'abort', info)}")
    return payload


if __name__ == "__main__":
    main()
