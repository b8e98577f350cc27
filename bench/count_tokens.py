"""``POST /v1/messages/count_tokens`` in a burst, beside streams that decode (issue 33).

Claude Code counts tokens in bursts (its tools, MCP servers, attachments), with a 10 s timeout and
no retry (docs/agents.md, "count_tokens"). This sends ``--calls`` counts spread evenly over one
second, each with the body of a captured Claude Code request (``tests/data/agents/claude_*.jsonl``:
``model``, ``system``, ``messages``, ``tools``; 12,700 to 21,900 tokens with SmolLM2's tokenizer,
so its last tools are dropped until the body fits a slot, the bundled model's context being
8,192 tokens, and a body that does not fit without tools is left out), and measures each call from its send to its answer, in two conditions per round:

* **idle**: nothing else runs;
* **decoding**: ``--streams`` streaming generations (long replies) are decoding all the while:
  the burst starts once each has streamed its first text, and each must still be streaming
  when the burst ends, else the round is repeated with a longer reply.

Every count must be a 200. The server is ``ringserve serve`` on the bundled model (or
``--model``), ``--slots`` slots of ``--ctx`` tokens, ``--threads`` decode threads. ``--fake`` runs it on the fake engine (``bench/fake_server.py``, a token per
byte) for a seconds-long check that the script works (``tests/system/test_bench.py``); its
timings mean nothing.

Run from the repository root (needs ``pip install -e '.[bench]'``)::

    .venv/bin/python bench/count_tokens.py [--calls 50] [--streams 4] [--rounds 3]

Writes ``bench/results/count_tokens.json`` and ``bench/results/count_tokens.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RINGSERVE_READY,
    ServerProcess,
    figure,
    fmt,
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

AGENTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "agents"
STORY = "Write a very long story about a lighthouse keeper and her cat, chapter by chapter, with dialogue."


def count_bodies() -> list[dict[str, Any]]:
    """The count_tokens bodies: the prompt fields of every captured Claude Code model call."""
    bodies = []
    for capture in sorted(AGENTS.glob("claude_*.jsonl")):
        for line in capture.read_text().splitlines():
            body = json.loads(line)["body"]
            bodies.append({k: body[k] for k in ("model", "system", "messages", "tools") if k in body})
    return bodies


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int, started: trio.Event, ended: list[float]) -> None:
    """One streaming generation: ``started`` is set at its first text; its end time goes to ``ended``."""
    body = {"model": "any", "max_tokens": max_tokens, "stream": True, "temperature": 0.8, "seed": 1,
            "messages": [{"role": "user", "content": STORY}]}
    async with client.stream("POST", f"{url}/v1/messages", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and '"text_delta"' in line:
                started.set()
    ended.append(time.monotonic())


async def burst(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]], calls: int) -> list[float]:
    """``calls`` counts sent evenly over one second; each one's seconds from send to answer."""
    latencies: list[float] = []

    async def one(body: dict[str, Any]) -> None:
        sent = time.monotonic()
        resp = await client.post(f"{url}/v1/messages/count_tokens", json=body,
                                 headers={"anthropic-version": "2023-06-01"})
        latencies.append(time.monotonic() - sent)
        if resp.status_code != 200:
            raise RuntimeError(f"count_tokens answered {resp.status_code}: {resp.text[:300]}")

    async with trio.open_nursery() as nursery:
        for i in range(calls):
            nursery.start_soon(one, bodies[i % len(bodies)])
            await trio.sleep(1.0 / calls)
    return latencies


