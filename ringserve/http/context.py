"""What every route handler reads of its request and its server, and how it answers.

:class:`ServerState` is the server's (one per app); the functions below read
this request's share of it from Quart's ``current_app`` and ``request``
context: its access record, its error shape (:func:`request_surface`), the
hub, the reader gate, the cleanups that run when its ASGI call returns
(``http/asgi.py``), and the two ways it answers: JSON in its surface's shape,
or a stream log as SSE (:func:`sse_response`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, ParamSpec, Protocol, cast

import attrs
from quart import Response, current_app, request

from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.limits import ReaderGate
from ringserve.core.view import MessageView
from ringserve.http.accesslog import SCOPE_KEY as ACCESS_KEY
from ringserve.http.accesslog import AccessRecord
from ringserve.http.auth import Authenticator
from ringserve.http.decide import SESSION_HEADERS, RequestHeaders
from ringserve.http.transport import SendWatchdog
from ringserve.live.hub import Hub
from ringserve.logs.memory import MessageLog
from ringserve.logs.reader import ReaderLagged
from ringserve.metrics import Metrics
from ringserve.surfaces.base import Surface, dumps
from ringserve.surfaces.registry import SURFACES
from ringserve.surfaces.ringserve import StreamToken

#: Response headers of every event stream (C9): no proxy buffering, no caching.
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
#: The request scope's key of the functions run when its ASGI call returns (``http/asgi.py``).
CLEANUPS_KEY = "ringserve.cleanups"
_SURFACE_KEY = "ringserve.surface"  # the request's surface, once looked up (request_surface)

P = ParamSpec("P")


@attrs.define(eq=False)
class ServerState:
    """What the routes need; ``hub`` is set once the models loaded at start are loaded."""

    config: Config
    hub: Hub | None = None
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


class StatefulApp(Protocol):
    """The app (``http/asgi.py`` ``RingserveQuart``) as the handlers read it."""

    ringserve_state: ServerState


def extensions(scope: object) -> dict[str, Any]:
    """An ASGI scope as the dict it is: ringserve keeps its own keys in it (:data:`ACCESS_KEY`,
    :data:`CLEANUPS_KEY`; the ASGI spec allows extension keys), which hypercorn's TypedDicts do not list."""
    return cast(dict[str, Any], scope)


def state() -> ServerState:
    """The server state of the app serving this request."""
    app = cast(StatefulApp, current_app)  # a proxy of the app, which is a RingserveQuart
    return app.ringserve_state


def hub() -> Hub:
    """The hub, once the model is loaded.

    Raises:
        RingserveError: ``UNAVAILABLE`` (503, ``Retry-After: 1``) while the model loads.
    """
    loaded = state().hub
    if loaded is None:
        raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading", retry_after=1, retryable=True)
    return loaded


def access() -> AccessRecord:
    """This request's access-log record."""
    record: AccessRecord = extensions(request.scope)[ACCESS_KEY]
    return record


def on_request_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when this request's ASGI call returns, whether its client stayed or not."""
    extensions(request.scope).setdefault(CLEANUPS_KEY, []).append(fn)


async def body() -> bytes:
    """This request's body (bounded by ``server.max_body_bytes``: a 413 past it)."""
    return await request.get_data(cache=True, as_text=False, parse_form_data=False)


def request_headers() -> RequestHeaders:
    """The headers that steer a generation request, as values."""
    headers = request.headers
    return RequestHeaders(
        prefer=tuple(headers.getlist("Prefer")),
        idempotency_key=headers.get("Idempotency-Key"),
        disconnect_policy=headers.get("Ringserve-Disconnect-Policy"),
        session=next((value for name in SESSION_HEADERS if (value := headers.get(name))), None),
    )


def request_surface() -> Surface:
    """The surface whose error shape answers this request (``Surfaces.for_request``), looked up
    once per request and kept in its scope."""
    scope = extensions(request.scope)
    surface: Surface | None = scope.get(_SURFACE_KEY)
    if surface is None:
        message_id = (request.view_args or {}).get("message_id")
        surface = scope[_SURFACE_KEY] = SURFACES.for_request(
            request.path, {name.lower() for name in request.headers.keys()}, message_id
        )
    return surface


def object_surface(view: MessageView) -> Surface:
    """The surface that spells ``view``'s objects (``Hub.surface_of``)."""
    return hub().surface_of(view)


def error_response(surface: Surface, error: RingserveError) -> Response:
    """The surface's error JSON with the error's status; noted for the access log and metrics."""
    access().error_kind = error.kind
    resp = Response(dumps(surface.error_json(error)), surface.error_status(error), content_type="application/json")
    if error.retry_after is not None:
        # Retry-After is whole seconds (RFC 9110, section 10.2.3), rounded up so that no client
        # comes back early; both SDKs read the exact value from retry-after-ms first.
        resp.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        resp.headers["retry-after-ms"] = str(max(0, round(error.retry_after * 1000)))
    return resp


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, content_type="application/json")


def answering_errors(handler: Callable[P, Awaitable[Response]]) -> Callable[P, Awaitable[Response]]:
    """A route handler whose ``RingserveError`` is answered in the request's error shape
    (:func:`request_surface`)."""

    @functools.wraps(handler)  # Quart names the endpoint after the function (``authenticate`` reads it)
    async def route(*args: P.args, **kwargs: P.kwargs) -> Response:
        try:
            return await handler(*args, **kwargs)
        except RingserveError as exc:
            return error_response(request_surface(), exc)

    return route


def admit_reader(message_readers: int = 0) -> None:
    """Count this request as a reader of its client until it ends (429 over the limits).

    Raises:
        RingserveError: ``RATE_LIMIT`` over ``[limits] max_readers_per_client`` or
            ``max_readers_per_message`` (``message_readers``: the log's readers now).
    """
    on_request_end(state().gate.enter(request.remote_addr or "", message_readers))


def stream_token(message_id: str) -> StreamToken:
    """A new token that opens ``message_id``'s stream (``http/auth.py``)."""
    token, expires = state().auth.issue(message_id)
    return StreamToken(message_id, token, expires)


class EventStream(Response):
    """A response whose body is a stream log's SSE bytes (:func:`sse_response`): ``http/asgi.py``
    writes its chunks through the ASGI ``send`` itself, one write per chunk (every entry a reader
    has ready), without the per-message wrappers of the other responses."""


def sse_response(hub: Hub, log: MessageLog, after: int | None, message_id: str) -> EventStream:
    """``log`` after ``after`` as an event stream; this request reads it until the connection ends."""
    metrics = state().metrics
    reader = log.reader()
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

    on_request_end(release)

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal truncated
        try:
            async with aclosing(hub.resume.stream(log, after, on_heartbeat=metrics.heartbeat)) as stream:
                async for chunk in stream:
                    yield chunk
            truncated = None
        except ReaderLagged:
            # the client resumes with Last-Event-ID and gets a defined answer
            truncated = "lagged"
            metrics.slow_reader_disconnected("lagged")
        finally:
            release()

    resp = EventStream(chunks(), 200, headers={**SSE_HEADERS, "X-Message-Id": message_id})
    resp.timeout = None
    return resp
