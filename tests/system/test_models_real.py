"""Issues 40 and 41 on the real models: the bundled SmolLM2 and gemma-3-270m (32,768 tokens of
context, no chat template), through in-process servers with the GGUF loader (``engine/llama.py``
``LlamaLoader``): sizing from the model with no config, the GGUF's sampling defaults, two models
side by side on every surface, loading on demand, LRU at ``max_loaded = 1``, idle unloading, a
model that fails to load, resume after an unload, and loading and unloading without a leak.
Short and greedy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import gguf
import httpx
import pytest
import trio
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from bench.common import rss_bytes
from ringserve.config import Config
from ringserve.core.router import ModelStatus
from ringserve.core.sizing import GIB, ContextReason, GpuMemory, LayersReason, MemoryReport
from ringserve.core.sse import SSEParser
from ringserve.engine.catalog import discover
from ringserve.engine.llama import LlamaLoader
from ringserve.live.models import ModelPool
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY, anthropic_text, openai_text
from tests.support.models import gemma_path, smollm2_path
from tests.support.server import MODEL_THREADS, fake_config, running_server
from tests.support.wait import wait_until

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0}


def config_of(
    tmp_path: Path, models: dict[str, dict[str, Any]] | None = None, **sections: dict[str, Any]
) -> Config:
    """A test config (the model named by its file, one decode thread) with ``models`` as presets."""
    config = fake_config(tmp_path, **sections).replace("model", name="", kv_unified=True)
    if models:
        tables = {name: {"n_threads": MODEL_THREADS, **table} for name, table in models.items()}
        config = attrs.evolve(config, models=Config.from_dict({"models": tables}).models)
    return config


def with_metadata(source: Path, target: Path, **values: float) -> Path:
    """A copy of the GGUF ``source`` with float32 keys ``values`` (``general_sampling_temp`` is
    ``general.sampling.temp``) set, as llama.cpp's ``gguf_new_metadata.py`` writes it."""
    if not target.exists():
        reader = gguf.GGUFReader(source)
        arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
        writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
        new = {
            key.replace("_", "."): MetadataDetails(gguf.GGUFValueType.FLOAT32, value)
            for key, value in values.items()
        }
        copy_with_new_metadata(reader, writer, new, [])
    return target


