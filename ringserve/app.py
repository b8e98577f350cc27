"""The HTTP shell: quart-trio routes over the hub, the runner and the surfaces.

Handlers parse, submit and stream; policy lives in ``stream/hub.py`` and
``engine/runner.py``. Errors found before the first byte are answered with an
HTTP status and the surface's own error JSON; once a stream has started, errors
are in-band events written by the producer.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, cast

import attrs
import trio
from quart import Response, request
from quart.routing import QuartMap
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from ringserve.accesslog import SCOPE_KEY as _ACCESS
from ringserve.accesslog import AccessRecord
from ringserve.auth import Authenticator
from ringserve.config import Config
from ringserve.connections import SendWatchdog
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import BlockKind, Usage
from ringserve.core.limits import ReaderGate, check_request
from ringserve.core.prefer import parse_prefer
from ringserve.core.status import FINAL_STATUSES, CancelReason, MessageStatus
from ringserve.messages import StoredMessage, store_failed
from ringserve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ringserve.metrics import Metrics
from ringserve.stream.hub import Hub, LiveMessage, StreamEnded, request_hash
from ringserve.stream.logs import store_unavailable
from ringserve.stream.reader import ReaderLagged
from ringserve.surfaces.anthropic import AnthropicSurface
from ringserve.surfaces.base import MessageResult, Surface, dumps
from ringserve.surfaces.openai import OpenAISurface

log = logging.getLogger("ringserve")

ANTHROPIC = AnthropicSurface()
OPENAI = OpenAISurface()
SURFACES: dict[str, Surface] = {s.name: s for s in (ANTHROPIC, OPENAI)}

#: Response headers of every event stream (C9): no proxy buffering, no caching.
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_CLEANUPS = "ringserve.cleanups"


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
            # Every write is timed: a peer that stops reading is dropped (connections.py).
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
    status = getattr(surface, "error_status", lambda e: e.status)(error)
    resp = Response(dumps(surface.error_json(error)), status, content_type="application/json")
    if error.retry_after is not None:
        # Retry-After is whole seconds (RFC 9110, section 10.2.3), rounded up so that no client
        # comes back early; both SDKs read the exact value from retry-after-ms first.
        resp.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        resp.headers["retry-after-ms"] = str(max(0, round(error.retry_after * 1000)))
    return resp


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, content_type="application/json")


def message_status_json(msg: LiveMessage | StoredMessage) -> dict[str, Any]:
    """``GET /v1/messages/{id}``: the message's status, text and content blocks (so far, in its
    surface's shape), stop reason and usage."""
    if isinstance(msg, LiveMessage):
        snap = msg.snapshot()
        surface, blocks, stop_reason, stop_sequence, error = (
            msg.surface, snap.content, snap.stop_reason, snap.stop_sequence, snap.error)
        input_tokens, output_tokens = snap.usage.input_tokens, snap.usage.output_tokens
    else:
        surface, blocks, stop_reason, stop_sequence, error = (
            SURFACES[msg.surface], msg.blocks, msg.stop_reason, msg.stop_sequence, msg.error)
        input_tokens, output_tokens = msg.input_tokens, msg.output_tokens
    return {
        "id": msg.id,
        "object": "ringserve.message",
        "surface": surface.name,
        "model": msg.model,
        "created": msg.created,
        "status": msg.status.value,
        "text": "".join(b.text for b in blocks if b.kind is BlockKind.TEXT),
        "content": surface.content_json(blocks),
        "stop_reason": None if stop_reason is None else surface.stop_reason(stop_reason),
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "error": error,
        "stream_url": f"/v1/messages/{msg.id}/stream",
    }


