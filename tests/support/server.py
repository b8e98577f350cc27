"""Servers for tests: an in-process ringserve on the fake engine (:func:`running_server`), a real
``python -m ringserve serve`` in a subprocess (:class:`ServerProcess`), and the test config."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
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
#: The ``[model]`` table that says so, for the tests that write a config file.
MODEL_TOML = f"[model]\nn_threads = {MODEL_THREADS}\n"


def fake_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """A test config: port 0, a store in ``tmp_path``, :data:`MODEL_THREADS` for a real model,
    overrides per table."""
    config = (Config().replace("server", port=0).replace("store", path=str(tmp_path / "store.sqlite3"))
              .replace("model", n_threads=MODEL_THREADS))
    for section, changes in sections.items():
        config = config.replace(section, **changes)
    return config


@asynccontextmanager
async def running_server(config: Config, engine_factory: Any = None, **engine_kwargs: Any) -> AsyncIterator[Any]:
    """Serve ``config`` in this Trio run; yields the ServerState (``.urls[0]``, ``.hub``).

    The engine is a :class:`FakeEngine` built from ``engine_kwargs`` unless
    ``engine_factory`` (``Config -> Engine``, e.g. ``load_llama_engine``) is given.
    """
    stop = trio.Event()
    engine_kwargs.setdefault("n_slots", config.engine.slots)
    engine_kwargs.setdefault("n_ctx_slot", config.engine.ctx_per_slot)

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



class ServerProcess:
    """``python -m ringserve serve`` in a subprocess, on a free port, until stopped.

    A thread reads the server's output for as long as it runs and keeps its lines in ``lines``: a
    server whose log (its access log above all) is not read blocks on its stdout write once the pipe
    holds 64 KiB.
    """

    READY = r"ready: .* at (http://\S+)"

    def __init__(self, args: list[str], env: dict[str, str] | None = None, command: list[str] | None = None,
                 *, inherit_env: bool = True, cwd: Path | None = None) -> None:
        # ``command`` replaces ``python -m ringserve serve --port 0`` (tests/http/test_drain.py runs bench/fake_server.py
        # with it); ``inherit_env`` False gives the server ``env`` alone (tests/system/test_binary.py).
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "ringserve", "serve", "--port", "0"]), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**(os.environ if inherit_env else {}), **(env or {})},
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._ended = False  # the output reached EOF
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        ready = self._find(self.READY, 120)
        if ready is None:
            why = "exited" if self._ended else "did not become ready"
            self.stop()
            raise RuntimeError(f"server {why}:\n" + "".join(self.lines))
        self.url = re.search(self.READY, ready).group(1).rstrip(",")

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _find(self, pattern: str, timeout: float) -> str | None:
        """The first log line matching ``pattern``, waiting up to ``timeout`` s for it; None if it
        did not come in time or the output ended without it."""
        regex = re.compile(pattern)
        found: str | None = None
        checked = 0

        def seen() -> bool:
            nonlocal found, checked
            found = next((line for line in self.lines[checked:] if regex.search(line)), None)
            checked = len(self.lines)
            return found is not None or self._ended

        with self._changed:
            self._changed.wait_for(seen, timeout)
        return found

    def wait_for_log(self, pattern: str, timeout: float) -> str:
        """The first log line matching ``pattern`` (blocking; run it in a thread from Trio)."""
        found = self._find(pattern, timeout)
        assert found is not None, f"no log line matches {pattern!r}:\n" + "".join(self.lines)
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)  # the rest of the output, up to EOF
        self.proc.stdout.close()
        return self.proc.returncode