async def ask(
    client: httpx.AsyncClient, model: str, text: str = "Say hello.", **extra: Any
) -> dict[str, Any]:
    resp = await client.post(
        "/v1/messages",
        json={
            **ANTHROPIC_BODY,
            "model": model,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": text}],
            **extra,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


async def status(client: httpx.AsyncClient) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in (await client.get("/v1/models")).json()["data"]}


async def test_gemma_with_no_config_gets_its_trained_context_and_the_json_says_why(tmp_path):
    config = config_of(tmp_path).replace("model", path=str(gemma_path()))
    async with (
        running_server(config, engine_factory=LlamaLoader()) as state,
        httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client,
    ):
        name = gemma_path().name.removesuffix(".gguf")
        model = (await client.get(f"/v1/models/{name}")).json()
        sizing = model["sizing"]
        assert (model["max_input_tokens"], sizing["context"], sizing["context_wanted"]) == (32768,) * 3
        assert sizing["context_reason"] == "the model's trained context" and sizing["kv_cache_types"] == [
            "f16",
            "f16",
        ]
        assert sizing["kv_bytes_per_token"] > 0 and sizing["weights_bytes"]["host"] > 200_000_000
        assert sizing["free_bytes"]["host"] > 0 and sizing["layers_reason"] == "no GPU"
        assert model["sampling_defaults"]["temperature"] == 0.8  # gemma's GGUF has none: llama-server's
        assert model["status"] == {"value": "loaded"} and model["family"] == "generic"
        answer = await ask(client, name, **GREEDY)
        assert answer["model"] == name and answer["usage"]["output_tokens"] > 0
        # no template: ChatML, whose <|im_end|> the base model writes as text; the turn ends there
        ended = await ask(client, name, "Say hi", **{**GREEDY, "max_tokens": 40})
        assert ended["stop_reason"] == "end_turn" and ended["stop_sequence"] is None, ended
        assert "<|im" not in ended["content"][0]["text"] and ended["usage"]["output_tokens"] < 40, ended


async def test_a_gguf_sampling_temp_of_zero_makes_a_request_without_temperature_greedy(tmp_path):
    copy = with_metadata(smollm2_path(), tmp_path / "smollm2-greedy.gguf", general_sampling_temp=0.0)
    config = config_of(tmp_path).replace("model", path=str(copy))
    async with (
        running_server(config, engine_factory=LlamaLoader()) as state,
        httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client,
    ):
        model = (await client.get("/v1/models/smollm2-greedy")).json()
        assert model["sampling_defaults"]["temperature"] == 0.0
        plain = [
            (await ask(client, "smollm2-greedy", "Write a short poem."))["content"][0]["text"]
            for _ in range(3)
        ]
        greedy = (await ask(client, "smollm2-greedy", "Write a short poem.", **GREEDY))["content"][0]["text"]
        assert plain == [greedy] * 3
        hot = {
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": 7,
        }  # the request's own wins
        sampled = [
            (await ask(client, "smollm2-greedy", "Write a short poem.", **hot))["content"][0]["text"]
            for _ in range(2)
        ]
        assert greedy not in sampled  # (seeded; other cells of the pool change roundings)


async def test_two_real_models_side_by_side_on_demand_lru_idle_unload_and_a_broken_one(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    config = config_of(
        tmp_path,
        {
            "smol": {"path": str(smollm2_path()), "keep_alive": 1.0},
            "gemma": {"path": str(gemma_path()), "ctx_size": 4096},
            "broken": {"path": str(broken)},
        },
        router={"max_loaded": 1},
    )
    async with (
        running_server(config, engine_factory=LlamaLoader()) as state,
        httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client,
    ):
        assert await status(client) == {"smol": "unloaded", "gemma": "unloaded", "broken": "unloaded"}
        smol = await ask(client, "smol", **GREEDY)
        assert smol["model"] == "smol" and await status(client) == {
            "smol": "loaded",
            "gemma": "unloaded",
            "broken": "unloaded",
        }
        # gemma on the OpenAI surfaces: smol, idle, makes room (max_loaded = 1); (to "hello" or "Hi"
        # the base model writes ChatML's end of turn at once: an empty reply; "Say hello." it repeats)
        said = [{"role": "user", "content": "Say hello."}]
        chat = await client.post(
            "/v1/chat/completions",
            json={**OPENAI_BODY, "model": "gemma", "messages": said, "stream": True, "max_tokens": 8,
                  **GREEDY},
        )
        events = SSEParser().feed(chat.content)
        assert openai_text(events) and await status(client) == {
            "smol": "unloaded",
            "gemma": "loaded",
            "broken": "unloaded",
        }
        responses = await client.post(
            "/v1/responses", json={"model": "gemma", "input": "Say hello.", "max_output_tokens": 8, **GREEDY}
        )
        assert responses.json()["model"] == "gemma" and responses.json()["output"][0]["content"][0]["text"]
        # a broken file: a clear error, nothing else disturbed, and tried again on the next request
        refused = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "model": "broken"})
        assert (
            refused.status_code == 503
            and "the model 'broken' cannot be loaded" in refused.json()["error"]["message"]
        )
        assert (await status(client))["gemma"] == "loaded"
        assert (
            await client.post("/v1/messages", json={**ANTHROPIC_BODY, "model": "broken"})
        ).status_code == 503
        # smol again (gemma unloaded for it); then, idle for its keep_alive of 1 s, it unloads itself
        again = await ask(client, "smol", **GREEDY)
        assert again["content"] == smol["content"]  # the same greedy answer after a reload
        await wait_until(lambda: state.hub.models.find("smol").status is ModelStatus.UNLOADED, timeout=60)
        # a message of an unloaded model still reads back and resumes
        stored = (await client.get(f"/v1/messages/{smol['id']}")).json()
        assert stored["status"] == "complete" and stored["model"] == "smol"
        replay = await client.get(
            f"/v1/messages/{smol['id']}/stream", headers={"Last-Event-ID": f"{smol['id']}:0"}
        )
        assert anthropic_text(SSEParser().feed(replay.content)) == smol["content"][0]["text"]


