"""ringserve's own wire shapes: message status, stream tokens, the 202 body, models, health.

These are the JSON bodies that belong to no SDK's surface (``GET
/v1/messages/{id}``, ``POST .../stream_token``, ``Prefer: respond-async``,
``/health``, ``/ready``), and ``/v1/models``, in the shape of the SDK that asks
(Anthropic ``ModelInfo``/``SyncPage`` for a request with ``anthropic-version``, else
OpenAI ``Model``/``SyncPage``). docs/api.md documents them. Values come
in as plain values; this module only spells them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ringserve.core.health import Health, Readiness
from ringserve.core.router import ModelStatus
from ringserve.core.sampling import ResolvedSampling
from ringserve.core.sizing import Sizing
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView, Waiting
from ringserve.surfaces.base import Surface

#: The ``object`` of a message status body.
MESSAGE_OBJECT = "ringserve.message"
#: The ``object`` of a render route's answer (:func:`prompt_json`).
PROMPT_OBJECT = "ringserve.prompt"


def message_url(message_id: str) -> str:
    """Where a message's status is read (``GET``); the ``Location`` of a 202."""
    return f"/v1/messages/{message_id}"


def stream_url(message_id: str) -> str:
    """Where a message's event stream is read or resumed (``GET``, ``Last-Event-ID``)."""
    return f"{message_url(message_id)}/stream"


def message_status_json(view: MessageView, surface: Surface) -> dict[str, Any]:
    """``GET /v1/messages/{id}`` (and the cancel answer): status, the text and content blocks so far
    (``content`` in the shape of ``surface``, the one that made the message, restored with its
    echo and signer: its reasoning blocks too), stop reason, usage (``reasoning_tokens``: the
    output tokens of its reasoning), and while it is queued what it waits for (:func:`waiting_json`)."""
    return {
        "id": view.id,
        "object": MESSAGE_OBJECT,
        "surface": surface.name,
        "model": view.model,
        "created": view.created,
        "status": view.status.value,
        "text": view.text,
        "content": surface.content_json(view.content),
        "stop_reason": None if view.stop_reason is None else surface.stop_reason(view.stop_reason),
        "stop_sequence": view.stop_sequence,
        "usage": {"input_tokens": view.usage.input_tokens, "output_tokens": view.usage.output_tokens,
                  "reasoning_tokens": view.usage.reasoning_tokens},
        "error": view.error,
        "waiting": None if view.waiting is None else waiting_json(view.waiting),
        "stream_url": stream_url(view.id),
    }


def waiting_json(waiting: Waiting) -> dict[str, Any]:
    """What a queued message waits for: ``{"reason": "model_loading", "progress": 0.4}``,
    ``{"reason": "queued", "ahead": 2}`` (requests admitted before it) or ``{"reason": "prefill"}``."""
    return {"reason": waiting.reason.value} | {key: value for key, value in (
        ("ahead", waiting.ahead), ("progress", waiting.progress)) if value is not None}


def prompt_json(text: str, tokens: int, reasoning_open: bool) -> dict[str, Any]:
    """The answer of a render route (``POST /v1/messages/render``, ``/v1/chat/completions/render``,
    ``/v1/responses/render``): the prompt a generation request would be given, as the model's chat
    template renders it (special tokens as text; llama-server's ``POST /apply-template`` gives the
    same ``prompt``), its length in tokens (the generation's ``input_tokens``), and whether it
    opens the model's thinking block (the reply then starts inside it)."""
    return {"object": PROMPT_OBJECT, "prompt": text, "input_tokens": tokens, "reasoning_open": reasoning_open}


@attrs.frozen
class StreamToken:
    """A token that reads one message's stream (``auth.Authenticator.issue``); ``expires`` in
    whole Unix seconds."""

    message_id: str
    token: str
    expires: int


def _token_fields(token: StreamToken) -> dict[str, Any]:
    return {
        "stream_token": token.token,
        "stream_token_expires_at": token.expires,
        "stream_url": f"{stream_url(token.message_id)}?stream_token={token.token}",
    }


def stream_token_json(token: StreamToken) -> dict[str, Any]:
    """``POST /v1/messages/{id}/stream_token``: the token, its expiry and the URL that uses it."""
    return {"id": token.message_id, **_token_fields(token)}


