"""The HTTP shell: quart-trio routes over the hub, the runner and the surfaces.

Handlers only map decisions to responses: what a generation request gets is
decided by ``http/decide.py`` (plain functions of values), the hub and
``engine/runner.py`` hold the rest of the policy, and every JSON body is
spelled under ``surfaces/`` (ringserve's own in ``surfaces/ringserve.py``); the
surface of a request is looked up once (``surfaces/registry.py``). The handlers
are module functions that read the server's state from ``current_app``;
:func:`create_app` only registers them (:data:`ROUTES`, ``SURFACES.routes``). Errors found before the first byte are answered with an
HTTP status and the surface's own error JSON; once a stream has started, errors
are in-band events written by the producer.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, assert_never, cast

import attrs
import trio
from quart import Response, current_app, request
from quart.routing import QuartMap
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from ringserve.http.accesslog import SCOPE_KEY as _ACCESS
from ringserve.http.accesslog import AccessRecord
from ringserve.http.auth import Authenticator
from ringserve.config import Config
from ringserve.http.transport import SendWatchdog
from ringserve.core import health as core_health
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.limits import ReaderGate
from ringserve.core.view import MessageView
from ringserve.store.sqlite import store_failed
from ringserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ringserve.metrics import Metrics
from ringserve.http.responses import RouteKit, register_responses
from ringserve.http.decide import (
    RESPOND_ASYNC,
    Accepted,
    Answer,
    Decision,
    ReplayStored,
    RequestHeaders,
    Refuse,
    StreamLive,
    WaitLive,
    WaitStored,
    admit,
    answer,
    finished,
    parse_body,
)
from ringserve.live.hub import Hub, LiveMessage, StreamEnded
from ringserve.logs.memory import MessageLog, store_unavailable
from ringserve.logs.reader import ReaderLagged
from ringserve.surfaces import ringserve as ringserve_json
from ringserve.surfaces.base import Surface, dumps
from ringserve.surfaces.registry import ANTHROPIC, SURFACES
from ringserve.surfaces.ringserve import ModelInfo, StreamToken, message_url

log = logging.getLogger("ringserve")

#: Response headers of every event stream (C9): no proxy buffering, no caching.
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_CLEANUPS = "ringserve.cleanups"
_SURFACE = "ringserve.surface"  # the request's surface, once looked up (request_surface)


class ClosingHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection with an access record, a send watchdog and two fixes.

    Every request gets an :class:`AccessRecord` (one log line at the end) and
    an ``X-Request-Id``; every send is timed by the :class:`SendWatchdog`.

    Cleanups: a handler that registers a stream reader adds its release to
    ``request.scope["ringserve.cleanups"]``; it runs when the ASGI call
    returns, even if the client left before Quart started the response body
    (an async generator that never started would never run its ``finally``).

    The final send is shielded: hypercorn finishes a response inside the
    app's ``send`` call — closing the socket for ``Connection: close`` and
    HTTP/1.0, or re-arming the keep-alive idle timer — and that chain first
    posts ``http.disconnect`` to the app, on which quart-trio cancels the
    request's nursery, i.e. the very task running the chain. Unshielded, the
    socket is never closed and the keep-alive timeout never fires again.
    """

    async def __call__(self, receive: Any, send: Any) -> None:
        scope = _extensions(self.scope)
        cleanups: list[Callable[[], None]] = scope.setdefault(_CLEANUPS, [])
        record = scope[_ACCESS] = AccessRecord.from_scope(scope)

        async def send_counted(message: Any) -> None:  # an ASGI event, read and rebuilt as a dict
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", record.request_id.encode("ascii"))]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                record.bytes += len(message.get("body", b""))
            await send(message)

        try:
            await super().__call__(receive, send_counted)
        finally:
            for fn in reversed(cleanups):
                fn()
            if record.error_kind is not None:
                self._state.metrics.error(record.error_kind, "http")
            record.emit()

    @property
    def _state(self) -> ServerState:
        app: RingserveQuart = self.app  # type: ignore[assignment]  # quart types its app as Quart
        return app.ringserve_state

    # quart_trio's handle_request adds the nursery to quart's signature, hence the ignore.
    async def handle_request(self, nursery: trio.Nursery, request: Any, send: Any) -> None:  # type: ignore[override]
        watch = self._state.watchdog.watch

        async def send_watched(message: Any) -> None:  # an ASGI event
            # Every write is timed: a peer that stops reading is dropped (http/transport.py).
            with watch(_extensions(self.scope), nursery.cancel_scope):
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    with trio.CancelScope(shield=True):
                        await send(message)
                else:
                    await send(message)

        await super().handle_request(nursery, request, send_watched)