async def test_loading_and_unloading_fifty_times_does_not_leak(tmp_path):
    """The process's resident memory after 50 loads and unloads of SmolLM2 is within 40 MiB of what
    it was after the first few (each load maps the 90 MB file and makes a context of 100 MB)."""
    config = config_of(tmp_path).replace(
        "model", path=str(smollm2_path()), ctx_size=2048, load_on_startup=False
    )
    catalog = discover(config)
    async with trio.open_nursery() as nursery:
        pool = ModelPool(catalog, LlamaLoader(), nursery, max_loaded=1)
        name = catalog.entries[0].name
        rss: list[int] = []
        for i in range(50):
            await pool.load(name)
            assert await pool.unload(name)
            if i in (4, 49):
                rss.append(rss_bytes(os.getpid()))
        nursery.cancel_scope.cancel()
    assert rss[1] - rss[0] < 40 * 1024 * 1024, rss


MIB = 1 << 20


def fake_gpu(free: int) -> Any:
    """A memory report of one GPU this machine lacks, with ``free`` bytes, and ample host memory."""
    return lambda: MemoryReport((GpuMemory("CUDA0 (Fake GPU)", free, 24 * GIB),), 16 * GIB)


async def test_a_fake_gpu_report_sizes_the_context_and_layers_and_the_json_and_log_say_so(tmp_path, caplog):
    """Issue 40's VRAM path on a machine without a GPU: the loader sizes gemma to a device report
    of one GPU (margin 0). With room for all, every layer and the trained context; with 48 MiB less
    than that, every layer and a context lowered to fit; with a fifth less than all needs, the
    fewest context (4,096) and fewer layers. The model then loads on the CPU (a CPU build offloads
    nothing) and its JSON and the ready line say what the report gave."""
    settings = Config().replace("model", path=str(gemma_path())).settings
    full = LlamaLoader(margin=0, memory=fake_gpu(24 * GIB)).front(settings).sizing
    assert full is not None and full.gpus == ("CUDA0 (Fake GPU)",)
    assert (full.n_ctx, full.reason, full.gpu_layers, full.layers_reason) == (
        32768, ContextReason.TRAINED, full.total_layers, LayersReason.ALL)
    lowered = LlamaLoader(margin=0, memory=fake_gpu(full.estimate.gpu - 48 * MIB)).front(settings).sizing
    assert lowered is not None and lowered.reason is ContextReason.MEMORY and lowered.n_ctx_wanted == 32768
    assert 4096 <= lowered.n_ctx < 32768 and lowered.gpu_layers == full.total_layers
    assert lowered.estimate.gpu <= full.estimate.gpu - 48 * MIB
    small = full.estimate.gpu * 4 // 5  # (its compute buffer, 512 x 262,144 logits, needs 0.54 GB of it)
    few = LlamaLoader(margin=0, memory=fake_gpu(small)).front(settings).sizing
    assert few is not None and few.layers_reason is LayersReason.MEMORY
    assert 0 < few.gpu_layers < full.total_layers
    assert few.n_ctx == 4096 and few.estimate.gpu <= small

    caplog.set_level("INFO", logger="ringserve")
    config = config_of(tmp_path).replace("model", path=str(gemma_path()))
    loader = LlamaLoader(margin=0, memory=fake_gpu(full.estimate.gpu - 48 * MIB))
    async with (
        running_server(config, engine_factory=loader) as state,
        httpx.AsyncClient(base_url=state.urls[0], timeout=60) as client,
    ):
        sizing = (await client.get(f"/v1/models/{gemma_path().name.removesuffix('.gguf')}")).json()["sizing"]
        assert (sizing["context"], sizing["context_reason"], sizing["gpus"]) == (
            lowered.n_ctx, "lowered to fit memory", ["CUDA0 (Fake GPU)"])
        assert sizing["gpu_layers"] == sizing["total_layers"] and sizing["layers_reason"] == "all"
        assert sizing["free_bytes"]["gpu"] == full.estimate.gpu - 48 * MIB
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert len(ready) == 1
    assert f"context {lowered.n_ctx} tokens (lowered from 32768 to fit memory)" in ready[0], ready[0]
    assert f"{full.total_layers} of {full.total_layers} layers on GPU (all)" in ready[0], ready[0]
