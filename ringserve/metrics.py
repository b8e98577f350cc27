"""Prometheus metrics for the streaming SLOs (``GET /metrics``, prometheus-client).

Every server has its own :class:`Metrics` with its own ``CollectorRegistry``
(never the global one), so servers started in one process, tests included,
never share a number. Two kinds of metric:

* **Event metrics**, observed where the event happens, through the methods
  below: the hub (time to first token, gaps between text entries, time per
  output token, failed generations), the app (resumes, heartbeats, slow-reader
  disconnects, truncated streams, HTTP errors) and the runner (cancel to KV
  freed, through its ``on_cancel_freed`` hook).
* **Snapshot metrics**, read at scrape time from ``statistics()`` of the
  sources given to :meth:`Metrics.watch` (the runner, the log store, the
  message store, the hub and the slow-reader watchdog; each returns a frozen
  value this module reads): slots, queue, KV cells, tokens, zombie tokens,
  readers, ring entries and bytes, append latency, store size and sweeps,
  generations, blocked writes. They cost nothing between scrapes.

Names follow the Prometheus conventions: base units (seconds, bytes),
``_total`` on counters, ``ringserve_`` prefix. ``configs/grafana-dashboard.json``
plots them. Core modules never import this one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, assert_never

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from ringserve.core.errors import ErrorKind
from ringserve.engine.runner import ModelsStatistics
from ringserve.logs.memory import LogStoreStatistics
from ringserve.store.sqlite import StoreStatistics

__all__ = ["CONTENT_TYPE", "GenerationStatistics", "Metrics", "Source", "WatchdogStatistics"]

#: The ``Content-Type`` of :meth:`Metrics.render` (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Seconds; from sub-frame to the long prefill of a full queue.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Seconds; one decode step to a visible stall.
GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Seconds per token; a big GPU to a slow CPU.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Seconds; within one decode step is the goal (C1).
FREE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@attrs.frozen
class GenerationStatistics:
    """What the owner of the generations reports (``live/hub.py`` ``Hub.statistics``).

    Attributes:
        active_generations: generations whose terminal event is not yet in their log.
        unsaved_messages: ended messages whose final state the store failed to write.
    """

    active_generations: int
    unsaved_messages: int


@attrs.frozen
class WatchdogStatistics:
    """What the slow-reader watchdog reports (``http/transport.py`` ``SendWatchdog.statistics``).

    Attributes:
        sends_in_flight: ASGI sends running now.
        oldest_send_seconds: how long the oldest of them has run (0 if none).
        readers_dropped_total: requests dropped because a send was blocked
            longer than the timeout (each counted once; exposed as
            ``ringserve_slow_reader_disconnects_total{reason="blocked"}``, counted where it happens).
        connections_aborted_total: TCP connections reset by the watchdog.
    """

    sends_in_flight: int
    oldest_send_seconds: float
    readers_dropped_total: int
    connections_aborted_total: int


#: What :meth:`Metrics.watch` reads a snapshot of.
Statistics = ModelsStatistics | LogStoreStatistics | StoreStatistics | GenerationStatistics | WatchdogStatistics


class Source(Protocol):
    """Anything with a ``statistics()`` snapshot that :meth:`Metrics.watch` knows how to read."""

    def statistics(self) -> Statistics: ...


class Metrics:
    """The metrics of one server: event instruments plus a scrape-time collector.

    Attributes:
        registry: this server's own registry; :meth:`render` exposes it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ringserve_time_to_first_token_seconds",
            "Seconds from a generation request to its first text in the stream log.",
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.gap = Histogram(
            "ringserve_inter_entry_gap_seconds",
            "Seconds between consecutive text entries of one stream (time between tokens as readers see it).",
            registry=r, buckets=GAP_BUCKETS,
        )
        self.tpot = Histogram(
            "ringserve_time_per_output_token_seconds",
            "Seconds per output token after the first, per finished (not cancelled) generation.",
            registry=r, buckets=TPOT_BUCKETS,
        )
        self.cancel_to_free = Histogram(
            "ringserve_cancel_to_kv_freed_seconds",
            "Seconds from a generation's cancel (abort or cancel request) to its KV cells being removed.",
            registry=r, buckets=FREE_BUCKETS,
        )
        self.resumes = Counter(
            "ringserve_resumes",
            "Requests to the resume route, by result: ok, ended (204), expired (410) or rejected (other 4xx).",
            ["result"], registry=r,
        )
        self.slow_readers = Counter(
            "ringserve_slow_reader_disconnects",
            "Readers dropped for being too slow: lagged (next entry left the ring) or blocked (writes stalled).",
            ["reason"], registry=r,
        )
        self.heartbeats = Counter(
            "ringserve_heartbeats", "SSE ': ping' comments sent to readers.", registry=r,
        )
        self.errors = Counter(
            "ringserve_errors",
            "Errors by type (ErrorKind) and stage: http (an error status was answered) or generation"
            " (a started generation failed; its readers got an in-band error event).",
            ["type", "stage"], registry=r,
        )
        self.truncated = Counter(
            "ringserve_streams_truncated",
            "Stream connections that ended before their terminal event (client gone, lagged): clients must resume.",
            ["reason"], registry=r,
        )

    # -- wiring ---------------------------------------------------------------------------

    def watch(self, *sources: Source) -> None:
        """Expose the snapshot metrics of ``sources`` (the model pool, the log store, the message
        store, the hub, the slow-reader watchdog), read at each scrape; call it once per server."""
        self.registry.register(_SnapshotCollector(sources))

    def render(self) -> bytes:
        """The Prometheus text exposition (``Content-Type``: :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    # -- events: generations (hub) --------------------------------------------------------

    def first_text(self, seconds: float) -> None:
        """A generation appended its first text to its log ``seconds`` after its request (TTFT)."""
        self.ttft.observe(seconds)

    def text_gap(self, seconds: float) -> None:
        """A generation appended text ``seconds`` after its previous text."""
        self.gap.observe(seconds)

    def time_per_token(self, seconds: float) -> None:
        """A generation finished: ``seconds`` per output token after the first (TPOT)."""
        self.tpot.observe(seconds)

    def cancel_freed(self, seconds: float) -> None:
        """The runner removed a cancelled generation's KV cells ``seconds`` after the cancel."""
        self.cancel_to_free.observe(seconds)

    def error(self, kind: ErrorKind, stage: str) -> None:
        """An error happened: ``stage`` is ``http`` (an error status answered) or ``generation``
        (a started generation failed; its log ends in an in-band error event). A non-stream request
        whose generation fails counts once in each."""
        self.errors.labels(type=kind.label, stage=stage).inc()  # HTTP and in-band errors share labels

    # -- events: readers (app) ------------------------------------------------------------

    def resumed(self, result: str) -> None:
        """A resume request was answered: ``ok``, ``ended``, ``expired`` or ``rejected``."""
        self.resumes.labels(result=result).inc()

    def heartbeat(self) -> None:
        """A reader was sent a ``: ping`` comment."""
        self.heartbeats.inc()

    def slow_reader_disconnected(self, reason: str) -> None:
        """A reader was dropped: ``lagged`` or ``blocked``."""
        self.slow_readers.labels(reason=reason).inc()

    def stream_truncated(self, reason: str) -> None:
        """A stream connection ended before its terminal event (``disconnected``, ``lagged``...)."""
        self.truncated.labels(reason=reason).inc()


