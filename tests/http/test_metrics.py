"""GET /metrics, /ready and the Grafana dashboard (ringserve/metrics.py).

Drives streams, cancels and resumes on the fake engine and reads the numbers
back from the Prometheus text, as a scraper would.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from ringserve.config import Config
from ringserve.core.sse import SSEParser, encode_comment
from ringserve.engine.fake import FakeEngine
from ringserve.http.transport import SendWatchdog
from ringserve.metrics import Metrics
from ringserve.server import serve
from tests.support.server import fake_config, running_server
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, sse_events
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
ASYNC = {"Prefer": "respond-async"}
LONG = "echo:" + " ".join(f"word{i}" for i in range(200))  # ~1500 tokens of prompt, ~750 of reply


SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
            "summary": ("_count", "_sum")}


class Scrape:
    """One scrape of /metrics: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.series: set[str] = set()  # every series name a family declares, with or without samples yet
        for family in text_string_to_metric_families(text):
            self.series |= {family.name + suffix for suffix in SUFFIXES[family.type]}
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(client: httpx.AsyncClient) -> Scrape:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


def body(content: str, **extra) -> dict:
    return {**ANTHROPIC_BODY, "max_tokens": 1000, "messages": [{"role": "user", "content": content}], **extra}


async def test_a_stream_a_cancel_and_resumes_are_counted(tmp_path):
    config = fake_config(tmp_path, stream={"flush_ms": 0.0})
    async with running_server(config, step_seconds=0.003, piece_bytes=2) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        runner = state.hub.runner
        before = await scrape(client)
        assert before("ringserve_slots_total") == config.engine.slots
        assert before("ringserve_kv_cells_total") == state.hub.runner.statistics().kv_cells_total == 16384  # the pool

        # 1. a whole stream: TTFT, gaps between its text entries, TPOT
        resp, events, raw = await sse_events(client, "POST", "/v1/messages",
                                             json=body("echo:" + " ".join(["hello"] * 10), stream=True))
        mid = resp.headers["x-message-id"]
        deltas = sum(e.event == "content_block_delta" for e in events)
        m = await scrape(client)
        assert m("ringserve_time_to_first_token_seconds_count") == 1
        assert m("ringserve_inter_entry_gap_seconds_count") == deltas - 1
        assert m("ringserve_time_per_output_token_seconds_count") == 1
        assert m("ringserve_streams_truncated_total", reason="disconnected") == 0
        stats = runner.statistics()
        assert m("ringserve_generated_tokens_total") == stats.generated_tokens_total > 0
        assert m("ringserve_prompt_tokens_total") == stats.prompt_tokens_total > 0
        assert m("ringserve_ring_appended_entries_total") == len(events)
        assert m("ringserve_ring_append_seconds_count") == len(events)
        assert m("ringserve_ring_bytes") == m("ringserve_ring_appended_bytes_total") == len(raw) > 0

        # 2. a stream whose client leaves mid-way (abort policy): live gauges, then a cancel
        async with client.stream("POST", "/v1/messages", json=body(LONG, stream=True)) as live:
            assert live.status_code == 200
            parser = SSEParser()
            chunks = live.aiter_raw()  # held: a dropped iterator is finalized, which closes the connection
            async for chunk in chunks:
                if sum(e.event == "content_block_delta" for e in parser.feed(chunk)) >= 1:
                    break
            m = await scrape(client)
            assert m("ringserve_active_generations") == 1
            assert m("ringserve_connected_readers") == 1
            assert m("ringserve_slots_busy") == 1
            assert m("ringserve_kv_cells_used") > 0
            assert m("ringserve_ring_entries") > len(events)
        await wait_until(lambda: state.hub.statistics().active_generations == 0)
        await runner.wait_idle()
        m = await scrape(client)
        stats = runner.statistics()
        assert m("ringserve_cancels_total") == stats.cancels == 1
        assert m("ringserve_cancel_to_kv_freed_seconds_count") == 1
        assert m("ringserve_zombie_tokens_total") == stats.tokens_after_cancel_total <= 1
        assert m("ringserve_streams_truncated_total", reason="disconnected") == 1
        assert m("ringserve_active_generations") == m("ringserve_connected_readers") == 0
        assert m("ringserve_slots_busy") == m("ringserve_kv_cells_used") == 0
        assert m("ringserve_time_per_output_token_seconds_count") == 1  # a cancelled one says nothing

        # 3. a cancel request for a generation nobody reads
        created = (await client.post("/v1/messages", json=body(LONG), headers=ASYNC)).json()
        assert (await client.post(f"/v1/messages/{created['id']}/cancel")).status_code == 200
        await runner.wait_idle()
        m = await scrape(client)
        assert m("ringserve_cancels_total") == 2
        assert m("ringserve_cancel_to_kv_freed_seconds_count") == runner.statistics().cancels == 2

        # 4. resumes: ok, rejected (bad Last-Event-ID), expired (log gone)
        ok = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": events[1].id})
        assert ok.status_code == 200
        bad = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": "nonsense"})
        assert bad.status_code == 400
        state.hub.logs.forget(mid)
        state.hub.store.update(mid, trace="")  # as a row written before schema 5: no stream to rebuild
        gone = await client.get(f"/v1/messages/{mid}/stream")
        assert gone.status_code == 410
        m = await scrape(client)
        assert m("ringserve_resumes_total", result="ok") == 1
        assert m("ringserve_resumes_total", result="rejected") == 1
        assert m("ringserve_resumes_total", result="expired") == 1
        assert m("ringserve_errors_total", type="invalid_request", stage="http") == 1
        assert m("ringserve_errors_total", type="gone", stage="http") == 1
        assert m("ringserve_heartbeats_total") == 0