class _RouteMap(QuartMap):
    """Quart's URL map without slash merging: werkzeug answers ``/static//x`` or ``/v1//models``
    with a 308 redirect whose body is HTML, which Quart sends past the error handlers; unmerged,
    such a path is a 404 in the JSON error shape."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "merge_slashes": False})


class RingserveQuart(QuartTrio):
    asgi_http_class = ClosingHTTPConnection
    url_map_class = _RouteMap
    ringserve_state: ServerState


@attrs.define(eq=False)
class ServerState:
    """What the routes need; ``hub`` is set once the model is loaded and the runner runs."""

    config: Config
    hub: Hub | None = None
    model_id: str = ""
    urls: list[str] = attrs.Factory(list)
    started: float = attrs.Factory(time.time)
    metrics: Metrics = attrs.Factory(Metrics)
    auth: Authenticator = attrs.Factory(lambda self: Authenticator.from_config(self.config.auth), takes_self=True)
    gate: ReaderGate = attrs.Factory(
        lambda self: ReaderGate(self.config.limits.max_readers_per_message, self.config.limits.max_readers_per_client),
        takes_self=True,
    )
    watchdog: SendWatchdog = attrs.Factory(
        lambda self: SendWatchdog(
            self.config.server.slow_reader_timeout, on_drop=lambda: self.metrics.slow_reader_disconnected("blocked")
        ),
        takes_self=True,
    )


def _extensions(scope: object) -> dict[str, Any]:
    """An ASGI scope as the dict it is: ringserve keeps its own keys in it (:data:`_ACCESS`,
    :data:`_CLEANUPS`; the ASGI spec allows extension keys), which hypercorn's TypedDicts do not list."""
    return cast(dict[str, Any], scope)


def _access() -> AccessRecord:
    """This request's access-log record."""
    record: AccessRecord = _extensions(request.scope)[_ACCESS]
    return record


def _error_response(surface: Surface, error: RingserveError) -> Response:
    """The surface's error JSON with the error's status; noted for the access log and metrics."""
    _access().error_kind = error.kind
    resp = Response(dumps(surface.error_json(error)), surface.error_status(error), content_type="application/json")
    if error.retry_after is not None:
        # Retry-After is whole seconds (RFC 9110, section 10.2.3), rounded up so that no client
        # comes back early; both SDKs read the exact value from retry-after-ms first.
        resp.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        resp.headers["retry-after-ms"] = str(max(0, round(error.retry_after * 1000)))
    return resp


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, content_type="application/json")


def message_status_json(view: MessageView) -> dict[str, Any]:
    """``GET /v1/messages/{id}``: the message's status, text and content blocks (so far, in its
    surface's shape), stop reason and usage (``surfaces/ringserve.py``)."""
    return ringserve_json.message_status_json(view, SURFACES.by_name(view.surface))


def object_surface(view: MessageView) -> Surface:
    """The surface that spells ``view``'s objects: its own, restored with what it echoes."""
    return SURFACES.by_name(view.surface).restored(view.echo)


def _request_headers() -> RequestHeaders:
    """The headers that steer a generation request, as values."""
    headers = request.headers
    return RequestHeaders(
        prefer=tuple(headers.getlist("Prefer")),
        idempotency_key=headers.get("Idempotency-Key"),
        disconnect_policy=headers.get("Ringserve-Disconnect-Policy"),
    )


def request_surface() -> Surface:
    """The surface whose error shape answers this request (``Surfaces.for_request``), looked up
    once per request and kept in its scope."""
    scope = _extensions(request.scope)
    surface: Surface | None = scope.get(_SURFACE)
    if surface is None:
        message_id = (request.view_args or {}).get("message_id")
        surface = scope[_SURFACE] = SURFACES.for_request(
            request.path, {name.lower() for name in request.headers.keys()}, message_id
        )
    return surface


def _state() -> ServerState:
    """The server state of the app serving this request."""
    app = cast(RingserveQuart, current_app)  # a proxy of the app, which is a RingserveQuart
    return app.ringserve_state


def _hub() -> Hub:
    """The hub, once the model is loaded.

    Raises:
        RingserveError: ``UNAVAILABLE`` (503, ``Retry-After: 1``) while the model loads.
    """
    hub = _state().hub
    if hub is None:
        raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading", retry_after=1, retryable=True)
    return hub


