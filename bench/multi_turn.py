"""Multi-turn chat: ringserve's prompt-prefix cache on and off, and llama.cpp's ``llama-server``, side by side.

Every chat client sends the whole conversation on every turn. Two workloads,
both OpenAI streaming chat requests (greedy, ``max_tokens`` tokens,
``stream_options.include_usage``), each turn sending the system prompt and the
whole history so far:

* **single**: one conversation, a ~950-token system prompt (:data:`SYSTEM`,
  tokens counted with SmolLM2's tokenizer) and ``--turns`` turns one after
  another;
* **shared**: ``--conversations`` conversations with the same system prompt
  and their own questions, running at the same time; conversation ``i + 1``
  starts when conversation ``i``'s first answer begins to stream (so its
  system prompt is in some slot's cells by then), after that all of them go
  on concurrently, each turn as soon as that conversation's previous answer
  ended.

Servers, each a subprocess on the same model file and thread count:

* ``ringserve`` with ``[engine] prefix_cache = true`` (the default);
* ``ringserve (no cache)`` with ``prefix_cache = false``;
* ``llama-server`` when ``--llama-server PATH`` names llama.cpp's server binary
  (built from the llama.cpp that llama-cpp-python vendors: see
  ``docs/benchmarks.md``), run as ``llama-server -m MODEL -np SLOTS -c
  SLOTS*CTX -t T -tb T -b 512 -ub 512`` (its ``cache_prompt`` is on by
  default).

Rounds alternate which server goes first; a tag at the start of the system
prompt is new in every round (the same for every server within a round), so
each round's first turn is a miss everywhere. Measured per turn at the
client: TTFT (request sent to the first chunk with text), and from the
server's answer the prompt tokens and how many of them were cached
(ringserve and llama-server: ``usage.prompt_tokens_details.cached_tokens``;
llama-server also ``timings.cache_n``), so prefilled = prompt - cached.

``--fake`` runs ringserve on the fake engine (``bench/fake_server.py``, one
token per byte) instead of a model, for a seconds-long check that the script
works (``tests/system/test_bench.py``); its timings mean nothing.

Run from the repository root (needs ``pip install -e '.[bench]'``)::

    .venv/bin/python bench/multi_turn.py [--turns 4] [--rounds 3] [--llama-server PATH]

Writes ``bench/results/multi_turn.json`` and ``bench/results/multi_turn.png``.
"""

from __future__ import annotations

import argparse
import json
import os
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
    RINGSERVE_READY,
    ServerProcess,
    figure,
    fmt,
    llama_server,
    machine,
    machine_line,
    median,
    python,
    ringserve_config,
    save_figure,
    table,
    write_json,
)

SYSTEM = " ".join(
    [
        "You are the support assistant of a small company that builds and repairs bicycles.",
        "Answer questions about our workshop, our opening hours, our prices and our repair services.",
        "Our workshop opens from Monday to Saturday, from nine in the morning to six in the evening,",
        "and it is closed on Sundays and public holidays. A basic service costs forty euros and takes",
        "one working day; a full service costs ninety euros and takes two working days. Wheel truing",
        "costs fifteen euros per wheel. A new chain, fitted, costs twenty five euros plus the part.",
        "Tubeless conversions cost thirty euros per wheel plus sealant. We repair electric bicycles of",
        "the common brands but we do not repair their batteries; we send batteries to the maker.",
        "Always be polite and brief. If you do not know an answer, say so, and offer to ask a mechanic.",
        "Never promise a repair date without checking the workshop calendar. Prices include tax.",
    ]
    * 5
    + [
        "Keep every answer under fifty words. When a customer seems unsure, end with a short offer of",
        "further help, and remind them that they can book a repair by phone or at the workshop counter.",
    ]
)
"""The system prompt: 949 tokens with SmolLM2's tokenizer (the session tag in front adds about 6)."""

QUESTIONS = [
    "When are you open on Saturday?",
    "How much is a full service, and how long does it take?",
    "Can you fix the battery of my electric bike?",
    "What does a new chain cost?",
    "Do you true wheels, and at what price?",
    "Is tax included in your prices?",
]

SERVER_NAMES = ("ringserve", "ringserve (no cache)", "llama-server")


