"""Memory over a long run of mixed traffic on the fake engine (issue 43 item 8): RSS over time.

``python bench/soak.py [--minutes 30] [--workers 6] [--step-seconds 0.002] [--sample-seconds 10]
[--words 60] [--env NAME=VALUE ...]``

Starts ``bench/fake_server.py`` (the fake engine paced by ``step_seconds`` per decode step, the
default ``[stream]`` and ``[store]`` settings but a log TTL of ``--ttl`` seconds) and has
``--workers`` threads run the operations of :data:`OPERATIONS` in turn for ``--minutes``:
the three surfaces, streamed and not, resumed with ``Last-Event-ID``, cut by the client (the
abort policy), with an ``Idempotency-Key`` and its retry, under a client session header and its
retry, background responses polled to their end, ``previous_response_id`` chains deleted after,
``store: false``, tool calls, token counts, refusals (400, 404) and ``/metrics`` scrapes.
Every ``--sample-seconds`` it reads the server's RSS (``/proc``) and a few gauges
(``ringserve_ring_bytes``, ``ringserve_ring_logs``, ``ringserve_store_bytes``). It prints
RSS each minute, the slope (least squares, MB per minute) of each half of the run, the
operations made and any unexpected answers, and writes ``bench/results/soak.json`` and ``.png``.

The first minutes fill what is bounded on purpose (the logs up to their TTL, the prefix cache,
the grammar and template caches, the remembered ids of expired logs, the store's pages, the
allocator's arenas), so a flat second half is what says nothing grows without bound.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import random
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import (
    RINGSERVE_READY,
    ServerProcess,
    figure,
    machine,
    machine_line,
    python,
    ringserve_config,
    rss_bytes,
    save_figure,
    table,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
GAUGES = ("ringserve_ring_bytes", "ringserve_ring_logs", "ringserve_store_bytes",
          "ringserve_active_generations")
#: The prompts' words: three letters and a space, so that the fake engine's 4-byte reply tokens
#: are these words and its vocabulary stays this small (a new piece is a new entry in it).
WORDS = ("ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "imp", "jay", "koi", "lab", "mol", "nut",
         "owl", "pig", "ram", "sow", "tit", "urn", "vat", "wax", "yak", "zoo")
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Traffic:
    """The operations one worker makes, each a few requests; counts what the server answered."""

    def __init__(self, client: httpx.Client, worker: int, words: int) -> None:
        self.client = client
        self.worker = worker
        self.words = words
        self.random = random.Random(worker)
        self.n = itertools.count()
        self.unexpected: Counter[str] = Counter()
        self.requests = 0

    def text(self) -> str:
        """A prompt the fake engine echoes: ``words`` words of :data:`WORDS`, in a random order."""
        return "echo:" + " ".join(self.random.choices(WORDS, k=self.words))

    def check(self, resp: httpx.Response, op: str, *ok: int) -> httpx.Response:
        self.requests += 1
        if resp.status_code not in (ok or (200,)):
            self.unexpected[f"{op}: {resp.status_code}"] += 1
        return resp

    def anthropic(self, content: str, **extra: Any) -> dict[str, Any]:
        return {"model": "fake", "max_tokens": 400, "messages": [{"role": "user", "content": content}],
                **extra}

    def stream(self, op: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
               cut: bool = False) -> tuple[str | None, list[str]]:
        """POST a stream and read it (to its first delta when ``cut``): its message id and event ids."""
        ids: list[str] = []
        with self.client.stream("POST", path, json=body, headers=headers) as resp:
            self.check(resp, op)
            for line in resp.iter_lines():
                if line.startswith("id: "):
                    ids.append(line[4:])
                    if cut and len(ids) > 2:
                        break
            return resp.headers.get("x-message-id"), ids

    # -- the operations --------------------------------------------------------------------

    def anthropic_plain(self) -> None:
        msg = self.check(self.client.post("/v1/messages", json=self.anthropic(self.text())),
                         "anthropic").json()
        self.check(self.client.get(f"/v1/messages/{msg['id']}"), "anthropic get")

    def anthropic_resumed(self) -> None:
        message_id, ids = self.stream("anthropic stream", "/v1/messages",
                                      self.anthropic(self.text(), stream=True))
        if message_id and len(ids) > 4:
            with self.client.stream("GET", f"/v1/messages/{message_id}/stream",
                                    headers={"Last-Event-ID": ids[len(ids) // 2]}) as resp:
                self.check(resp, "resume")
                for _ in resp.iter_raw():
                    pass

    def anthropic_cut(self) -> None:
        self.stream("anthropic cut", "/v1/messages", self.anthropic(self.text(), stream=True), cut=True)

    def openai_stream(self) -> None:
        body = {"model": "fake", "max_tokens": 400, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": self.text()}]}
        self.stream("openai stream", "/v1/chat/completions", body)

    def openai_plain(self) -> None:
        body = {"model": "fake", "max_tokens": 400, "messages": [{"role": "user", "content": self.text()}]}
        self.check(self.client.post("/v1/chat/completions", json=body), "openai")

    def responses_chain(self) -> None:
        first = self.check(self.client.post("/v1/responses", json={"model": "fake", "input": self.text()}),
                           "responses").json()
        chained = {"model": "fake", "input": self.text(), "previous_response_id": first["id"]}
        self.check(self.client.post("/v1/responses", json=chained), "responses chained")
        self.check(self.client.delete(f"/v1/responses/{first['id']}"), "responses delete")

    def responses_background(self) -> None:
        body = {"model": "fake", "input": self.text(), "background": True}
        rid = self.check(self.client.post("/v1/responses", json=body), "background").json()["id"]
        while self.check(self.client.get(f"/v1/responses/{rid}"), "background get").json().get("status") in (
                "queued", "in_progress"):
            time.sleep(0.05)

    def responses_not_stored(self) -> None:
        self.stream("responses store false", "/v1/responses",
                    {"model": "fake", "input": self.text(), "stream": True, "store": False})

    def idempotent(self) -> None:
        body, key = self.anthropic(self.text()), {"Idempotency-Key": f"soak-{self.worker}-{next(self.n)}"}
        for _ in range(2):
            self.check(self.client.post("/v1/messages", json=body, headers=key), "idempotency key")

    def session(self) -> None:
        headers = {"x-claude-code-session-id": f"soak-session-{self.worker}"}
        body = self.anthropic(self.text(), stream=True)
        self.stream("session", "/v1/messages", body, headers, cut=True)
        self.stream("session retry", "/v1/messages", body, headers)

    def tools(self) -> None:
        body = self.anthropic(f"call the tool for city {next(self.n) % 50}", tools=[TOOL])
        self.check(self.client.post("/v1/messages", json=body), "tools")

    def counts_and_refusals(self) -> None:
        self.check(self.client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": [
            {"role": "user", "content": self.text()}]}), "count_tokens")
        self.check(self.client.post("/v1/messages", json={"model": "fake", "messages": []}), "refused", 400)
        self.check(self.client.get(f"/v1/messages/msg_{next(self.n):024x}"), "unknown", 404)
        self.check(self.client.get("/metrics"), "metrics")


OPERATIONS: tuple[Callable[[Traffic], None], ...] = (
    Traffic.anthropic_plain, Traffic.anthropic_resumed, Traffic.anthropic_cut, Traffic.openai_stream,
    Traffic.openai_plain, Traffic.responses_chain, Traffic.responses_background, Traffic.responses_not_stored,
    Traffic.idempotent, Traffic.session, Traffic.tools, Traffic.counts_and_refusals,
)
"""What each worker runs, in turn (shifted by its number)."""


def gauges(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for name in GAUGES:
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def slope_mb_per_minute(points: list[dict[str, Any]]) -> float | None:
    """Least-squares slope of RSS (MB) over time (minutes); None with fewer than 3 points."""
    if len(points) < 3:
        return None
    t = np.array([p["seconds"] / 60 for p in points])
    rss = np.array([p["rss_bytes"] / 1e6 for p in points])
    return float(np.polyfit(t, rss, 1)[0])


def run_workers(url: str, seconds: float, workers: int, words: int) -> tuple[int, Counter[str]]:
    """Run the traffic for ``seconds``; how many requests were made, and the unexpected answers."""
    stop = threading.Event()
    traffics: list[Traffic] = []

    def work(worker: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            traffic = Traffic(client, worker, words)
            traffics.append(traffic)
            for k in itertools.count(worker):
                if stop.is_set():
                    return
                operation = OPERATIONS[k % len(OPERATIONS)]
                try:
                    operation(traffic)
                except httpx.HTTPError as exc:
                    traffic.unexpected[f"{operation.__name__}: {type(exc).__name__}"] += 1

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(work, w) for w in range(workers)]
        stop.wait(seconds)
        stop.set()
        for f in futures:
            f.result()
    unexpected: Counter[str] = Counter()
    for traffic in traffics:
        unexpected.update(traffic.unexpected)
    return sum(t.requests for t in traffics), unexpected


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--step-seconds", type=float, default=0.002,
                    help="the fake engine's seconds per decode step")
    ap.add_argument("--sample-seconds", type=float, default=10.0)
    ap.add_argument("--words", type=int, default=60,
                    help="words in each prompt (the fake engine echoes them)")
    ap.add_argument("--ttl", type=float, default=60.0, help="[stream] ttl_seconds")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the server (e.g. MALLOC_ARENA_MAX=2)")
    args = ap.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    info = machine()
    print(f"Soak, fake engine ({args.step_seconds * 1000:g} ms a step): {args.minutes:g} minutes,"
          f" {args.workers} workers, {len(OPERATIONS)} operations in turn, log TTL {args.ttl:g} s"
          f"{', ' + ' '.join(args.env) if env else ''}")
    print(machine_line(info), flush=True)
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringserve-soak-") as tmp:
        cfg = ringserve_config(Path(tmp) / "config.toml", {
            "server": {"port": 0},
            "engine": {"slots": 4, "queue_size": 256},
            "stream": {"ttl_seconds": args.ttl},
            "store": {"path": str(Path(tmp) / "store.sqlite3")},
        })
        server = ServerProcess([python(), str(ROOT / "bench" / "fake_server.py"), "--config", str(cfg),
                                "--fake", json.dumps({"step_seconds": args.step_seconds})],
                               Path(tmp) / "server.log", ready_pattern=RINGSERVE_READY, env=env)
        try:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                started = time.monotonic()
                done = threading.Event()
                result: dict[str, Any] = {}

                def traffic() -> None:
                    result["requests"], result["unexpected"] = run_workers(
                        server.url, args.minutes * 60, args.workers, args.words)
                    done.set()

                driver = threading.Thread(target=traffic)
                driver.start()
                while not done.wait(0 if not points else args.sample_seconds):
                    points.append({"seconds": time.monotonic() - started, "rss_bytes": rss_bytes(server.pid),
                                   **gauges(client)})
                    if len(points) % max(1, round(60 / args.sample_seconds)) == 1:
                        p = points[-1]
                        print(f"  {p['seconds'] / 60:5.1f} min  RSS {p['rss_bytes'] / 1e6:7.1f} MB"
                              f"  ring {p['ringserve_ring_bytes'] / 1e6:6.1f} MB"
                              f" in {p['ringserve_ring_logs']:4.0f} logs"
                              f"  store {p['ringserve_store_bytes'] / 1e6:6.1f} MB", flush=True)
                driver.join()
                while gauges(client)["ringserve_active_generations"] > 0:
                    time.sleep(0.1)
                after = {"seconds": time.monotonic() - started, "rss_bytes": rss_bytes(server.pid),
                         **gauges(client)}
        finally:
            server.stop()
    half = [p for p in points if p["seconds"] >= points[-1]["seconds"] / 2]
    first = [p for p in points if p["seconds"] < points[-1]["seconds"] / 2]
    summary = {
        "rss_start_mb": points[0]["rss_bytes"] / 1e6,
        "rss_half_mb": half[0]["rss_bytes"] / 1e6,
        "rss_end_mb": points[-1]["rss_bytes"] / 1e6,
        "rss_idle_mb": after["rss_bytes"] / 1e6,
        "slope_first_half_mb_per_min": slope_mb_per_minute(first),
        "slope_second_half_mb_per_min": slope_mb_per_minute(half),
        "second_half_range_mb": (max(p["rss_bytes"] for p in half) - min(p["rss_bytes"] for p in half)) / 1e6,
        "requests": result["requests"],
        "unexpected": dict(result["unexpected"]),
    }
    print(table(["", "value"], [
        ["RSS at start, MB", f"{summary['rss_start_mb']:.1f}"],
        ["RSS at half time, MB", f"{summary['rss_half_mb']:.1f}"],
        ["RSS at the end, MB", f"{summary['rss_end_mb']:.1f}"],
        ["RSS once idle, MB", f"{summary['rss_idle_mb']:.1f}"],
        ["slope, first half, MB/min", f"{summary['slope_first_half_mb_per_min']:+.3f}"],
        ["slope, second half, MB/min", f"{summary['slope_second_half_mb_per_min']:+.3f}"],
        ["second half, max - min, MB", f"{summary['second_half_range_mb']:.1f}"],
        ["requests", str(summary["requests"])],
        ["unexpected answers", json.dumps(summary["unexpected"]) if summary["unexpected"] else "none"],
    ]))
    payload = {"bench": "soak", "machine": info, "args": vars(args), "summary": summary, "points": points}
    print(f"wrote {write_json('soak', payload)}")
    fig, axes = figure()
    ax = axes[0][0]
    ax.plot([p["seconds"] / 60 for p in points], [p["rss_bytes"] / 1e6 for p in points], label="RSS")
    ax.plot([p["seconds"] / 60 for p in points], [p["ringserve_ring_bytes"] / 1e6 for p in points],
            label="ring bytes")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MB")
    ax.legend()
    ax.set_title("Soak: mixed traffic on the fake engine")
    print(f"wrote {save_figure(fig, 'soak', info)}")
    return payload


if __name__ == "__main__":
    main()