def _admit_reader(message_readers: int = 0) -> None:
    """Count this request as a reader of its client until it ends (429 over the limits)."""
    leave = _state().gate.enter(request.remote_addr or "", message_readers)
    _extensions(request.scope).setdefault(_CLEANUPS, []).append(leave)


def _stream_token(message_id: str) -> StreamToken:
    token, expires = _state().auth.issue(message_id)
    return StreamToken(message_id, token, expires)


def _sse_response(hub: Hub, log_: MessageLog, after: int | None, message_id: str) -> Response:
    """``log_`` after ``after`` as an event stream; this request reads it until the connection ends."""
    metrics = _state().metrics
    reader = log_.reader()
    reader.__enter__()
    released = False
    truncated: str | None = "disconnected"  # why the connection ended before the terminal event

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            reader.__exit__(None, None, None)
            if truncated is not None:
                metrics.stream_truncated(truncated)

    _extensions(request.scope).setdefault(_CLEANUPS, []).append(release)

    async def body() -> AsyncIterator[bytes]:
        nonlocal truncated
        try:
            async with aclosing(hub.stream(log_, after, on_heartbeat=metrics.heartbeat)) as chunks:
                async for chunk in chunks:
                    yield chunk
            truncated = None
        except ReaderLagged:
            # the client resumes with Last-Event-ID and gets a defined answer
            truncated = "lagged"
            metrics.slow_reader_disconnected("lagged")
        finally:
            release()

    resp = Response(body(), 200, headers={**SSE_HEADERS, "X-Message-Id": message_id})
    resp.timeout = None
    return resp


async def generate(surface: Surface) -> Response:
    """``POST`` on ``surface``'s generation route: :func:`admit`, ``Hub.create``, then :func:`respond`."""
    state = _state()
    try:
        hub = _hub()
        if not hub.logs.available:
            raise store_unavailable()
        raw = await request.get_data(cache=True, as_text=False, parse_form_data=False)
        start = admit(surface, raw, _request_headers(), state.config, state.model_id)
        if isinstance(start, Refuse):
            return _error_response(surface, start.error)
        _admit_reader()
        created = await hub.create(
            surface,
            start.parsed,
            body_hash=start.body_hash,
            request_json=start.request_json,
            policy=start.policy,
            idempotency_key=start.idempotency_key,
        )
    except RingserveError as exc:
        return _error_response(surface, exc)
    _access().message_id = created.view.id
    return await respond(hub, surface, answer(start, created.view), created.live)


async def respond(hub: Hub, surface: Surface, decision: Decision, live: LiveMessage | None = None) -> Response:
    """The response to a started request's :data:`Decision`: the one map from decisions to responses.
    ``live`` is the message's handle when it is live here (:class:`StreamLive`, :class:`WaitLive`)."""
    match decision:
        case Refuse():
            return _error_response(surface, decision.error)
        case Accepted(message=msg):
            headers = {"Location": message_url(msg.id), "Preference-Applied": RESPOND_ASYNC, "X-Message-Id": msg.id}
            return _json(ringserve_json.accepted_json(msg.status, _stream_token(msg.id)), 202, headers)
        case StreamLive(message=msg):
            assert live is not None, "a live decision comes with the live message"
            return _sse_response(hub, live.open_log, None, msg.id)
        case ReplayStored(message=stored):
            try:
                log_, after = await hub.open_log(stored.id, None)  # GONE once the log expired
            except RingserveError as exc:
                return _error_response(surface, exc)
            return _sse_response(hub, log_, after, stored.id)
        case WaitStored(message=stored):
            try:
                stored = await hub.settled(stored)  # generated on another replica: wait for its end
            except RingserveError as exc:
                return _error_response(surface, exc)
            return await respond(hub, surface, finished(stored))
        case WaitLive():
            assert live is not None, "a live decision comes with the live message"
            with live.open_log.reader():  # a reader, so that the abort policy does not fire
                await live.done.wait()
            return await respond(hub, surface, finished(live.view()))
        case Answer(message=msg):
            return _json(object_surface(msg).message_json(msg), headers={"X-Message-Id": msg.id})
        case _:
            assert_never(decision)


