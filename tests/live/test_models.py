"""live/models.py: many models in one server (issue 41), on fake engines through HTTP: routing by
name, loading on demand, LRU at ``max_loaded``, idle unloading, a failed load, resume after an
unload, llama-server's ``/models`` routes, and a stream that waits for its model with keepalives."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from ringserve.config import ModelSettings
from ringserve.core.router import ModelStatus
from ringserve.core.sse import SSEParser
from ringserve.engine.fake import FakeEngine
from ringserve.engine.loader import Front, context_window
from ringserve.engine.modelfile import default_model_path
from ringserve.engine.protocol import Engine, EngineError
from ringserve.server import run_process, serve
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)


def presets(tmp_path: Path, names: tuple[str, ...] = ("alpha", "beta"), *,
            router: dict[str, Any] | None = None, **extra: dict[str, Any]) -> Any:
    """A config of presets only (no ``[model]`` path: no default model), each a copy of the bundled
    model's file (the fake engines ignore it)."""
    config = fake_config(tmp_path, router={"hf_cache": False, **(router or {})})
    tables = {name: {"path": str(default_model_path()), **extra.get(name, {})} for name in names}
    return attrs.evolve(config, models=type(config).from_dict({"models": tables}).models)


def named(settings: ModelSettings) -> FakeEngine:
    """A fake engine that says which model it is."""
    return FakeEngine(n_slots=settings.engine.slots, reply=f"I am {settings.model.name}.")


def parse(raw: bytes) -> list[Any]:
    return SSEParser().feed(raw)


async def ask(client: httpx.AsyncClient, model: str, text: str = "hello", **extra: Any) -> httpx.Response:
    return await client.post("/v1/messages", json={**ANTHROPIC_BODY, "model": model,
                                                   "messages": [{"role": "user", "content": text}], **extra})


async def statuses(client: httpx.AsyncClient) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in (await client.get("/v1/models")).json()["data"]}


async def test_two_models_answer_side_by_side_on_every_surface(tmp_path):
    async with running_server(presets(tmp_path), engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}
        a, b = await ask(client, "alpha"), await ask(client, "beta")
        assert (a.json()["model"], a.json()["content"][0]["text"]) == ("alpha", "I am alpha.")
        assert (b.json()["model"], b.json()["content"][0]["text"]) == ("beta", "I am beta.")
        chat = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "model": "beta",
                                                                "stream": True})
        assert openai_text(parse(chat.content)) == "I am beta."
        responses = (await client.post("/v1/responses", json={"model": "alpha", "input": "hi"})).json()
        assert responses["model"] == "alpha" and responses["output"][0]["content"][0]["text"] == "I am alpha."
        assert await statuses(client) == {"alpha": "loaded", "beta": "loaded"}
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert listed["alpha"]["supports"] == {"tools": False, "reasoning": False}
        assert listed["alpha"]["family"] == "generic" and listed["alpha"]["max_input_tokens"] > 0


async def test_an_unknown_name_is_a_404_in_the_surface_s_shape_listing_the_models(tmp_path):
    async with running_server(presets(tmp_path), engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        refused = await ask(client, "gpt-5")
        assert refused.status_code == 404 and refused.json()["type"] == "error"
        assert "no model 'gpt-5' here; the models are: alpha, beta" in refused.json()["error"]["message"]
        chat = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "model": "gpt-5"})
        assert chat.status_code == 404 and chat.json()["error"]["param"] == "model"
        no_model = {k: v for k, v in OPENAI_BODY.items() if k != "model"}
        unnamed = await client.post("/v1/chat/completions", json=no_model)
        assert unnamed.status_code == 404
        assert unnamed.json()["error"]["message"] == "the request names no model; the models are: alpha, beta"
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}  # nothing loaded for it


async def test_aliases_and_patterns_reach_their_model_and_a_default_takes_the_rest(tmp_path):
    config = presets(tmp_path, router={"default_model": "beta"},
                     alpha={"aliases": ["claude-*", "sonnet"]})
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert (await ask(client, "claude-sonnet-4-5")).json()["model"] == "alpha"
        assert (await ask(client, "sonnet")).json()["model"] == "alpha"
        assert (await ask(client, "gpt-5")).json()["model"] == "beta"


