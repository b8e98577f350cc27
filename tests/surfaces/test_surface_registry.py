"""The surface lookups (surfaces/registry.py), ringserve's own JSON (surfaces/ringserve.py) and
the health values (core/health.py), driven by plain values."""

from __future__ import annotations

import json

import anthropic
import attrs
import openai
import pytest

from ringserve.core.view import MessageView
from ringserve.core.events import BlockKind, ContentBlock, SamplingParams, StopReason, Usage
from ringserve.core.health import Health, Readiness, health, readiness
from ringserve.core.router import ModelStatus
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling
from ringserve.core.status import MessageStatus
from ringserve.surfaces import ringserve as wire
from ringserve.surfaces.registry import ANTHROPIC, OPENAI, SURFACES, Surfaces
from ringserve.surfaces.responses import RESPONSES


@attrs.frozen
class Third:
    """Just enough of one more surface (the lookups read only ``name`` and ``id_prefix``)."""

    name: str = "batches"
    id_prefix: str = "batch_"


def with_third() -> tuple[Surfaces, Third]:
    third = Third()
    surfaces = Surfaces(
        surfaces=(*SURFACES.surfaces, third),  # type: ignore[arg-type]  # Third is not a whole Surface
        routes={**SURFACES.routes, "/v1/batches": third},
        paths={**SURFACES.paths, "/v1/batches": third},
        headers=SURFACES.headers,
        default=SURFACES.default,
    )
    return surfaces, third


def test_a_message_id_names_its_surface_by_prefix() -> None:
    assert SURFACES.for_message("msg_0123") is ANTHROPIC
    assert SURFACES.for_message("chatcmpl-0123") is OPENAI
    assert SURFACES.for_message("resp_0123") is RESPONSES
    assert SURFACES.for_message("batch_0123") is None
    assert SURFACES.by_name("openai") is OPENAI and SURFACES.by_name("responses") is RESPONSES
    with pytest.raises(KeyError):
        SURFACES.by_name("batches")
    assert SURFACES.for_request("/v1/messages/resp_1", set(), "resp_1") is RESPONSES
    assert SURFACES.for_request("/v1/responses/nope/cancel", {"anthropic-version"}) is RESPONSES


def test_a_request_is_answered_in_the_shape_its_message_path_or_sdk_header_names() -> None:
    assert SURFACES.for_request("/v1/messages/chatcmpl-1", set(), "chatcmpl-1") is OPENAI
    assert SURFACES.for_request("/v1/messages/nope", set(), "nope") is ANTHROPIC  # unknown prefix: by path
    assert SURFACES.for_request("/v1/messages", set()) is ANTHROPIC
    assert SURFACES.for_request("/v1/models", {"anthropic-version"}) is ANTHROPIC
    assert SURFACES.for_request("/v1/models", {"x-stainless-lang"}) is OPENAI
    assert SURFACES.for_request("/v1/chat/completions", set()) is OPENAI
    assert SURFACES.for_request("/health", set()) is OPENAI


def test_a_third_surface_is_one_more_entry() -> None:
    surfaces, third = with_third()
    assert surfaces.for_message("batch_1") is third
    assert surfaces.for_request("/v1/messages/batch_1", set(), "batch_1") is third
    assert surfaces.for_request("/v1/batches/x/y", {"anthropic-version"}) is third
    assert surfaces.for_request("/v1/messages", set()) is ANTHROPIC
    assert surfaces.routes["/v1/batches"] is third


def test_the_longest_path_prefix_wins() -> None:
    surfaces = attrs.evolve(SURFACES, paths={"/v1": OPENAI, "/v1/messages": ANTHROPIC})
    assert surfaces.for_request("/v1/messages/x", set()) is ANTHROPIC
    assert surfaces.for_request("/v1/models", set()) is OPENAI


def test_ids_and_names_must_not_overlap() -> None:
    with pytest.raises(ValueError, match="starts"):
        attrs.evolve(SURFACES, surfaces=(ANTHROPIC, Third(name="m", id_prefix="msg_x")))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeat"):
        attrs.evolve(SURFACES, surfaces=(ANTHROPIC, Third(name="anthropic", id_prefix="a_")))  # type: ignore[arg-type]


# -- ringserve's own JSON ---------------------------------------------------------------------


def test_message_status_json_spells_content_and_stop_reason_in_the_message_surface() -> None:
    blocks = (ContentBlock(BlockKind.TEXT, "h"), ContentBlock(BlockKind.TEXT, "i"))
    view = MessageView("chatcmpl-1", "openai", "m", 17, MessageStatus.COMPLETE, blocks, StopReason.MAX_TOKENS,
                       None, Usage(3, 2), None)
    assert wire.message_status_json(view, OPENAI) == {
        "id": "chatcmpl-1", "object": "ringserve.message", "surface": "openai", "model": "m", "created": 17,
        "status": "complete", "text": "hi", "content": {"role": "assistant", "content": "hi", "refusal": None},
        "stop_reason": "length", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2, "reasoning_tokens": 0},
        "error": None, "waiting": None, "stream_url": "/v1/messages/chatcmpl-1/stream",
    }
    queued = attrs.evolve(view, surface="anthropic", status=MessageStatus.QUEUED, stop_reason=None)
    body = wire.message_status_json(queued, ANTHROPIC)
    assert body["stop_reason"] is None
    assert body["content"] == [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]