@attrs.define
class TurnTrace:
    """One turn as the client saw it (seconds) and as the server counted it (tokens)."""

    conversation: int
    turn: int
    sent: float
    first: float | None = None
    ended: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def prefilled(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens


def system_prompt(tag: str) -> str:
    return f"Session {tag}. {SYSTEM}"


def _cached(chunk: dict[str, Any]) -> int | None:
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = chunk.get("timings") or {}
    if timings.get("cache_n") is not None:
        return int(timings["cache_n"])
    return None


async def stream_turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int,
                      trace: TurnTrace, started: trio.Event | None = None) -> None:
    """POST one streamed chat turn; fill ``trace``; set ``started`` at its first text."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    parts = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
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
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if trace.first is None:
                            trace.first = time.perf_counter()
                            if started is not None:
                                started.set()
                        parts.append(content)
                if chunk.get("usage"):
                    trace.prompt_tokens = chunk["usage"].get("prompt_tokens")
                cached = _cached(chunk)
                if cached is not None:
                    trace.cached_tokens = cached
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    finally:
        trace.ended = time.perf_counter()
        trace.text = "".join(parts)
        if started is not None:
            started.set()  # never leave the next conversation waiting


async def conversation(client: httpx.AsyncClient, url: str, system: str, index: int, turns: int, max_tokens: int,
                       traces: list[TurnTrace], started: trio.Event | None = None) -> None:
    """``turns`` turns of conversation ``index``, each sending the whole history."""
    history: list[dict[str, str]] = []
    for t in range(turns):
        question = QUESTIONS[(index + t) % len(QUESTIONS)]
        if t == 0:
            question = f"(customer {index}) {question}"
        history.append({"role": "user", "content": question})
        trace = TurnTrace(index, t + 1, time.perf_counter())
        await stream_turn(client, url, [{"role": "system", "content": system}, *history], max_tokens, trace,
                          started if t == 0 else None)
        traces.append(trace)
        history.append({"role": "assistant", "content": trace.text})


async def run_scenario(url: str, scenario: str, tag: str, turns: int, conversations: int,
                       max_tokens: int) -> list[TurnTrace]:
    """One scenario against one server; the traces of every turn."""
    traces: list[TurnTrace] = []
    system = system_prompt(tag)
    n = 1 if scenario == "single" else conversations
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                started = trio.Event()
                nursery.start_soon(conversation, client, url, system, i, turns, max_tokens, traces, started)
                await started.wait()
    return sorted(traces, key=lambda x: (x.conversation, x.turn))


def start_servers(args: argparse.Namespace, tmp: Path) -> dict[str, ServerProcess]:
    servers: dict[str, ServerProcess] = {}
    try:
        for name, cache in (("ringserve", True), ("ringserve (no cache)", False)):
            tables: dict[str, dict[str, Any]] = {
                "server": {"port": 0},
                "engine": {"slots": args.slots, "ctx_per_slot": args.ctx, "prefix_cache": cache},
                "store": {"path": str(tmp / f"store-{cache}.sqlite3")},
            }
            if args.fake:
                tables["engine"]["ctx_per_slot"] = 16384  # one token per byte
                cfg = ringserve_config(tmp / f"ringserve-{cache}.toml", tables)
                argv = [python(), str(Path(__file__).resolve().parent / "fake_server.py"), "--config", str(cfg),
                        "--fake", json.dumps({"piece_bytes": 4})]
            else:
                tables["model"] = {"n_threads": args.threads, **({"path": str(args.model)} if args.model else {})}
                cfg = ringserve_config(tmp / f"ringserve-{cache}.toml", tables)
                argv = [python(), "-m", "ringserve", "serve", "--port", "0", "--config", str(cfg)]
            servers[name] = ServerProcess(argv, tmp / f"ringserve-{cache}.log", ready_pattern=RINGSERVE_READY)
        if args.llama_server is not None:
            from ringserve.engine.modelfile import default_model_path

            servers["llama-server"] = llama_server(args.llama_server, args.model or default_model_path(),
                                                   tmp / "llama-server.log", slots=args.slots,
                                                   ctx_per_slot=args.ctx, threads=args.threads)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def summarize(traces: list[TurnTrace]) -> dict[str, Any]:
    """Per turn: median TTFT, prompt, cached and prefilled tokens; first and later turns' TTFT."""
    turns = sorted({t.turn for t in traces})
    per_turn = {}
    for turn in turns:
        xs = [t for t in traces if t.turn == turn and t.error is None]
        per_turn[str(turn)] = {
            "ttft_p50": median(t.ttft for t in xs),
            "prompt_tokens": median(t.prompt_tokens for t in xs),
            "cached_tokens": median(t.cached_tokens for t in xs),
            "prefilled_tokens": median(t.prefilled for t in xs),
        }
    ok = [t for t in traces if t.error is None]
    return {
        "per_turn": per_turn,
        "first_turn_ttft_p50": median(t.ttft for t in ok if t.turn == 1),
        "later_turns_ttft_p50": median(t.ttft for t in ok if t.turn > 1),
        "errors": [t.error for t in traces if t.error is not None],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary to compare with")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--conversations", type=int, default=4, help="conversations in the shared scenario")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per turn")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of the whole comparison")
    ap.add_argument("--slots", type=int, default=4, help="slots (parallel sequences) of every server")
    ap.add_argument("--ctx", type=int, default=2048, help="context per slot (tokens)")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads per server (0: all cores)")
    ap.add_argument("--scenarios", nargs="+", default=["single", "shared"], choices=["single", "shared"])
    ap.add_argument("--fake", action="store_true", help="ringserve on the fake engine (a smoke test; no timings)")
    args = ap.parse_args(argv)
    args.threads = args.threads or os.cpu_count() or 1
    info = machine()
    print(f"multi-turn chat: {args.turns} turns, {args.conversations} conversations in 'shared',"
          f" max_tokens {args.tokens}, {args.rounds} rounds, {args.slots} slots, {args.threads} threads each"
          f"{', FAKE engine' if args.fake else ''}")
    print(machine_line(info), flush=True)

    raw: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    with tempfile.TemporaryDirectory(prefix="ringserve-bench-") as tmp_name:
        servers = start_servers(args, Path(tmp_name))
        names = [n for n in SERVER_NAMES if n in servers]
        raw = {name: {s: [] for s in args.scenarios} for name in names}
        try:
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for scenario in args.scenarios:
                    for name in order:
                        traces = trio.run(run_scenario, servers[name].url, scenario, f"{r}-{scenario}",
                                          args.turns, args.conversations, args.tokens)
                        raw[name][scenario].append([attrs.asdict(t) | {"ttft": t.ttft, "prefilled": t.prefilled}
                                                    for t in traces])
                        s = summarize(traces)
                        print(f"  round {r + 1} {scenario:>6} {name:>20}: first turn TTFT"
                              f" {fmt(s['first_turn_ttft_p50'], 1e3)} ms, later turns"
                              f" {fmt(s['later_turns_ttft_p50'], 1e3)} ms, errors {len(s['errors'])}", flush=True)
        finally:
            for server in servers.values():
                server.stop()

    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        summary[name] = {}
        for scenario in args.scenarios:
            traces = [TurnTrace(**{k: v for k, v in t.items() if k not in ("ttft", "prefilled")})
                      for rnd in raw[name][scenario] for t in rnd]
            summary[name][scenario] = summarize(traces)
    ratios: dict[str, dict[str, float | None]] = {}
    for scenario in args.scenarios:
        on = summary["ringserve"][scenario]["later_turns_ttft_p50"]
        off = summary["ringserve (no cache)"][scenario]["later_turns_ttft_p50"]
        cpp = summary.get("llama-server", {}).get(scenario, {}).get("later_turns_ttft_p50")
        ratios[scenario] = {
            "later_turns_no_cache_over_cache": off / on if on and off else None,
            "later_turns_cache_over_llama_server": on / cpp if on and cpp else None,
        }

    for scenario in args.scenarios:
        rows = []
        for name in names:
            s = summary[name][scenario]
            for turn, x in s["per_turn"].items():
                rows.append([name, turn, fmt(x["ttft_p50"], 1e3), fmt(x["prompt_tokens"], digits=0),
                             fmt(x["cached_tokens"], digits=0), fmt(x["prefilled_tokens"], digits=0)])
        print(f"\n{scenario}: medians over {args.rounds} rounds"
              f"{'' if scenario == 'single' else f' and {args.conversations} conversations'}")
        print(table(["server", "turn", "TTFT ms", "prompt", "cached", "prefilled"], rows))
        print(table(["server", "first-turn TTFT ms", "later-turn TTFT ms"],
                    [[n, fmt(summary[n][scenario]["first_turn_ttft_p50"], 1e3),
                      fmt(summary[n][scenario]["later_turns_ttft_p50"], 1e3)] for n in names]))
        r = ratios[scenario]
        print(f"later turns: no cache / cache {fmt(r['later_turns_no_cache_over_cache'], digits=1)}x,"
              f" cache / llama-server {fmt(r['later_turns_cache_over_llama_server'], digits=2)}")

    payload = {
        "benchmark": "multi_turn",
        "machine": info,
        "fake_engine": args.fake,
        "turns": args.turns,
        "conversations": args.conversations,
        "max_tokens": args.tokens,
        "rounds": args.rounds,
        "slots": args.slots,
        "ctx_per_slot": args.ctx,
        "threads": args.threads,
        "summary": summary,
        "ratios": ratios,
        "raw": raw,
    }
    print(f"\nwrote {write_json('multi_turn', payload)}")
    print(f"wrote {plot(payload)}")
    return payload


def plot(payload: dict[str, Any]) -> Path:
    """Draw ``bench/results/multi_turn.png``: median TTFT per turn, per server, one panel per scenario."""
    summary = payload["summary"]
    scenarios = list(next(iter(summary.values())))
    fig, axes = figure(ncols=len(scenarios), width=5 * len(scenarios), height=3.8)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for i, (name, marker) in enumerate(zip(SERVER_NAMES, ("o", "s", "^"), strict=True)):
            if name not in summary:
                continue
            per_turn = summary[name][scenario]["per_turn"]
            turns = sorted(int(t) for t in per_turn)
            ttft = [per_turn[str(t)]["ttft_p50"] for t in turns]
            ax.plot(turns, [1e3 * x if x is not None else float("nan") for x in ttft], marker=marker,
                    color=f"C{i}", label=name)
        ax.set_yscale("log")
        ax.set_xticks(turns)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50, ms")
        ax.set_title(f"{scenario}: whole history sent every turn")
        ax.legend(fontsize=7)
    return save_figure(fig, "multi_turn", payload["machine"])


if __name__ == "__main__":
    main()