def unloads(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The log's unload lines."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("unloaded model")]


async def test_at_max_loaded_the_least_recently_used_idle_model_is_unloaded(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ringserve.models")
    closed: list[str] = []

    def factory(settings: ModelSettings) -> FakeEngine:
        engine = named(settings)
        engine.close = lambda: closed.append(settings.model.name)  # type: ignore[method-assign]
        return engine

    async with running_server(presets(tmp_path, router={"max_loaded": 1}), engine_factory=factory) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert (await ask(client, "alpha")).status_code == 200
        assert await statuses(client) == {"alpha": "loaded", "beta": "unloaded"}
        assert (await ask(client, "beta")).json()["content"][0]["text"] == "I am beta."
        assert await statuses(client) == {"alpha": "unloaded", "beta": "loaded"}
        assert closed == ["alpha"]  # its engine closed: its memory freed
        lru = "the least recently used idle model, to make room for another"
        assert unloads(caplog) == [f"unloaded model alpha ({lru})"]


async def test_a_model_with_a_running_generation_is_not_unloaded_under_it(tmp_path):
    """At ``max_loaded = 1``, a request for beta waits while alpha streams, and beta loads once
    alpha's generation ends; alpha's answer is whole."""
    def factory(settings: ModelSettings) -> FakeEngine:
        slow = {"step_seconds": 0.01, "piece_bytes": 1} if settings.model.name == "alpha" else {}
        return FakeEngine(reply=f"I am {settings.model.name}." * 20, **slow)

    async with running_server(presets(tmp_path, router={"max_loaded": 1}), engine_factory=factory) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client, trio.open_nursery() as nursery:
        answers: dict[str, httpx.Response] = {}

        async def run(model: str) -> None:
            answers[model] = await ask(client, model, max_tokens=1000)

        nursery.start_soon(run, "alpha")
        await wait_until(lambda: state.hub.models.find("alpha").runner is not None
                         and state.hub.models.find("alpha").runner.statistics().generated_tokens_total > 0)
        nursery.start_soon(run, "beta")
        await wait_until(lambda: "alpha" in answers)
        await wait_until(lambda: "beta" in answers)
    assert answers["alpha"].json()["content"][0]["text"] == "I am alpha." * 20
    assert answers["beta"].json()["content"][0]["text"] == "I am beta." * 20


async def test_an_idle_model_is_unloaded_after_its_keep_alive_and_zero_keeps_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ringserve.models")
    config = presets(tmp_path, alpha={"keep_alive": 0.2}, beta={"keep_alive": 0.0})
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        await ask(client, "alpha")
        await ask(client, "beta")
        await wait_until(lambda: state.hub.models.find("alpha").status is ModelStatus.UNLOADED)
        assert state.hub.models.find("beta").status is ModelStatus.LOADED
        assert unloads(caplog) == ["unloaded model alpha (idle for its keep_alive)"]
        assert (await ask(client, "alpha")).json()["content"][0]["text"] == "I am alpha."  # loads again


async def test_a_model_that_fails_to_load_is_a_clear_error_the_others_serve_and_it_is_tried_again(tmp_path):
    tries: list[int] = []

    def factory(settings: ModelSettings) -> FakeEngine:
        if settings.model.name == "broken":
            tries.append(1)
            if len(tries) < 3:
                raise EngineError("llama.cpp could not create a context of 99999 tokens")
        return named(settings)

    async with running_server(presets(tmp_path, ("alpha", "broken")), engine_factory=factory) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        refused = await ask(client, "broken")
        assert refused.status_code == 503 and refused.json()["type"] == "error"
        assert refused.json()["error"]["message"] == (
            "the model 'broken' cannot be loaded: llama.cpp could not create a context of 99999 tokens")
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert listed["broken"]["status"] == {"value": "failed", "failed": True,
                                             "error": refused.json()["error"]["message"]}
        assert (await ask(client, "alpha")).status_code == 200  # the others serve
        chat = await client.post("/v1/chat/completions", json={**OPENAI_BODY, "model": "broken",
                                                                "stream": True})
        assert chat.status_code == 503 and len(tries) == 2  # tried again on the next request
        assert (await ask(client, "broken")).json()["content"][0]["text"] == "I am broken."  # third time
        assert await statuses(client) == {"alpha": "loaded", "broken": "loaded"}


async def test_a_message_is_read_and_resumed_after_its_model_was_unloaded(tmp_path):
    async with running_server(presets(tmp_path), engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        streamed = await ask(client, "alpha", stream=True)
        events = parse(streamed.content)
        message_id = streamed.headers["x-message-id"]
        unloaded = await client.post("/models/unload", json={"model": "alpha"})
        assert (unloaded.status_code, unloaded.json()) == (200, {"success": True})
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}
        stored = (await client.get(f"/v1/messages/{message_id}")).json()
        assert (stored["status"], stored["text"], stored["model"]) == ("complete", "I am alpha.", "alpha")
        resumed = await client.get(f"/v1/messages/{message_id}/stream",
                                   headers={"Last-Event-ID": events[1].id})
        whole = anthropic_text(events[:2] + parse(resumed.content))
        assert whole == anthropic_text(events) == "I am alpha."


async def test_the_store_records_which_model_wrote_a_message_and_says_it_after_a_restart(tmp_path):
    """A message keeps the name of the model that wrote it (the one its alias reached), in its row:
    read back and replayed from the store by a server that has no model loaded, it says its model."""
    config = presets(tmp_path, alpha={"aliases": ["sonnet"]})
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        ids = {model: (await ask(client, model)).json()["id"] for model in ("sonnet", "beta")}
        assert {model: state.hub.store.get(i).model for model, i in ids.items()} == {"sonnet": "alpha",
                                                                                     "beta": "beta"}
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}
        stored = (await client.get(f"/v1/messages/{ids['sonnet']}")).json()
        assert (stored["status"], stored["model"], stored["text"]) == ("complete", "alpha", "I am alpha.")
        replayed = parse((await client.get(f"/v1/messages/{ids['beta']}/stream")).content)
        assert json.loads(replayed[0].data)["message"]["model"] == "beta"
        assert anthropic_text(replayed) == "I am beta."
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}  # read without loading


