"""Shared fixtures: an in-process ringserve on the fake engine, and one on the real model
(the servers themselves are in ``tests/support/server.py``); and a marker per test folder.

Every test under ``tests/FOLDER/`` is marked ``FOLDER`` (registered in pyproject.toml), so one
layer runs by name: ``pytest -m core`` (values, no server: the fast layer), ``-m "not system"``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.common import ServerProcess
from tests.support.server import MODEL_TOML, SERVE, fake_config, running_server

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the name of its folder under ``tests/``.

    Raises:
        pytest.UsageError: a folder whose marker pyproject.toml does not register.
    """
    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        if len(parts) < 2:
            continue  # tests/test_*.py: the project as a whole (config, CLI, docs, layers)
        if parts[0] not in registered:
            raise pytest.UsageError(f"tests/{parts[0]}/ has no marker: register {parts[0]!r} in pyproject.toml")
        item.add_marker(parts[0])


@pytest.fixture
async def fake_server(tmp_path: Path) -> AsyncIterator[Any]:
    """Default fake-engine server; yields ``(state, httpx.AsyncClient)`` with base_url set."""
    async with running_server(fake_config(tmp_path)) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            yield state, client


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real-model server for the session (4 slots, 1024-token context per slot)."""
    cfg = tmp_path_factory.mktemp("model") / "config.toml"
    store = cfg.parent / "store.sqlite3"
    # Without the prompt-prefix cache: these tests compare greedy replies to repeated prompts, and a
    # cached prompt re-decodes its last token in a one-token batch, whose logits can round
    # differently (docs/prefix-cache.md); tests/engine/test_prefix_cache.py tests the cache.
    cfg.write_text(f'[engine]\nslots = 4\nctx_per_slot = 4608\nprefix_cache = false\n[store]\npath = "{store}"\n{MODEL_TOML}')
    server = ServerProcess([*SERVE, "--config", str(cfg)])
    yield server
    server.stop()