class _SnapshotCollector(Collector):
    """Reads ``statistics()`` snapshots at scrape time (see the module docstring)."""

    def __init__(self, sources: tuple[Source, ...]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            stats = source.statistics()
            match stats:
                case ModelsStatistics():
                    yield from _models(stats)
                case LogStoreStatistics():
                    yield from _logs(stats)
                case StoreStatistics():
                    yield from _store(stats)
                case GenerationStatistics():
                    yield _gauge("ringserve_active_generations", "Generations whose producer is running.",
                                 stats.active_generations)
                    yield _gauge("ringserve_store_unsaved_messages",
                                 "Ended messages whose final state the store failed to write; retried every second.",
                                 stats.unsaved_messages)
                case WatchdogStatistics():
                    yield from _watchdog(stats)
                case _:
                    assert_never(stats)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


#: The runner's metrics: (name, type, help, the :class:`RunnerStatistics` field), each labelled by model.
_RUNNER_METRICS: tuple[tuple[str, type[GaugeMetricFamily | CounterMetricFamily], str, str], ...] = (
    ("ringserve_slots_busy", GaugeMetricFamily, "Slots holding a request or being released.", "slots_busy"),
    ("ringserve_slots_total", GaugeMetricFamily, "Slots decoded together.", "slots_total"),
    ("ringserve_kv_cells_used", GaugeMetricFamily,
     "KV-cache cells (tokens) held by requests over all slots (prefix-cache cells not counted).", "kv_cells_used"),
    ("ringserve_kv_cells_total", GaugeMetricFamily, "KV-cache cells (tokens) of the pool the slots share.",
     "kv_cells_total"),
    ("ringserve_prompt_tokens", CounterMetricFamily, "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("ringserve_prompt_tokens_prefilled", CounterMetricFamily,
     "Prompt tokens fed to the engine (not reused from the prefix cache).", "prompt_tokens_prefilled_total"),
    ("ringserve_prefix_cache_lookup_tokens", CounterMetricFamily,
     "Prompt tokens of requests admitted with the prompt-prefix cache on.", "prefix_cache_lookup_tokens_total"),
    ("ringserve_prefix_cache_hit_tokens", CounterMetricFamily,
     "Prompt tokens whose KV cells were reused from the prefix cache instead of prefilled.",
     "prefix_cache_hit_tokens_total"),
    ("ringserve_prefix_cache_cells", GaugeMetricFamily,
     "KV-cache cells (tokens) that free slots keep as prefix-cache entries.", "prefix_cache_cells"),
    ("ringserve_generated_tokens", CounterMetricFamily, "Tokens sampled for live requests.", "generated_tokens_total"),
    ("ringserve_zombie_tokens", CounterMetricFamily,
     "Tokens decoded for a generation after its cancel (its last reader gone under abort, or a cancel request):"
     " 0, or 1 per cancel that raced a decode step.", "tokens_after_cancel_total"),
    ("ringserve_cancels", CounterMetricFamily, "Generations cancelled by their consumer.", "cancels"),
    ("ringserve_preemptions", CounterMetricFamily,
     "Requests that gave their KV cells up so an older one could grow (they wait, then go on).", "preemptions"),
    ("ringserve_decode_steps", CounterMetricFamily, "Decode calls that succeeded.", "steps"),
    ("ringserve_decode_seconds", CounterMetricFamily, "Wall seconds spent in decode calls.", "decode_seconds_total"),
    ("ringserve_engine_idle_seconds", CounterMetricFamily,
     "Wall seconds between one decode call's end and the next one's start while generations were active:"
     " the engine waiting for the Python side.", "engine_idle_seconds_total"),
    ("ringserve_loop_lag_seconds", CounterMetricFamily,
     "Of ringserve_engine_idle_seconds, the wall seconds from a decode call's end to the owner loop taking its"
     " result: the engine waiting for the event loop (its coalescing windows widen).", "loop_lag_seconds_total"),
)


def _models(s: ModelsStatistics) -> Iterator[Metric]:
    """Each model's status, and its runner's metrics (labelled ``model``) while it is loaded."""
    status = GaugeMetricFamily("ringserve_model_status", "1 for each model's status (loaded, loading, unloaded,"
                               " unloading, failed).", labels=["model", "status"])
    queue = GaugeMetricFamily("ringserve_queue_depth", "Requests waiting for a slot, by model and priority.",
                              labels=["model", "priority"])
    families = [(kind(name, doc, labels=["model"]), field) for name, kind, doc, field in _RUNNER_METRICS]
    for model in s.models:
        status.add_metric([model.name, model.status], 1)
        if model.runner is None:
            continue
        for priority, n in sorted(model.runner.queue_depth.items()):
            queue.add_metric([model.name, str(priority)], n)
        for family, field in families:
            family.add_metric([model.name], getattr(model.runner, field))
    yield status
    yield queue
    yield from (family for family, _ in families)


def _logs(logs: LogStoreStatistics) -> Iterator[Metric]:
    yield _gauge("ringserve_connected_readers", "Readers of stream logs (SSE connections and non-stream waits).",
                 logs.readers)
    yield _gauge("ringserve_ring_logs", "Stream logs held (live and completed).", logs.logs)
    yield _gauge("ringserve_ring_entries", "Entries held over all stream logs.", logs.entries)
    yield _gauge("ringserve_ring_bytes", "Entry bytes held over all stream logs.", logs.bytes)
    yield _gauge("ringserve_ring_memory_cap_bytes", "The memory cap over all stream logs.", logs.memory_cap_bytes)
    yield _counter("ringserve_ring_appended_entries", "Entries appended to stream logs.", logs.appends_total)
    yield _counter("ringserve_ring_appended_bytes", "Bytes appended to stream logs.", logs.append_bytes_total)
    yield _counter("ringserve_ring_evicted_entries",
                   "Entries that left a full ring (a lagging reader of that log gets 410).",
                   logs.entries_evicted_total)
    yield SummaryMetricFamily("ringserve_ring_append_seconds", "Wall seconds per stream-log append.",
                              count_value=logs.appends_total, sum_value=logs.append_seconds_total)


def _store(store: StoreStatistics) -> Iterator[Metric]:
    yield _gauge("ringserve_store_bytes", "Bytes of the message store's database in use (WAL excluded).",
                 store.used_bytes)
    yield _gauge("ringserve_store_free_bytes", "Free pages of the message store not yet given back, in bytes.",
                 store.free_bytes)
    yield _counter("ringserve_store_swept_messages", "Finished messages deleted by the store's retention.",
                   store.swept_total)
    yield _gauge("ringserve_store_longest_sweep_step_seconds",
                 "The longest single retention batch or vacuum step so far (the store's other writes waited that long).",
                 store.longest_step_seconds)
    yield _counter("ringserve_store_write_failures",
                   "Message-store writes that failed (full disk, I/O error, a lock held too long).",
                   store.write_failures_total)


def _watchdog(dog: WatchdogStatistics) -> Iterator[Metric]:
    yield _gauge("ringserve_sends_in_flight", "Response writes (ASGI sends) running now.", dog.sends_in_flight)
    yield _gauge("ringserve_oldest_send_seconds",
                 "Seconds the oldest running response write has been blocked (0 if none); its reader is dropped"
                 " past [server] slow_reader_timeout.", dog.oldest_send_seconds)
    yield _counter("ringserve_connections_aborted", "TCP connections reset by the slow-reader watchdog.",
                   dog.connections_aborted_total)
