"""The server's own routes: the served model, the playground, health, readiness and metrics."""

from __future__ import annotations

from quart import Response, current_app

from ringserve.core import health as core_health
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.http import context
from ringserve.http.context import answering_errors, json_response
from ringserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ringserve.surfaces import ringserve as ringserve_json
from ringserve.surfaces.ringserve import ModelInfo


def _served_model() -> ModelInfo:
    """The served model (``UNAVAILABLE`` while it loads, without ``Retry-After``)."""
    state = context.state()
    if state.hub is None:
        raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading")
    return ModelInfo(state.model_id, state.started, state.hub.runner.context_window)


@answering_errors
async def models() -> Response:
    """``GET /v1/models``: the one served model, in the shape of the SDK that asks (Anthropic's
    for a request with ``anthropic-version``, else OpenAI's)."""
    return json_response(ringserve_json.models_json(_served_model(), context.request_surface().name))


@answering_errors
async def model(model_id: str) -> Response:
    """The served model under its own id (and, unless names are strict, under any id)."""
    served = _served_model()
    if model_id != served.id and context.state().config.model.strict_model_name:
        raise RingserveError(ErrorKind.NOT_FOUND, f"no model {model_id[:100]!r}")
    return json_response(ringserve_json.model_json(served, context.request_surface().name))


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
    body = ringserve_json.health_json(status, None if hub is None else state.model_id)
    return json_response(body, 503 if status is core_health.Health.LOADING else 200)


async def ready() -> Response:
    """Readiness: 200 once the model is loaded and the decode loop runs; 503 before, while
    draining, and while the Redis log backend cannot reach Redis."""
    state = context.state()
    hub = state.hub
    status = core_health.readiness(
        loaded=hub is not None,
        draining=hub is not None and hub.draining,
        running=hub is not None and hub.runner.running,
        store_available=hub is not None and hub.logs.available,
    )
    ready = status is core_health.Readiness.READY
    return json_response(ringserve_json.ready_json(status, state.model_id), 200 if ready else 503)


async def metrics() -> Response:
    """Prometheus text format (open, like /health: firewall it if it must stay private)."""
    return Response(context.state().metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)
