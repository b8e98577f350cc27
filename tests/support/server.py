"""Servers for tests: an in-process ringserve on the fake engine (:func:`running_server`), the command
of a real ``python -m ringserve serve`` in a subprocess (:data:`SERVE`, for ``bench/common.py``'s
``ServerProcess``, which the benchmarks start their servers with too), and the test config."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ringserve.config import Config
from ringserve.engine.fake import FakeEngine
from ringserve.server import serve

#: llama.cpp threads of every real-model engine in the tests. Its threads meet at a barrier in every
#: decode call, so on a loaded 2-core machine two of them stall each other (docs/benchmarks.md): the
#: HTTP benchmark's one-stream smoke run measured 0.3 tokens/s with 2 threads, 2.2 with 1, at load
#: average 11. One thread decodes the same tokens and never waits for another.
MODEL_THREADS = 1
#: The ``[model]`` table that says so, for the tests that write a config file; with the KV pool split
#: among the slots (``kv_unified = false``), so that a greedy reply does not depend on what else the
#: pool holds (docs/architecture.md, "One KV pool"): the tests compare replies across requests.
MODEL_TOML = f"[model]\nn_threads = {MODEL_THREADS}\nkv_unified = false\n"

#: ``python -m ringserve serve`` on a free port: a test's server process runs it with its own arguments
#: (``ServerProcess([*SERVE, "--config", path])``).
SERVE = (sys.executable, "-m", "ringserve", "serve", "--port", "0")


def fake_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """A test config: port 0, a store in ``tmp_path``, :data:`MODEL_THREADS` and a split pool for a real
    model (as :data:`MODEL_TOML`), overrides per table."""
    config = (Config().replace("server", port=0).replace("store", path=str(tmp_path / "store.sqlite3"))
              .replace("model", n_threads=MODEL_THREADS, kv_unified=False))
    for section, changes in sections.items():
        config = config.replace(section, **changes)
    return config


def fake_pool(config: Config) -> int:
    """The fake engine's KV pool for ``config`` (tokens): ``[model] ctx_size``; else, where the config
    caps a request with ``[engine] ctx_per_slot``, room for every slot at that cap; else the fake's
    own default."""
    return config.model.ctx_size or config.engine.slots * config.engine.ctx_per_slot or FakeEngine().n_ctx


@asynccontextmanager
async def running_server(config: Config, engine_factory: Any = None, **engine_kwargs: Any) -> AsyncIterator[Any]:
    """Serve ``config`` in this Trio run; yields the ServerState (``.urls[0]``, ``.hub``).

    The engine is a :class:`FakeEngine` built from ``engine_kwargs`` unless
    ``engine_factory`` (``Config -> Engine``, e.g. ``load_llama_engine``) is given.
    """
    stop = trio.Event()
    engine_kwargs.setdefault("n_slots", config.engine.slots)
    engine_kwargs.setdefault("n_ctx", fake_pool(config))

    def factory(_config: Config) -> FakeEngine:
        return FakeEngine(**engine_kwargs)

    factory = engine_factory or factory

    async with trio.open_nursery() as nursery:
        state = await nursery.start(lambda task_status: serve(
            config, factory, handle_signals=False, shutdown_trigger=stop, task_status=task_status))
        try:
            yield state
        finally:
            stop.set()