async def authenticate() -> Response | None:
    """Note the route for the access log; refuse /v1 requests without a valid key (401).

    ``GET /v1/messages/{id}/stream`` also takes ``?stream_token=`` for that
    message. /health, /ready and /metrics stay open.
    """
    if request.url_rule is not None:
        _access().route = request.url_rule.rule
    auth = _state().auth
    if not auth.enabled or not request.path.startswith("/v1/") or auth.request_key_ok(request.headers):
        return None
    message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
    token = request.args.get("stream_token")
    if request.endpoint in ("resume_stream", "retrieve_response") and token is not None:
        view_args = request.view_args or {}  # None only when no route matched
        message_id = view_args.get("message_id") or view_args["response_id"]
        if auth.token_ok(token, message_id):
            return None
        message = (
            f"the stream token is invalid, expired or for another message; get a new one with"
            f" POST /v1/messages/{message_id}/stream_token (with the API key), or send the API key"
        )
    resp = _error_response(request_surface(), RingserveError(ErrorKind.AUTHENTICATION, message))
    resp.headers["WWW-Authenticate"] = 'Bearer realm="ringserve"'
    return resp


async def get_message(message_id: str) -> Response:
    """``GET /v1/messages/{id}``: ringserve's status of any message (``surfaces/ringserve.py``)."""
    try:
        return _json(message_status_json(await _hub().find(message_id)))
    except RingserveError as exc:
        return _error_response(request_surface(), exc)


async def resume_stream(message_id: str) -> Response:
    """``GET /v1/messages/{id}/stream``: the stream after ``Last-Event-ID`` (or ``?last_event_id=``)."""
    record, metrics = _access(), _state().metrics
    record.message_id, record.resume = message_id, True
    try:
        hub = _hub()
        last = request.headers.get("Last-Event-ID")
        if last is None:
            last = request.args.get("last_event_id")
        log_, after = await hub.open_log(message_id, last or None)
        _admit_reader(log_.readers)
    except StreamEnded:  # after the terminal event: 204 makes an EventSource stop reconnecting
        metrics.resumed("ended")
        return Response(b"", 204, headers={"X-Message-Id": message_id})
    except RingserveError as exc:
        metrics.resumed("expired" if exc.kind is ErrorKind.GONE else "rejected")
        return _error_response(request_surface(), exc)
    metrics.resumed("ok")
    return _sse_response(hub, log_, after, message_id)


async def issue_stream_token(message_id: str) -> Response:
    """A short-lived token that lets ``GET .../stream?stream_token=`` read this one message."""
    _access().message_id = message_id
    try:
        await _hub().find(message_id)
    except RingserveError as exc:
        return _error_response(request_surface(), exc)
    return _json(ringserve_json.stream_token_json(_stream_token(message_id)))


async def cancel_message(message_id: str) -> Response:
    """``POST /v1/messages/{id}/cancel``: cancel it (here or on its replica), answer its status once ended."""
    try:
        hub = _hub()
        return _json(message_status_json(await hub.ended(await hub.find(message_id))))
    except RingserveError as exc:
        return _error_response(request_surface(), exc)


def _served_model() -> ModelInfo:
    """The served model (``UNAVAILABLE`` while it loads, without ``Retry-After``)."""
    state = _state()
    if state.hub is None:
        raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading")
    return ModelInfo(state.model_id, state.started, state.hub.runner.n_ctx_slot)


async def models() -> Response:
    """``GET /v1/models``: the one served model."""
    try:
        return _json(ringserve_json.models_json(_served_model()))
    except RingserveError as exc:
        return _error_response(request_surface(), exc)


async def model(model_id: str) -> Response:
    """The served model under its own id (and, unless names are strict, under any id)."""
    try:
        served = _served_model()
        if model_id != served.id and _state().config.model.strict_model_name:
            raise RingserveError(ErrorKind.NOT_FOUND, f"no model {model_id[:100]!r}")
    except RingserveError as exc:
        return _error_response(request_surface(), exc)
    return _json(ringserve_json.model_json(served))


async def playground() -> Response:
    """The playground page (``ringserve/static/``; Quart serves ``/static/app.js`` from there)."""
    return await current_app.send_static_file("index.html")


async def health() -> Response:
    """503 while the model loads, 200 after (also while draining: the process is alive).

    For an orchestrator's liveness probe give it a start-up delay or a
    startup probe covering the model load; use ``/ready`` for traffic.
    """
    state = _state()
    hub = state.hub
    status = core_health.health(loaded=hub is not None, draining=hub is not None and hub.draining)
    body = ringserve_json.health_json(status, None if hub is None else state.model_id)
    return _json(body, 503 if status is core_health.Health.LOADING else 200)


async def ready() -> Response:
    """Readiness: 200 once the model is loaded and the decode loop runs; 503 before, while
    draining, and while the Redis log backend cannot reach Redis."""
    state = _state()
    hub = state.hub
    status = core_health.readiness(
        loaded=hub is not None,
        draining=hub is not None and hub.draining,
        running=hub is not None and hub.runner.running,
        store_available=hub is not None and hub.logs.available,
    )
    return _json(ringserve_json.ready_json(status, state.model_id), 200 if status is core_health.Readiness.READY else 503)