def create_app(state: ServerState) -> RingserveQuart:
    """Build the quart-trio app for ``state`` (routes listed in README.md)."""
    config = state.config
    app = RingserveQuart("ringserve")
    app.ringserve_state = state
    # Quart's 60 s RESPONSE_TIMEOUT would cut long streams; bodies are bounded by size instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = None  # the playground's files: no stale app.js after an upgrade

    def hub_or_unavailable() -> Hub:
        if state.hub is None:
            raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading", retry_after=1, retryable=True)
        return state.hub

    def sse_response(hub: Hub, log_: Any, after: int | None, headers: dict[str, str] | None = None) -> Response:
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
                    state.metrics.stream_truncated(truncated)

        _extensions(request.scope).setdefault(_CLEANUPS, []).append(release)

        async def body() -> AsyncIterator[bytes]:
            nonlocal truncated
            try:
                async with aclosing(hub.stream(log_, after, on_heartbeat=state.metrics.heartbeat)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                truncated = None
            except ReaderLagged:
                # the client resumes with Last-Event-ID and gets a defined answer
                truncated = "lagged"
                state.metrics.slow_reader_disconnected("lagged")
            finally:
                release()

        resp = Response(body(), 200, headers={**SSE_HEADERS, **(headers or {})})
        resp.timeout = None
        return resp

    async def generate(surface: Surface) -> Response:
        try:
            hub = hub_or_unavailable()
            if not hub.logs.available:
                raise store_unavailable()
            raw = await request.get_data(cache=True, as_text=False, parse_form_data=False)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                raise RingserveError(ErrorKind.INVALID_REQUEST, f"request body is not valid JSON: {exc}") from None
            parsed = surface.parse_request(body)
            limits = config.limits
            check_request(parsed.request, max_messages=limits.max_messages, max_text_chars=limits.max_message_chars)
            if config.model.strict_model_name and parsed.model and parsed.model != state.model_id:
                raise RingserveError(ErrorKind.NOT_FOUND, f"model {parsed.model[:100]!r} is not served here", param="model")
            respond_async = "respond-async" in parse_prefer(",".join(request.headers.getlist("Prefer")))
            policy = hub.policy_for(
                surface, respond_async=respond_async, override=request.headers.get("Ringserve-Disconnect-Policy")
            )
            admit_reader()
            msg, _created = await hub.create(
                surface,
                parsed,
                body_hash=request_hash(raw),
                request_json=raw.decode("utf-8", "replace"),
                policy=policy,
                idempotency_key=request.headers.get("Idempotency-Key"),
            )
            _access().message_id = msg.id
            if respond_async:
                location = f"/v1/messages/{msg.id}"
                payload = {"id": msg.id, "status": msg.status.value, "url": location, **stream_token_json(msg.id)}
                headers = {"Location": location, "Preference-Applied": "respond-async", "X-Message-Id": msg.id}
                return _json(payload, 202, headers)
            if isinstance(msg, StoredMessage):  # an idempotent retry of a finished message
                if parsed.stream:
                    log_, after = await hub.open_log(msg.id, None)  # GONE once the log expired
                    return sse_response(hub, log_, after, {"X-Message-Id": msg.id})
                return stored_answer(surface, msg)
            if parsed.stream:
                return sse_response(hub, msg.log, None, {"X-Message-Id": msg.id})
            with msg.open_log.reader():
                await msg.done.wait()
            return finished_answer(surface, msg)
        except RingserveError as exc:
            return _error_response(surface, exc)

    def finished_answer(surface: Surface, msg: LiveMessage) -> Response:
        if msg.status in (MessageStatus.FAILED, MessageStatus.INTERRUPTED):  # interrupted: ended by the drain
            kind = ErrorKind.UNAVAILABLE if msg.cancel_reason is CancelReason.DRAIN else ErrorKind.API_ERROR
            error = msg.snapshot().error
            return _error_response(surface, RingserveError(kind, error or "generation failed", retryable=True))
        return _json(surface.message_json(msg.result()), headers={"X-Message-Id": msg.id})

    def stored_answer(surface: Surface, msg: StoredMessage) -> Response:
        """A finished message as its surface's JSON (``Hub.create`` generates failed ones again)."""
        if msg.status not in (MessageStatus.COMPLETE, MessageStatus.CANCELLED):
            raise RingserveError(ErrorKind.CONFLICT, f"message {msg.id} is {msg.status.value}")
        result = MessageResult(msg.id, msg.model, msg.created, msg.blocks, msg.stop_reason, msg.stop_sequence,
                               Usage(msg.input_tokens, msg.output_tokens), cancelled=msg.status is MessageStatus.CANCELLED)
        return _json(surface.message_json(result), headers={"X-Message-Id": msg.id})

    def surface_of(message_id: str) -> Surface:
        return OPENAI if message_id.startswith(OPENAI.id_prefix) else ANTHROPIC

    def request_surface() -> Surface:
        """The surface whose error shape answers this request: by message id; else Anthropic under
        /v1/messages or with the Anthropic SDK's ``anthropic-version`` header (/v1/models is read by
        both SDKs); else OpenAI (also outside /v1, like hypercorn's own 400s: connections.py)."""
        message_id = (request.view_args or {}).get("message_id")
        if message_id is not None:
            return surface_of(message_id)
        if request.path.startswith("/v1/messages") or "anthropic-version" in request.headers:
            return ANTHROPIC
        return OPENAI

    def admit_reader(message_readers: int = 0) -> None:
        """Count this request as a reader of its client until it ends (429 over the limits)."""
        leave = state.gate.enter(request.remote_addr or "", message_readers)
        _extensions(request.scope).setdefault(_CLEANUPS, []).append(leave)

    def stream_token_json(message_id: str) -> dict[str, Any]:
        token, expires = state.auth.issue(message_id)
        return {
            "stream_token": token,
            "stream_token_expires_at": expires,
            "stream_url": f"/v1/messages/{message_id}/stream?stream_token={token}",
        }

    @app.before_request
    async def authenticate() -> Response | None:
        """Note the route for the access log; refuse /v1 requests without a valid key (401).

        ``GET /v1/messages/{id}/stream`` also takes ``?stream_token=`` for that
        message. /health, /ready and /metrics stay open.
        """
        if request.url_rule is not None:
            _access().route = request.url_rule.rule
        auth = state.auth
        if not auth.enabled or not request.path.startswith("/v1/") or auth.request_key_ok(request.headers):
            return None
        message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
        token = request.args.get("stream_token")
        if request.endpoint == "resume_stream" and token is not None:
            message_id = (request.view_args or {})["message_id"]  # None only when no route matched
            if auth.token_ok(token, message_id):
                return None
            message = (
                f"the stream token is invalid, expired or for another message; get a new one with"
                f" POST /v1/messages/{message_id}/stream_token (with the API key), or send the API key"
            )
        resp = _error_response(request_surface(), RingserveError(ErrorKind.AUTHENTICATION, message))
        resp.headers["WWW-Authenticate"] = 'Bearer realm="ringserve"'
        return resp

    @app.post("/v1/messages")
    async def anthropic_messages() -> Response:
        return await generate(ANTHROPIC)

    @app.post("/v1/chat/completions")
    async def openai_chat_completions() -> Response:
        return await generate(OPENAI)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens() -> Response:
        """The prompt the same ``POST /v1/messages`` request would be given, in tokens (system
        prompt, tools and output format included): its usage's ``input_tokens`` plus
        ``cache_read_input_tokens``. Nothing is generated; a prompt that cannot fit a slot is the
        same 400 as there."""
        try:
            hub = hub_or_unavailable()
            raw = await request.get_data(cache=True, as_text=False, parse_form_data=False)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise RingserveError(ErrorKind.INVALID_REQUEST, f"request body is not valid JSON: {exc}") from None
            parsed = ANTHROPIC.parse_count_tokens(body)
            check_request(parsed.request, max_messages=config.limits.max_messages,
                          max_text_chars=config.limits.max_message_chars)
            if config.model.strict_model_name and parsed.model != state.model_id:
                raise RingserveError(ErrorKind.NOT_FOUND, f"model {parsed.model[:100]!r} is not served here", param="model")
            prepared = await hub.runner.prepare(parsed.request)
            return _json(ANTHROPIC.count_tokens_json(len(prepared.prompt_tokens)))
        except RingserveError as exc:
            return _error_response(ANTHROPIC, exc)

    @app.get("/v1/messages/<message_id>")
    async def get_message(message_id: str) -> Response:
        try:
            return _json(message_status_json(await hub_or_unavailable().find(message_id)))
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)

    @app.get("/v1/messages/<message_id>/stream")
    async def resume_stream(message_id: str) -> Response:
        record = _access()
        record.message_id, record.resume = message_id, True
        try:
            hub = hub_or_unavailable()
            last = request.headers.get("Last-Event-ID")
            if last is None:
                last = request.args.get("last_event_id")
            log_, after = await hub.open_log(message_id, last or None)
            admit_reader(log_.readers)
        except StreamEnded:  # after the terminal event: 204 makes an EventSource stop reconnecting
            state.metrics.resumed("ended")
            return Response(b"", 204, headers={"X-Message-Id": message_id})
        except RingserveError as exc:
            state.metrics.resumed("expired" if exc.kind is ErrorKind.GONE else "rejected")
            return _error_response(surface_of(message_id), exc)
        state.metrics.resumed("ok")
        return sse_response(hub, log_, after, {"X-Message-Id": message_id})

    @app.post("/v1/messages/<message_id>/stream_token")
    async def issue_stream_token(message_id: str) -> Response:
        """A short-lived token that lets ``GET .../stream?stream_token=`` read this one message."""
        _access().message_id = message_id
        try:
            await hub_or_unavailable().find(message_id)
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)
        return _json({"id": message_id, **stream_token_json(message_id)})

    @app.post("/v1/messages/<message_id>/cancel")
    async def cancel_message(message_id: str) -> Response:
        try:
            hub = hub_or_unavailable()
            msg = await hub.find(message_id)
            if isinstance(msg, LiveMessage):
                hub.cancel(msg, CancelReason.REQUESTED)
                await msg.done.wait()
            elif msg.status not in FINAL_STATUSES:  # another replica generates it
                msg = await hub.cancel_elsewhere(msg)
            return _json(message_status_json(msg))
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)

    def model_json() -> dict[str, Any]:
        """The served model in a shape both SDKs read (OpenAI ``Model``, Anthropic ``ModelInfo``)."""
        return {
            "id": state.model_id,
            "object": "model",
            "type": "model",
            "created": int(state.started),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started)),
            "display_name": state.model_id,
            "owned_by": "ringserve",
        }

    @app.get("/v1/models")
    async def models() -> Response:
        if state.hub is None:
            return _error_response(request_surface(), RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading"))
        return _json({"object": "list", "data": [model_json()], "has_more": False,
                      "first_id": state.model_id, "last_id": state.model_id})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        """The served model under its own id (and, unless names are strict, under any id)."""
        if state.hub is None:
            return _error_response(request_surface(), RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading"))
        if model_id != state.model_id and config.model.strict_model_name:
            return _error_response(request_surface(), RingserveError(ErrorKind.NOT_FOUND, f"no model {model_id[:100]!r}"))
        return _json(model_json())

    @app.get("/")
    async def playground() -> Response:
        """The playground page (``ringserve/static/``; Quart serves ``/static/app.js`` from there)."""
        return await app.send_static_file("index.html")

    @app.get("/health")
    async def health() -> Response:
        """503 while the model loads, 200 after (also while draining: the process is alive).

        For an orchestrator's liveness probe give it a start-up delay or a
        startup probe covering the model load; use ``/ready`` for traffic.
        """
        if state.hub is None:
            return _json({"status": "loading", "model": None}, 503)
        return _json({"status": "draining" if state.hub.draining else "ok", "model": state.model_id})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 once the model is loaded and the decode loop runs; 503 before, while
        draining, and while the Redis log backend cannot reach Redis."""
        hub = state.hub
        if hub is None:
            return _json({"status": "loading"}, 503)
        if hub.draining or not hub.runner.running:
            return _json({"status": "draining" if hub.draining else "stopped"}, 503)
        if not hub.logs.available:
            return _json({"status": "log store unavailable"}, 503)
        return _json({"status": "ready", "model": state.model_id})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format (open, like /health: firewall it if it must stay private)."""
        return Response(state.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        kinds = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.INVALID_REQUEST, 413: ErrorKind.REQUEST_TOO_LARGE}
        kind = kinds.get(exc.code or 500, ErrorKind.INVALID_REQUEST if (exc.code or 500) < 500 else ErrorKind.API_ERROR)
        message = exc.description or exc.name
        if exc.code == 413:
            message = f"the request body is larger than server.max_body_bytes ({config.server.max_body_bytes} bytes)"
        resp = _error_response(request_surface(), RingserveError(kind, message))
        resp.status_code = exc.code or 500
        return resp

    @app.errorhandler(sqlite3.DatabaseError)
    async def store_error(exc: sqlite3.DatabaseError) -> Response:
        log.exception("message store failed on %s %s", request.method, request.path)
        return _error_response(request_surface(), store_failed(exc))

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(request_surface(), RingserveError(ErrorKind.API_ERROR, "internal server error"))

    return app