def accepted_json(status: MessageStatus, token: StreamToken) -> dict[str, Any]:
    """The 202 body of a ``Prefer: respond-async`` request: where to read the message, and a
    stream token for it."""
    return {"id": token.message_id, "status": status.value, "url": message_url(token.message_id),
            **_token_fields(token)}


@attrs.frozen
class ModelInfo:
    """A model of the catalog as ``GET /v1/models`` lists it.

    Attributes:
        id: its name.
        started: when the server started (Unix seconds: the models' ``created``).
        status: where it is (``core/router.py``).
        aliases: other names and patterns that reach it.
        context_window: the most tokens one request may hold, prompt and reply (None before
            it was sized: it loads on its first request).
        progress: the share of its weights loaded, while it loads.
        error: why its last load failed.
        memory_bytes: the bytes its engine takes where it loads, or will take: the estimate it was
            sized with (``engine/loader.py`` ``Front.memory``; None: not known, or no front yet).
        slots: requests it decodes together; busy_slots: of those, holding a request now.
        idle_seconds: since its last request ended, while it is loaded and nobody holds it.
        family: its chat format (``ringserve/formats``), once known.
        tools: whether its chat template has a tool-call syntax of its own (else ringserve's generic
            one carries its calls); reasoning: whether its format has a thinking block.
        sizing: what its context and GPU layers were sized to and why (where it was sized).
        sampling: the sampler settings a request gets for what it does not send.
    """

    id: str
    started: float
    status: ModelStatus = ModelStatus.LOADED
    aliases: tuple[str, ...] = ()
    context_window: int | None = None
    progress: float | None = None
    error: str | None = None
    memory_bytes: int | None = None
    slots: int | None = None
    busy_slots: int | None = None
    idle_seconds: float | None = None
    family: str | None = None
    tools: bool | None = None
    reasoning: bool | None = None
    sizing: Sizing | None = None
    sampling: ResolvedSampling | None = None


def sizing_json(sizing: Sizing) -> dict[str, Any]:
    """What the context and the GPU layers were sized to, and why (``core/sizing.py``; bytes)."""
    e = sizing.estimate
    return {
        "context": sizing.n_ctx, "context_reason": sizing.reason.value, "context_wanted": sizing.n_ctx_wanted,
        "kv_cache_types": [sizing.type_k.value, sizing.type_v.value],
        "kv_bytes_per_token": sizing.kv_bytes_per_token, "kv_bytes": e.kv,
        "weights_bytes": {"gpu": e.weights_gpu, "host": e.weights_host},
        "compute_bytes": {"gpu": e.compute_gpu, "host": e.compute_host},
        "gpu_layers": sizing.gpu_layers, "total_layers": sizing.total_layers,
        "layers_reason": sizing.layers_reason.value,
        "free_bytes": {"gpu": sizing.gpu_free, "host": sizing.host_free}, "margin_bytes": sizing.margin,
        "gpus": list(sizing.gpus),
    }


def sampling_json(sampling: ResolvedSampling) -> dict[str, Any]:
    """The sampler settings a request gets for what it does not send (the model's defaults, in
    llama-server's request names)."""
    values = attrs.asdict(sampling, recurse=False)
    values["dry_sequence_breakers"] = list(sampling.dry_sequence_breakers)
    values["logit_bias"] = [[bias.token, bias.bias] for bias in sampling.logit_bias]
    return values


def _ringserve_fields(model: ModelInfo) -> dict[str, Any]:
    """What ringserve says of a model beyond an SDK's type (extra fields, which the SDKs keep):
    its ``status`` in llama-server's router's shape (``{"value": "loaded"}``, with the load's
    ``progress`` and a failure's ``failed`` and ``error``), aliases, what it ``supports`` (not
    ``capabilities``: Anthropic's ``ModelInfo`` types that name, with every key required) and its load."""
    status: dict[str, Any] = {"value": model.status.value}
    if model.progress is not None:
        status["progress"] = model.progress
    if model.error is not None:
        status |= {"failed": True, "error": model.error}
    extra: dict[str, Any] = {"status": status, "aliases": list(model.aliases)}
    optional = {"context_window": model.context_window, "memory_bytes": model.memory_bytes,
                "slots": model.slots, "busy_slots": model.busy_slots, "idle_seconds": model.idle_seconds,
                "family": model.family}
    extra |= {key: value for key, value in optional.items() if value is not None}
    if model.tools is not None and model.reasoning is not None:
        extra["supports"] = {"tools": model.tools, "reasoning": model.reasoning}
    if model.sizing is not None:
        extra["sizing"] = sizing_json(model.sizing)
    if model.sampling is not None:
        extra["sampling_defaults"] = sampling_json(model.sampling)
    return extra