def test_the_202_body_and_the_stream_token_body() -> None:
    token = wire.StreamToken("msg_1", "99.abc", 99)
    link = {"stream_token": "99.abc", "stream_token_expires_at": 99,
            "stream_url": "/v1/messages/msg_1/stream?stream_token=99.abc"}
    assert wire.stream_token_json(token) == {"id": "msg_1", **link}
    assert wire.accepted_json(MessageStatus.QUEUED, token) == {
        "id": "msg_1", "status": "queued", "url": "/v1/messages/msg_1", **link}


def test_models_in_the_shape_of_the_sdk_that_asks() -> None:
    sampling = resolve_sampling(SamplingParams(temperature=0.0), LLAMA_SERVER_DEFAULTS)
    model = wire.ModelInfo("tiny", 86400.5, ModelStatus.LOADED, ("tiny-*",), 4096, memory_bytes=180_000_000,
                           slots=4, busy_slots=1, idle_seconds=None, family="chatml", tools=True, reasoning=False,
                           sampling=sampling)
    ours = {"status": {"value": "loaded"}, "aliases": ["tiny-*"], "context_window": 4096, "memory_bytes": 180_000_000,
            "slots": 4, "busy_slots": 1, "family": "chatml",
            "supports": {"tools": True, "reasoning": False}, "sampling_defaults": wire.sampling_json(sampling)}
    assert ours["sampling_defaults"]["temperature"] == 0.0 and ours["sampling_defaults"]["top_k"] == 40
    anthropic_one = {"type": "model", "id": "tiny", "display_name": "tiny", "created_at": "1970-01-02T00:00:00Z",
                     "lifecycle": "active", "max_input_tokens": 4096, "max_tokens": 4096, **ours}
    assert wire.model_json(model, "anthropic") == anthropic_one
    assert wire.models_json([model], "anthropic") == {"data": [anthropic_one], "has_more": False,
                                                    "first_id": "tiny", "last_id": "tiny"}
    openai_one = {"id": "tiny", "object": "model", "created": 86400, "owned_by": "ringserve", "max_input_tokens": 4096,
                  **ours}
    for surface in ("openai", "responses"):
        assert wire.model_json(model, surface) == openai_one
        assert wire.models_json([model], surface) == {"object": "list", "data": [openai_one]}
    # the SDKs' own types read them, strictly
    anthropic.types.ModelInfo.model_validate_json(json.dumps(anthropic_one), strict=True)
    anthropic.types.beta.BetaModelInfo.model_validate_json(json.dumps(anthropic_one), strict=True)
    openai.types.Model.model_validate_json(json.dumps(openai_one), strict=True)
    assert {s.name for s in SURFACES.surfaces} == set(wire._MODEL_SHAPES)
    loading = wire.model_json(wire.ModelInfo("big", 0.0, ModelStatus.LOADING, progress=0.25), "openai")
    assert "max_input_tokens" not in loading and loading["status"] == {"value": "loading", "progress": 0.25}
    assert "memory_bytes" not in loading  # not known
    failed = wire.model_json(wire.ModelInfo("bad", 0.0, ModelStatus.FAILED, error="no such file"), "anthropic")
    assert failed["status"] == {"value": "failed", "failed": True, "error": "no such file"}
    anthropic.types.ModelInfo.model_validate_json(json.dumps({**failed, "max_input_tokens": None, "max_tokens": None}))


def test_health_and_readiness() -> None:
    assert health(loaded=False, draining=False) is Health.LOADING
    assert health(loaded=True, draining=True) is Health.DRAINING
    assert health(loaded=True, draining=False) is Health.OK
    up = dict(loaded=True, draining=False, running=True, store_available=True)
    assert readiness(**up) is Readiness.READY
    assert readiness(**{**up, "store_available": False}) is Readiness.STORE_UNAVAILABLE
    assert readiness(**{**up, "running": False, "store_available": False}) is Readiness.STOPPED
    assert readiness(**{**up, "draining": True, "running": False}) is Readiness.DRAINING
    assert readiness(**{**up, "loaded": False, "draining": True}) is Readiness.LOADING
    assert wire.health_json(Health.LOADING, None, ()) == {"status": "loading", "model": None, "models": []}
    assert wire.ready_json(Readiness.READY, "tiny", ["tiny", "big"]) == {
        "status": "ready", "model": "tiny", "models": ["tiny", "big"]}
    assert wire.ready_json(Readiness.STORE_UNAVAILABLE, "tiny", ["tiny"]) == {"status": "log store unavailable"}
