"""The server's own routes: the models (``GET /v1/models``, ``POST /models/load`` and ``/unload``),
the playground, health, readiness and metrics."""

from __future__ import annotations

import json

import trio
from quart import Response, current_app

from ringserve.core import health as core_health
from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.router import ModelStatus
from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling
from ringserve.formats.base import TOOLS_PROMPT_FAMILIES
from ringserve.http import context
from ringserve.http.context import answering_errors, json_response
from ringserve.live.hub import Hub
from ringserve.live.models import ModelState
from ringserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ringserve.surfaces import ringserve as ringserve_json
from ringserve.surfaces.ringserve import ModelInfo


def _info(model: ModelState, started: float, now: float) -> ModelInfo:
    """``model`` as ``GET /v1/models`` lists it (its front and runner say what is known of it)."""
    front, runner, resident = model.front, model.runner, model.resident
    stats = None if runner is None else runner.statistics()
    tokenizer = None if front is None else front.tokenizer
    return ModelInfo(
        id=model.name,
        started=started,
        status=model.status,
        aliases=model.entry.settings.model.aliases,
        context_window=None if front is None else front.context_window,
        progress=model.progress if model.status is ModelStatus.LOADING else None,
        error=None if model.error is None or model.status is not ModelStatus.FAILED else model.error.message,
        memory_bytes=front.memory if front is not None and front.memory > 0 else None,
        slots=None if stats is None else stats.slots_total,
        busy_slots=None if stats is None else stats.slots_busy,
        idle_seconds=max(0.0, now - resident.released_at) if resident.idle else None,
        family=None if tokenizer is None else tokenizer.chat_format.name,
        tools=None if tokenizer is None else tokenizer.chat_format.name not in TOOLS_PROMPT_FAMILIES,
        reasoning=None if tokenizer is None else tokenizer.chat_format.reasoning is not None,
        sizing=None if front is None else front.sizing,
        sampling=None if front is None else resolve_sampling(*front.sampling_defaults, LLAMA_SERVER_DEFAULTS),
    )


@answering_errors
async def models() -> Response:
    """``GET /v1/models`` (and llama-server's ``GET /models``): every model of the catalog, loaded
    or not, with its status, in the shape of the SDK that asks (Anthropic's for a request with
    ``anthropic-version``, else OpenAI's)."""
    state = context.state()
    listed = [_info(m, state.started, trio.current_time()) for m in context.hub().models.models()]
    return json_response(ringserve_json.models_json(listed, context.request_surface().name))


@answering_errors
async def model(model_id: str) -> Response:
    """``GET /v1/models/{id}``: the model ``id`` names (a name, an alias, a pattern; with no
    ``strict_model_name``, any name reaches the default model)."""
    state = context.state()
    found = context.hub().models.find(model_id)
    return json_response(ringserve_json.model_json(_info(found, state.started, trio.current_time()),
                                                   context.request_surface().name))


async def _model_named() -> str:
    """The ``model`` of a ``/models/load`` or ``/models/unload`` body (llama-server's router's).

    Raises:
        RingserveError: ``INVALID_REQUEST``: no JSON object with a ``model`` string.
    """
    try:
        body = json.loads(await context.body())
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid('the body must be a JSON object with a "model" name', param="model")
    return str(body["model"])


@answering_errors
async def load_model() -> Response:
    """``POST /models/load`` (llama-server's router): load the model the body names, answering once
    it is loaded.

    Raises (answered in the error shape of the request's surface):
        RingserveError: ``INVALID_REQUEST`` (no name, or it is loaded already), ``NOT_FOUND`` (a
            name that reaches no model but through the default: llama-server's exact names),
            ``UNAVAILABLE`` (it cannot be loaded: the message says why).
    """
    pool = context.hub().models
    found = pool.find(await _model_named(), fallback=False)  # (a typo must not load the default model)
    if found.status is ModelStatus.LOADED:
        raise invalid(f"the model {found.name!r} is loaded already", param="model")
    await pool.load(found.name)
    return json_response(ringserve_json.model_action_json())


@answering_errors
async def unload_model() -> Response:
    """``POST /models/unload`` (llama-server's router): unload the model the body names, once
    nothing runs on it (answering at once when nothing does).

    Raises (answered in the error shape of the request's surface):
        RingserveError: ``INVALID_REQUEST`` (no name, or it is not loaded), ``NOT_FOUND`` (as
            for ``/models/load``),
            ``CONFLICT`` (requests are running on it: it stays).
    """
    pool = context.hub().models
    found = pool.find(await _model_named(), fallback=False)  # (nor unload it)
    if found.status is not ModelStatus.LOADED:
        raise invalid(f"the model {found.name!r} is not loaded", param="model")
    if not await pool.unload(found.name):
        raise RingserveError(ErrorKind.CONFLICT, f"the model {found.name!r} has requests running; it stays")
    return json_response(ringserve_json.model_action_json())


async def playground() -> Response:
    """The playground page (``ringserve/static/``; Quart serves ``/static/app.js`` from there)."""
    return await current_app.send_static_file("index.html")


async def health() -> Response:
    """503 while the model loads, 200 after (also while draining: the process is alive).

    For an orchestrator's liveness probe give it a start-up delay or a
    startup probe covering the model load; use ``/ready`` for traffic.
    """
    state = context.state()
    hub = state.hub
    status = core_health.health(loaded=hub is not None, draining=hub is not None and hub.draining)
    body = ringserve_json.health_json(status, *_names(hub))
    return json_response(body, 503 if status is core_health.Health.LOADING else 200)


def _names(hub: Hub | None) -> tuple[str | None, list[str]]:
    """The default model's name (None: none, or not up yet) and the loaded models' names."""
    if hub is None:
        return None, []
    default = hub.models.catalog.resolve("")
    loaded = [m.name for m in hub.models.models() if m.status is ModelStatus.LOADED]
    return None if default is None else default.name, loaded


async def ready() -> Response:
    """Readiness: 200 once the model is loaded and the decode loop runs; 503 before, while
    draining, and while the Redis log backend cannot reach Redis."""
    state = context.state()
    hub = state.hub
    status = core_health.readiness(
        loaded=hub is not None,
        draining=hub is not None and hub.draining,
        running=hub is not None and all(m.runner.running for m in hub.models.models() if m.runner),
        store_available=hub is not None and hub.logs.available,
    )
    ready = status is core_health.Readiness.READY
    return json_response(ringserve_json.ready_json(status, *_names(hub)), 200 if ready else 503)


async def metrics() -> Response:
    """Prometheus text format (open, like /health: firewall it if it must stay private)."""
    return Response(context.state().metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)
