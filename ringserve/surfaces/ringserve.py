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
from typing import Any

import attrs

from ringserve.core.health import Health, Readiness
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView
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
    output tokens of its reasoning)."""
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
        "stream_url": stream_url(view.id),
    }


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
    """The served model: its id, when the server started (Unix seconds), and its context window
    (tokens of KV cache per slot, the prompt and the reply together)."""

    id: str
    started: float
    context_window: int


def _openai_model(model: ModelInfo) -> dict[str, Any]:
    """OpenAI's ``Model``, with the context window as ``max_input_tokens`` (Anthropic's name for
    it, "Maximum input context window size in tokens", ``anthropic/types/model_info.py``), an
    extra field of OpenAI's type, which ``ringserve launch`` reads."""
    return {"id": model.id, "object": "model", "created": int(model.started), "owned_by": "ringserve",
            "max_input_tokens": model.context_window}


def _anthropic_model(model: ModelInfo) -> dict[str, Any]:
    """Anthropic's ``ModelInfo`` (anthropic 2.16: ``lifecycle`` is required); the context window
    bounds the prompt (``max_input_tokens``) and the reply (``max_tokens``)."""
    return {
        "type": "model",
        "id": model.id,
        "display_name": model.id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(model.started)),
        "lifecycle": "active",
        "max_input_tokens": model.context_window,
        "max_tokens": model.context_window,
    }


def _anthropic_page(model: ModelInfo) -> dict[str, Any]:
    """Anthropic's ``SyncPage[ModelInfo]``."""
    return {"data": [_anthropic_model(model)], "has_more": False, "first_id": model.id, "last_id": model.id}


def _openai_page(model: ModelInfo) -> dict[str, Any]:
    """OpenAI's ``SyncPage[Model]``."""
    return {"object": "list", "data": [_openai_model(model)]}


#: The surface whose request it is (``Surfaces.for_request``: Anthropic's by its
#: ``anthropic-version`` header) → the shapes of the served model and of the models page its SDK reads.
_MODEL_SHAPES = {
    "anthropic": (_anthropic_model, _anthropic_page),
    "openai": (_openai_model, _openai_page),
    "responses": (_openai_model, _openai_page),
}


def model_json(model: ModelInfo, surface: str) -> dict[str, Any]:
    """``GET /v1/models/{id}``: the served model as the SDK of ``surface`` (its name) reads it."""
    return _MODEL_SHAPES[surface][0](model)


def models_json(model: ModelInfo, surface: str) -> dict[str, Any]:
    """``GET /v1/models``: a one-model page as the SDK of ``surface`` reads it: Anthropic's
    (``data``, ``has_more``, ``first_id``, ``last_id``) or OpenAI's (``object: "list"``, ``data``)."""
    return _MODEL_SHAPES[surface][1](model)


def health_json(health: Health, model_id: str | None) -> dict[str, Any]:
    """``GET /health``: the liveness status and the served model (None while loading)."""
    return {"status": health.value, "model": model_id}


def ready_json(readiness: Readiness, model_id: str) -> dict[str, Any]:
    """``GET /ready``: the readiness status, with the served model once ready."""
    if readiness is Readiness.READY:
        return {"status": readiness.value, "model": model_id}
    return {"status": readiness.value}