async def metrics() -> Response:
    """Prometheus text format (open, like /health: firewall it if it must stay private)."""
    return Response(_state().metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)


#: HTTP status of a werkzeug error → the kind it is answered as (others: 4xx invalid, 5xx api error).
_HTTP_KINDS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.INVALID_REQUEST, 413: ErrorKind.REQUEST_TOO_LARGE}


async def http_error(exc: HTTPException) -> Response:
    """A werkzeug error (no route, wrong method, body too large) in the request's error shape."""
    code = exc.code or 500
    kind = _HTTP_KINDS.get(code, ErrorKind.INVALID_REQUEST if code < 500 else ErrorKind.API_ERROR)
    message = exc.description or exc.name
    if code == 413:
        limit = _state().config.server.max_body_bytes
        message = f"the request body is larger than server.max_body_bytes ({limit} bytes)"
    resp = _error_response(request_surface(), RingserveError(kind, message))
    resp.status_code = code
    return resp


async def store_error(exc: sqlite3.DatabaseError) -> Response:
    log.exception("message store failed on %s %s", request.method, request.path)
    return _error_response(request_surface(), store_failed(exc))


async def internal_error(exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return _error_response(request_surface(), RingserveError(ErrorKind.API_ERROR, "internal server error"))


async def count_tokens() -> Response:
    """``POST /v1/messages/count_tokens``: the prompt the same ``POST /v1/messages`` request would
    be given, in tokens (system prompt, tools and output format included), which is its usage's
    ``input_tokens`` plus ``cache_read_input_tokens``. Nothing is generated; a prompt that cannot
    fit a slot is the same 400 as there."""
    state = _state()
    try:
        hub = _hub()
        raw = await request.get_data(cache=True, as_text=False, parse_form_data=False)
        parsed = parse_body(ANTHROPIC.parse_count_tokens, raw, state.config, state.model_id)
        prepared = await hub.runner.prepare(parsed.request)
    except RingserveError as exc:
        return _error_response(ANTHROPIC, exc)
    return _json(ANTHROPIC.count_tokens_json(len(prepared.prompt_tokens)))


#: ``(rule, method, handler)`` of every route but the generation routes (``SURFACES.routes``);
#: the endpoint is the handler's name.
ROUTES: tuple[tuple[str, str, Callable[..., Awaitable[Response]]], ...] = (
    ("/v1/messages/count_tokens", "POST", count_tokens),
    ("/v1/messages/<message_id>", "GET", get_message),
    ("/v1/messages/<message_id>/stream", "GET", resume_stream),
    ("/v1/messages/<message_id>/stream_token", "POST", issue_stream_token),
    ("/v1/messages/<message_id>/cancel", "POST", cancel_message),
    ("/v1/models", "GET", models),
    ("/v1/models/<path:model_id>", "GET", model),
    ("/", "GET", playground),
    ("/health", "GET", health),
    ("/ready", "GET", ready),
    ("/metrics", "GET", metrics),
)


def _generate_route(surface: Surface) -> Callable[[], Awaitable[Response]]:
    async def route() -> Response:
        return await generate(surface)

    return route


def create_app(state: ServerState) -> RingserveQuart:
    """Build the quart-trio app for ``state`` (routes listed in docs/api.md)."""
    app = RingserveQuart("ringserve")
    app.ringserve_state = state
    # Quart's 60 s RESPONSE_TIMEOUT would cut long streams; bodies are bounded by size instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = state.config.server.max_body_bytes
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = None  # the playground's files: no stale app.js after an upgrade
    app.before_request(authenticate)
    for path, surface in SURFACES.routes.items():
        app.add_url_rule(path, f"generate_{surface.name}", _generate_route(surface), methods=["POST"])
    for rule, method, handler in ROUTES:
        app.add_url_rule(rule, handler.__name__, handler, methods=[method])
    register_responses(app, RouteKit(
        config=state.config, hub=_hub, sse_response=_sse_response, admit_reader=_admit_reader,
        error_response=_error_response, json_response=_json,
        note_message=lambda message_id: setattr(_access(), "message_id", message_id),
        on_request_end=lambda fn: _extensions(request.scope).setdefault(_CLEANUPS, []).append(fn),
    ))
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(sqlite3.DatabaseError, store_error)
    app.register_error_handler(Exception, internal_error)
    return app