def _openai_model(model: ModelInfo) -> dict[str, Any]:
    """OpenAI's ``Model``, with the context window as ``max_input_tokens`` (Anthropic's name for
    it, "Maximum input context window size in tokens", ``anthropic/types/model_info.py``), an
    extra field of OpenAI's type, which ``ringserve launch`` reads; and
    :func:`_ringserve_fields`."""
    window = {} if model.context_window is None else {"max_input_tokens": model.context_window}
    return {"id": model.id, "object": "model", "created": int(model.started), "owned_by": "ringserve",
            **window, **_ringserve_fields(model)}


def _anthropic_model(model: ModelInfo) -> dict[str, Any]:
    """Anthropic's ``ModelInfo`` (anthropic 2.16: ``lifecycle`` is required); the context window
    bounds the prompt (``max_input_tokens``) and the reply (``max_tokens``); and :func:`_ringserve_fields`."""
    window = {} if model.context_window is None else {"max_input_tokens": model.context_window,
                                                      "max_tokens": model.context_window}
    return {
        "type": "model",
        "id": model.id,
        "display_name": model.id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(model.started)),
        "lifecycle": "active",
        **window,
        **_ringserve_fields(model),
    }


def _anthropic_page(models: Sequence[ModelInfo]) -> dict[str, Any]:
    """Anthropic's ``SyncPage[ModelInfo]``."""
    return {"data": [_anthropic_model(m) for m in models], "has_more": False,
            "first_id": models[0].id if models else None, "last_id": models[-1].id if models else None}


def _openai_page(models: Sequence[ModelInfo]) -> dict[str, Any]:
    """OpenAI's ``SyncPage[Model]``."""
    return {"object": "list", "data": [_openai_model(m) for m in models]}


#: The surface whose request it is (``Surfaces.for_request``: Anthropic's by its
#: ``anthropic-version`` header) → the shapes of a model and of the models page its SDK reads.
_MODEL_SHAPES: dict[str, tuple[Callable[[ModelInfo], dict[str, Any]],
                               Callable[[Sequence[ModelInfo]], dict[str, Any]]]] = {
    "anthropic": (_anthropic_model, _anthropic_page),
    "openai": (_openai_model, _openai_page),
    "responses": (_openai_model, _openai_page),
}


def model_json(model: ModelInfo, surface: str) -> dict[str, Any]:
    """``GET /v1/models/{id}``: a model as the SDK of ``surface`` (its name) reads it."""
    return _MODEL_SHAPES[surface][0](model)


def models_json(models: Sequence[ModelInfo], surface: str) -> dict[str, Any]:
    """``GET /v1/models``: every model of the catalog as the SDK of ``surface`` reads a page of
    them: Anthropic's (``data``, ``has_more``, ``first_id``, ``last_id``) or OpenAI's
    (``object: "list"``, ``data``)."""
    return _MODEL_SHAPES[surface][1](models)


def model_action_json() -> dict[str, Any]:
    """``POST /models/load`` and ``/models/unload``: llama-server's router's answer."""
    return {"success": True}


def health_json(health: Health, default: str | None, loaded: Sequence[str]) -> dict[str, Any]:
    """``GET /health``: the liveness status, the default model (None: none, or still loading)
    and the loaded models."""
    return {"status": health.value, "model": default, "models": list(loaded)}


def ready_json(readiness: Readiness, default: str | None, loaded: Sequence[str]) -> dict[str, Any]:
    """``GET /ready``: the readiness status, with the default model and the loaded ones once ready."""
    if readiness is Readiness.READY:
        return {"status": readiness.value, "model": default, "models": list(loaded)}
    return {"status": readiness.value}