async def test_models_load_and_unload_by_hand_as_llama_server_s_router(tmp_path):
    """With a default model (beta) too: a name that reaches only the default neither loads nor
    unloads it."""
    config = presets(tmp_path, router={"default_model": "beta"})
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        loaded = await client.post("/models/load", json={"model": "beta"})
        assert (loaded.status_code, loaded.json()) == (200, {"success": True})
        assert (await client.get("/models")).json()["data"][1]["status"]["value"] == "loaded"
        again = await client.post("/models/load", json={"model": "beta"})
        assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
        missing = await client.post("/models/unload", json={"model": "nope"})
        assert missing.status_code == 404 and "models are: alpha, beta" in missing.json()["error"]["message"]
        assert (await client.post("/models/load", json={"model": "gpt-4o"})).status_code == 404
        bad = await client.post("/models/load", json={"name": "beta"})
        assert bad.status_code == 400 and '"model"' in bad.json()["error"]["message"]
        assert (await client.post("/models/unload", json={"model": "alpha"})).status_code == 400  # not loaded


class SlowLoader:
    """A loader whose front is quick (a fake engine as the tokenizer) and whose engine waits for
    ``release``: the phase where a request's stream waits for its model to load."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail

    def front(self, settings: ModelSettings) -> Front:
        engine = FakeEngine(n_ctx=4096, reply="loaded and answering")
        window = context_window(settings.engine, engine.n_ctx_seq)
        return Front(engine, engine.n_ctx, window, (settings.model.sampling,), engine=engine)

    def engine(self, settings: ModelSettings, front: Front, progress: Any) -> Engine:
        progress(0.5)
        self.release.wait(60)
        if self.fail:
            raise EngineError("out of memory")
        assert front.engine is not None
        return front.engine

    def free_memory(self) -> int | None:
        return None


@pytest.mark.parametrize("fail", [False, True], ids=["loads", "fails"])
async def test_a_stream_starts_at_once_and_keeps_alive_while_its_model_loads(tmp_path, fail):
    """The prompt is checked before the stream (a prompt too long is a 400 at once, C4); then the
    stream starts with ``message_start`` and keepalives while the model loads, the models list says
    ``loading`` with its progress, and the text comes once it is loaded; a load that fails ends the
    stream with the error in-band."""
    loader = SlowLoader(fail)
    config = presets(tmp_path, ("alpha",))
    config = config.replace("server", heartbeat_interval=1.0)
    async with running_server(config, engine_factory=loader) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        too_long = await ask(client, "alpha", "x" * 5000)
        assert too_long.status_code == 400 and "context is 4096 tokens" in too_long.json()["error"]["message"]
        async with client.stream("POST", "/v1/messages", json={**ANTHROPIC_BODY, "model": "alpha",
                                                                "stream": True}) as resp:
            assert resp.status_code == 200
            seen: list[Any] = []
            parser_events = resp.aiter_bytes()
            buffered = b""
            while sum(e.event == "ping" for e in seen) < 2:  # two keepalives while it loads
                buffered += await parser_events.__anext__()
                seen = parse(buffered)
            assert seen[0].event == "message_start"
            listed = (await client.get("/v1/models")).json()["data"][0]["status"]
            assert listed == {"value": "loading", "progress": 0.5}
            loader.release.set()
            async for chunk in parser_events:
                buffered += chunk
        events = parse(buffered)
        if fail:
            assert events[-1].event == "error" and "cannot be loaded: out of memory" in events[-1].data
        else:
            assert events[-1].event == "message_stop" and anthropic_text(events) == "loaded and answering"


async def test_counting_and_rendering_read_a_model_s_front_without_loading_it(tmp_path):
    async with running_server(presets(tmp_path), engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        counted = await client.post("/v1/messages/count_tokens", json={
            "model": "alpha", "messages": [{"role": "user", "content": "hello"}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        rendered = await client.post("/v1/chat/completions/render", json={**OPENAI_BODY, "model": "beta"})
        assert rendered.status_code == 200 and rendered.json()["input_tokens"] > 0
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}


class BigLoader(SlowLoader):
    """A model whose estimate (1,000 bytes) exceeds the free memory (500) with nothing else loaded."""

    def front(self, settings: ModelSettings) -> Front:
        return attrs.evolve(super().front(settings), memory=1000)

    def free_memory(self) -> int | None:
        return 500


def test_a_model_that_cannot_fit_with_every_other_unloaded_fails_at_start_instead_of_waiting(tmp_path):
    """Loaded at start: one line (EngineError), not a wait for a release that cannot come."""
    config = presets(tmp_path, ("alpha",), alpha={"load_on_startup": True}).replace("server", port=0)
    with pytest.raises(EngineError, match=r"the model 'alpha' cannot be loaded: it needs 1000 B, and 500 B"
                                          r" are free with every other model unloaded"):
        run_process(config, BigLoader())


async def test_a_model_that_cannot_fit_with_every_other_unloaded_is_an_error_at_once_on_demand(tmp_path):
    async with running_server(presets(tmp_path, ("alpha",)), engine_factory=BigLoader()) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        with trio.fail_after(30):
            refused = await ask(client, "alpha")
        # the load failed after the request was admitted: the in-band error, as for any failed load
        assert refused.status_code == 500 and refused.json()["error"]["type"] == "api_error", refused.text
        assert "1000 B, and 500 B are free" in refused.json()["error"]["message"]
        assert await statuses(client) == {"alpha": "failed"}


async def test_a_stop_while_the_models_load_at_start_stops_without_serving(tmp_path, caplog):
    """SIGTERM (here its event) before the start-up load ends: serve returns once the load's thread
    does, without a ready line (it used to go on to serve, and a load that waited never saw it)."""
    caplog.set_level(logging.INFO, logger="ringserve")
    loader = SlowLoader()
    config = presets(tmp_path, ("alpha",), alpha={"load_on_startup": True})
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve(config, loader, handle_signals=False, shutdown_trigger=stop))
            await wait_until(lambda: any(r.getMessage() == "loading model alpha" for r in caplog.records))
            stop.set()
            loader.release.set()
    messages = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("ready:") for m in messages) and messages[-1] == "stopped (exit status 0)"


async def test_a_preset_whose_file_cannot_be_loaded_is_a_warning_at_start_and_failed(tmp_path, caplog):
    """Said at start, not at its first request only; ``GET /v1/models`` (and so ``ringserve ls``)
    says it failed, and why, where it said ``unloaded``."""
    missing = tmp_path / "gone.gguf"
    config = presets(tmp_path, ("alpha", "gone"), gone={"path": str(missing)})
    caplog.set_level(logging.INFO, logger="ringserve")
    async with running_server(config, engine_factory=named) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        listed = {m["id"]: m["status"] for m in (await client.get("/v1/models")).json()["data"]}
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert "; 1 that cannot be loaded (gone), at " in ready and "on demand (gone)" not in ready
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = f"model file not found: {missing}"
    assert [w for w in warned if "gone" in w] == [f"model gone cannot be loaded: {said}"]
    assert listed["gone"] == {"value": "failed", "failed": True,
                              "error": f"the model 'gone' cannot be loaded: {said}"}