async def fitted(url: str, bodies: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """Each body with as many of its tools as fit a slot (the last ones dropped, not the deferred
    ones, which tool results may name), and its count; a body that does not fit without its
    tools is left out."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for body in bodies:
            while True:
                resp = await client.post(f"{url}/v1/messages/count_tokens", json=body)
                if resp.status_code == 200:
                    out.append((body, resp.json()["input_tokens"]))
                    break
                tools = body.get("tools", [])
                loaded = [i for i, t in enumerate(tools) if not t.get("defer_loading")]  # deferred: referenced
                if "context per slot" not in resp.text:
                    raise RuntimeError(f"count_tokens answered {resp.status_code}: {resp.text[:300]}")
                if not loaded:
                    break  # its system prompt and messages alone do not fit: left out
                body = {**body, "tools": tools[: loaded[-1]] + tools[loaded[-1] + 1:]}
    return out


async def round_(url: str, bodies: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.calls + args.streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        idle = await burst(client, url, bodies, args.calls)
        max_tokens = args.reply_tokens
        for _attempt in range(4):
            ended: list[float] = []
            async with trio.open_nursery() as nursery:
                starts = [trio.Event() for _ in range(args.streams)]
                for started in starts:
                    nursery.start_soon(stream, client, url, max_tokens, started, ended)
                for started in starts:
                    await started.wait()
                decoding = await burst(client, url, bodies, args.calls)
                burst_end = time.monotonic()
            if len(ended) == args.streams and min(ended) > burst_end:
                return {"idle": idle, "decoding": decoding, "reply_tokens": max_tokens}
            max_tokens *= 2  # a stream ended before the burst did: longer replies
    raise RuntimeError("the streams kept ending before the burst did")


def start_server(args: argparse.Namespace, tmp: Path) -> ServerProcess:
    tables: dict[str, dict[str, Any]] = {
        "server": {"port": 0},
        "engine": {"slots": args.slots, "ctx_per_slot": args.ctx},
        "store": {"path": str(tmp / "store.sqlite3")},
    }
    if args.fake:
        tables["engine"]["ctx_per_slot"] = 131072  # one token per byte
        cfg = ringserve_config(tmp / "ringserve.toml", tables)
        argv = [python(), str(Path(__file__).resolve().parent / "fake_server.py"), "--config", str(cfg),
                "--fake", json.dumps({"piece_bytes": 4, "reply": "z" * 4000, "step_seconds": 0.002})]
    else:
        tables["model"] = {"n_threads": args.threads, **({"path": str(args.model)} if args.model else {})}
        cfg = ringserve_config(tmp / "ringserve.toml", tables)
        argv = [python(), "-m", "ringserve", "serve", "--port", "0", "--config", str(cfg)]
    return ServerProcess(argv, tmp / "ringserve.log", ready_pattern=RINGSERVE_READY)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50, help="counts per burst (sent over one second)")
    parser.add_argument("--streams", type=int, default=4, help="generations decoding during the burst")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=8192, help="tokens per slot")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reply-tokens", type=int, default=400, help="the streams' max_tokens (doubled if too short)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--fake", action="store_true", help="the fake engine: checks the script, times mean nothing")
    args = parser.parse_args(argv)
    bodies = count_bodies()
    info = machine()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, Path(tmp))
        try:
            counted = trio.run(fitted, server.url, bodies)
            bodies = [body for body, _ in counted]
            for _ in range(args.rounds):
                rounds.append(trio.run(round_, server.url, bodies, args))
        finally:
            server.stop()
    summary = {
        condition: {
            "p50_s": median(pct(r[condition], 50) for r in rounds),
            "p99_s": median(pct(r[condition], 99) for r in rounds),
            "max_s": max(max(r[condition]) for r in rounds),
        }
        for condition in ("idle", "decoding")
    }
    tokens = [n for _, n in counted]
    payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "body_tokens": tokens,
               "rounds": rounds, "summary": summary}
    print(machine_line(info))
    print(f"{args.calls} counts over 1 s, bodies of {len(bodies)} captured Claude Code requests"
          f" ({min(tokens)}-{max(tokens)} tokens);"
          f" {args.streams} streams decoding in the second condition ({args.rounds} rounds, medians)")
    print(table(["condition", "p50 ms", "p99 ms", "max ms"],
                [[c, fmt(s["p50_s"], 1000), fmt(s["p99_s"], 1000), fmt(s["max_s"], 1000)] for c, s in summary.items()]))
    write_json("count_tokens", payload)
    fig, axes = figure(width=7, height=4)
    for condition in ("idle", "decoding"):
        values = sorted(v * 1000 for r in rounds for v in r[condition])
        axes[0][0].plot(values, [(i + 1) / len(values) for i in range(len(values))], label=condition)
    axes[0][0].set_xlabel("count_tokens latency (ms)")
    axes[0][0].set_ylabel("fraction of calls")
    axes[0][0].legend()
    save_figure(fig, "count_tokens", info)
    return payload


if __name__ == "__main__":
    main()