async def test_a_reader_that_falls_out_of_the_ring_is_counted_as_lagged(tmp_path):
    """A client stops reading while the producer writes far more than the socket buffers and the
    ring hold: when it reads again its next entry is gone, so its connection ends without the
    terminal event, counted as truncated and as a lagged slow reader."""
    config = fake_config(tmp_path, stream={"ring_max_entries": 8})
    piece = 256 * 1024  # bytes per token, so each log entry is a quarter MiB
    async with running_server(config, reply="x" * (96 * piece), piece_bytes=piece, step_seconds=0.005) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        mid = (await client.post("/v1/messages", json=body("hi"), headers=ASYNC)).json()["id"]
        async with client.stream("GET", f"/v1/messages/{mid}/stream") as resp:
            assert resp.status_code == 200
            # not reading: ~24 MiB are produced, far more than the socket buffers take
            await wait_until(lambda: state.hub.statistics().active_generations == 0)
            parser = SSEParser()
            events = [e async for chunk in resp.aiter_raw() for e in parser.feed(chunk)]
        assert events and events[-1].event != "message_stop"
        m = await scrape(client)
        assert m("ringserve_slow_reader_disconnects_total", reason="lagged") == 1
        assert m("ringserve_streams_truncated_total", reason="lagged") == 1
        assert m("ringserve_ring_evicted_entries_total") > 0


