"""``serve()``: the root nursery that owns the listener, the runner, the logs and every generation."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import hypercorn.config
import hypercorn.trio
import trio

from ringserve.app import ServerState, create_app
from ringserve.config import Config
from ringserve.engine.protocol import Engine
from ringserve.engine.runner import Runner
from ringserve.messages import MessageStore
from ringserve.stream.hub import CancelReason, Hub
from ringserve.stream.logs import MemoryLogStore

log = logging.getLogger("ringserve")


def load_llama_engine(config: Config) -> Engine:
    """Load the configured GGUF (the bundled model when ``model.path`` is empty).

    Raises:
        ModelFileError: the file is missing, unreadable or not GGUF (one-line message).
    """
    from ringserve.engine.llama import LlamaEngine
    from ringserve.engine.modelfile import check_model_file, default_model_path

    path = check_model_file(config.model.path or default_model_path())
    return LlamaEngine(
        path,
        n_slots=config.engine.slots,
        n_ctx_slot=config.engine.ctx_per_slot,
        n_batch=config.engine.n_batch,
        n_gpu_layers=config.model.n_gpu_layers,
        n_threads=config.model.n_threads,
        use_extra_bufts=config.model.use_extra_bufts,
        model_id=config.model.name or None,
    )


def hypercorn_config(config: Config) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    hc.bind = [f"{config.server.host}:{config.server.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    # Streams end with their own terminal events during a drain; give them time to be written.
    hc.graceful_timeout = config.server.drain_timeout + 5
    return hc


async def serve(
    config: Config,
    engine_factory: Callable[[Config], Engine] = load_llama_engine,
    *,
    handle_signals: bool = True,
    shutdown_trigger: trio.Event | None = None,
    task_status: trio.TaskStatus[ServerState] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ringserve until a signal (or ``shutdown_trigger``) asks it to stop.

    The listener starts first (``/health`` answers 503 while the model loads);
    ``task_status.started(state)`` is called once the model is loaded and the
    decode loop runs, with ``state.urls`` set. On SIGINT/SIGTERM: refuse new
    generations, let running ones finish for up to ``drain_timeout`` seconds,
    end the rest with a retryable in-band error, persist, and return. A second
    signal stops at once.
    """
    store = MessageStore(config.store.path)
    interrupted = store.mark_interrupted()
    if interrupted:
        log.info("marked %d message(s) left generating by a previous run as interrupted", interrupted)
    logs = MemoryLogStore(config.stream)
    state = ServerState(config)
    app = create_app(state)
    stop = trio.Event() if shutdown_trigger is None else shutdown_trigger
    listener_stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(logs.run)
            if handle_signals:
                nursery.start_soon(_watch_signals, stop)
            hc = hypercorn_config(config)
            http_done = trio.Event()
            urls = await nursery.start(_serve_http, app, hc, listener_stop, http_done)
            state.urls = urls
            log.info("listening on %s (loading the model)", ", ".join(urls))
            engine = await trio.to_thread.run_sync(engine_factory, config)
            runner = Runner(engine, config.engine)
            await nursery.start(runner.run)
            hub = Hub(config, runner, logs, store, nursery)
            state.model_id = runner.model_id
            state.hub = hub
            log.info(
                "ready: model %s, %d slots, %d tokens of context per slot, at %s",
                runner.model_id, config.engine.slots, runner.n_ctx_slot, ", ".join(urls),
            )
            task_status.started(state)
            await stop.wait()
            log.info("draining: refusing new generations, waiting up to %.0f s", config.server.drain_timeout)
            hub.drain()
            listener_stop.set()
            with trio.move_on_after(config.server.drain_timeout):
                await hub.wait_all_done()
            hub.cancel_all(CancelReason.DRAIN)
            await hub.wait_all_done()
            # Readers now hold terminal events; hypercorn finishes them within its graceful timeout.
            with trio.move_on_after(hc.graceful_timeout):
                await http_done.wait()
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def _serve_http(
    app: object, hc: hypercorn.config.Config, stop: trio.Event, done: trio.Event, *, task_status: trio.TaskStatus
) -> None:
    try:
        await hypercorn.trio.serve(app, hc, shutdown_trigger=stop.wait, task_status=task_status)
    finally:
        done.set()


async def _watch_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if stop.is_set():
                raise SystemExit(1)  # second signal: stop at once
            stop.set()
