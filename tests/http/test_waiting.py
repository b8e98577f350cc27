"""What a queued message waits for, in ``GET /v1/messages/{id}`` (issue 40: a request that waits
for room "is reported its place"; issue 41: one whose model loads sees the load's progress)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from ringserve.engine.fake import FakeEngine
from tests.live.test_models import SlowLoader, presets
from tests.support.helpers import ANTHROPIC_BODY
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)

ASYNC = {"Prefer": "respond-async"}


class HeldEngine(FakeEngine):
    """A fake engine whose decode calls wait for ``go``: the first request holds the only slot."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.go = threading.Event()
        self.held = threading.Event()

    def decode(self, feeds: Any) -> Any:
        self.held.set()
        self.go.wait(60)
        return super().decode(feeds)


async def waiting(client: httpx.AsyncClient, message_id: str) -> Any:
    return (await client.get(f"/v1/messages/{message_id}")).json()["waiting"]


async def ended(client: httpx.AsyncClient, message_id: str) -> Any:
    """The message once it is complete (``GET /v1/messages/{id}`` until it says so)."""
    async def complete() -> bool:
        return (await client.get(f"/v1/messages/{message_id}")).json()["status"] == "complete"

    await wait_until(complete)
    return (await client.get(f"/v1/messages/{message_id}")).json()


async def test_a_queued_message_says_its_place_then_its_prefill_then_nothing(tmp_path):
    engine = HeldEngine(n_slots=1, n_ctx=4096)
    config = fake_config(tmp_path, engine={"slots": 1})
    async with running_server(config, lambda _settings: engine) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        ids = []
        for text in ("first", "second", "third"):
            created = await client.post("/v1/messages", headers=ASYNC, json={
                **ANTHROPIC_BODY, "messages": [{"role": "user", "content": text}]})
            assert created.status_code == 202
            ids.append(created.json()["id"])
        await wait_until(engine.held.is_set)  # the first is admitted, its prefill held
        assert await waiting(client, ids[0]) == {"reason": "prefill"}
        assert await waiting(client, ids[1]) == {"reason": "queued", "ahead": 0}
        assert await waiting(client, ids[2]) == {"reason": "queued", "ahead": 1}
        engine.go.set()
        for message_id in ids:
            assert (await ended(client, message_id))["waiting"] is None


async def test_a_message_whose_model_loads_says_the_loads_progress(tmp_path):
    loader = SlowLoader()
    async with running_server(presets(tmp_path, ("alpha",)), engine_factory=loader) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        created = await client.post("/v1/messages", headers=ASYNC, json={**ANTHROPIC_BODY, "model": "alpha"})
        assert created.status_code == 202
        message_id = created.json()["id"]
        await wait_until(lambda: state.hub.models.find("alpha").progress == 0.5)
        assert await waiting(client, message_id) == {"reason": "model_loading", "progress": 0.5}
        loader.release.set()
        done = await ended(client, message_id)
        assert (done["text"], done["waiting"]) == ("loaded and answering", None)