async def test_queue_depth_by_priority(tmp_path):
    config = fake_config(tmp_path, engine={"slots": 1})
    async with running_server(config, step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        ids = [(await client.post("/v1/messages", json=body(LONG), headers=ASYNC)).json()["id"] for _ in range(3)]
        m = await scrape(client)
        assert m("ringserve_queue_depth", priority="0") == 2
        assert m("ringserve_slots_busy") == m("ringserve_slots_total") == 1
        assert m("ringserve_active_generations") == 3
        for mid in ids:
            await client.post(f"/v1/messages/{mid}/cancel")
        assert (await scrape(client))("ringserve_queue_depth", priority="0") == 0


async def test_heartbeats_are_counted(tmp_path):
    """The readers' ``: ping`` comments (on Chat Completions, which has no keepalive event of its own)."""
    config = fake_config(tmp_path, server={"heartbeat_interval": 1.0})
    async with running_server(config, prefill_seconds=1.3) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        _, events, raw = await sse_events(client, "POST", "/v1/chat/completions", json={**OPENAI_BODY, "stream": True})
        assert events[-1].data == "[DONE]"
        pings = raw.count(encode_comment("ping"))
        assert pings >= 1
        assert (await scrape(client))("ringserve_heartbeats_total") == pings


@pytest.mark.parametrize("path, request_body", [("/v1/messages", ANTHROPIC_BODY),
                                                 ("/v1/chat/completions", OPENAI_BODY)])
async def test_in_band_errors_are_counted_by_type(tmp_path, path, request_body):
    async with running_server(fake_config(tmp_path), fail_after_tokens=3) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        _, events, _ = await sse_events(client, "POST", path, json={**request_body, "stream": True})
        assert "error" in json.loads(events[-1].data)
        m = await scrape(client)
        assert m("ringserve_errors_total", type="api_error", stage="generation") == 1
        assert m("ringserve_time_per_output_token_seconds_count") == 0


async def test_ready_is_503_until_the_model_is_loaded_and_while_draining(tmp_path):
    loaded = threading.Event()
    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    def slow_factory(config: Config) -> FakeEngine:
        assert loaded.wait(10)
        return FakeEngine(n_slots=config.engine.slots, step_seconds=0.005)

    handler = Grab()
    logging.getLogger("ringserve").addHandler(handler)
    logging.getLogger("ringserve").setLevel(logging.INFO)
    stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve(fake_config(tmp_path), slow_factory, handle_signals=False,
                                             shutdown_trigger=stop))
            await wait_until(lambda: any("listening on" in line for line in seen))
            url = re.search(r"listening on (\S+)", next(line for line in seen if "listening on" in line))[1]
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                ready = await client.get("/ready")
                assert (ready.status_code, ready.json()["status"]) == (503, "loading")
                health = await client.get("/health")
                assert (health.status_code, health.json()["status"]) == (503, "loading")  # issue 2: 503 while loading
                loaded.set()
                with trio.fail_after(10):
                    while (await client.get("/ready")).status_code != 200:
                        await trio.sleep(0.01)
                assert (await client.get("/health")).json() == {"status": "ok", "model": "fake"}
                # draining: the listener still answers while a generation finishes
                mid = (await client.post("/v1/messages", json=body(LONG), headers=ASYNC)).json()["id"]
                stop.set()
                with trio.fail_after(10):
                    while (ready := await client.get("/ready")).status_code != 503:
                        await trio.sleep(0.01)
                assert ready.json()["status"] == "draining"
                assert (await client.get("/health")).json()["status"] == "draining"
                assert (await client.post(f"/v1/messages/{mid}/cancel")).status_code == 200
    finally:
        loaded.set()
        logging.getLogger("ringserve").removeHandler(handler)


async def test_the_slow_reader_watchdog_is_scraped(autojump_clock):
    metrics, dog = Metrics(), SendWatchdog(10.0)
    metrics.watch(dog)
    idle = Scrape(metrics.render().decode())
    assert (idle("ringserve_sends_in_flight"), idle("ringserve_oldest_send_seconds")) == (0, 0)

    async def blocked_send(seconds: float) -> None:
        with trio.CancelScope() as cancel_scope, dog.watch({"http_version": "1.1"}, cancel_scope):
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked_send, 5)
        await trio.sleep(3)
        nursery.start_soon(blocked_send, 5)
        await trio.sleep(1)
        busy = Scrape(metrics.render().decode())
        assert (busy("ringserve_sends_in_flight"), busy("ringserve_oldest_send_seconds")) == (2, 4)
        assert busy("ringserve_connections_aborted_total") == 0


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.heartbeat()
    assert b"ringserve_heartbeats_total 1.0" in a.render()
    assert b"ringserve_heartbeats_total 0.0" in b.render()


async def test_grafana_dashboard_plots_only_metrics_that_exist(fake_server):
    _, client = fake_server
    dashboard = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    titles = {p["title"] for p in panels}
    for needed in ("Time to first token", "Time between entries", "Tokens per second", "Queue depth",
                   "Slots in use", "KV cache in use", "Active streams", "Errors by type", "Zombie tokens",
                   "Prefix cache hit ratio", "Store size", "Store write failures"):
        assert needed in titles
    series = (await scrape(client)).series
    used = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"\bringserve_[a-z_]+", target["expr"]))
    assert used and not used - series
    # every prefix-cache and store series is plotted (a new one must get a panel)
    cache_and_store = {name for name in series if name.startswith(("ringserve_prefix_cache_", "ringserve_store_"))}
    cache_and_store |= {"ringserve_prompt_tokens_prefilled_total"}
    assert {"ringserve_store_write_failures_total", "ringserve_store_unsaved_messages"} <= cache_and_store
    assert not cache_and_store - used, sorted(cache_and_store - used)
    watchdog = {"ringserve_sends_in_flight", "ringserve_oldest_send_seconds", "ringserve_connections_aborted_total"}
    assert watchdog <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
