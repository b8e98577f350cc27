"""The ASGI shell: quart-trio's app and HTTP connection as ringserve runs them, and the route map.

Every route handler is a module function (``http/generate.py``,
``http/messages.py``, ``http/responses.py``, ``http/service.py``) that reads the
server's state from its request's context (``http/context.py``);
:func:`routes` lists them, and ``http/app.py`` ``create_app`` registers them.
Errors found before the first byte are answered with an HTTP status and the
surface's own error JSON; once a stream has started, errors are in-band events
written by the producer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response
from quart.routing import QuartMap
from quart.utils import encode_headers
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

from ringserve.http.accesslog import SCOPE_KEY as ACCESS_KEY
from ringserve.http.accesslog import AccessRecord
from ringserve.http.context import CLEANUPS_KEY, EventStream, ServerState, extensions
from ringserve.http.generate import count_tokens, generate, render_prompt
from ringserve.http.messages import cancel_message, get_message, issue_stream_token, resume_stream
from ringserve.http.responses import cancel_response, delete_response, retrieve_response
from ringserve.http.service import health, load_model, metrics, model, models, playground, ready, unload_model
from ringserve.surfaces.base import IGNORED_FIELDS_HEADER, Counting, Surface
from ringserve.surfaces.registry import SURFACES

Handler = Callable[..., Awaitable[Response]]


class ClosingHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection with an access record, a send watchdog and two fixes.

    Every request gets an :class:`AccessRecord` (one log line at the end) and
    an ``X-Request-Id``; every send is timed by the :class:`SendWatchdog`.

    Cleanups: a handler that registers a stream reader adds its release to
    the request's cleanups (``context.on_request_end``); it runs when the ASGI call
    returns, even if the client left before Quart started the response body
    (an async generator that never started would never run its ``finally``).

    The final send is shielded: hypercorn finishes a response inside the
    app's ``send`` call — closing the socket for ``Connection: close`` and
    HTTP/1.0, or re-arming the keep-alive idle timer — and that chain first
    posts ``http.disconnect`` to the app, on which quart-trio cancels the
    request's nursery, i.e. the very task running the chain. Unshielded, the
    socket is never closed and the keep-alive timeout never fires again.

    An event stream's body (:class:`~ringserve.http.context.EventStream`) is
    written by :meth:`_send_response` straight to hypercorn's ``send``, one
    write per chunk, timed by the watchdog and counted, without the wrappers
    above (which its head and its final send still go through).
    """

    _send_body: Any = None  # hypercorn's send, for an event stream's chunks
    _cancel_scope: trio.CancelScope | None = None  # the request's, for the watchdog

    async def __call__(self, receive: Any, send: Any) -> None:
        scope = extensions(self.scope)
        cleanups: list[Callable[[], None]] = scope.setdefault(CLEANUPS_KEY, [])
        record = scope[ACCESS_KEY] = AccessRecord.from_scope(scope)
        self._send_body = send

        async def send_counted(message: Any) -> None:  # an ASGI event, read and rebuilt as a dict
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", record.request_id.encode("ascii"))]
                if record.ignored_fields:
                    headers.append((IGNORED_FIELDS_HEADER.lower().encode("ascii"), record.ignored_fields.encode("ascii")))
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
        self._cancel_scope = nursery.cancel_scope

        async def send_watched(message: Any) -> None:  # an ASGI event
            # Every write is timed: a peer that stops reading is dropped (http/transport.py).
            with watch(extensions(self.scope), nursery.cancel_scope):
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    with trio.CancelScope(shield=True):
                        await send(message)
                else:
                    await send(message)

        await super().handle_request(nursery, request, send_watched)

    async def _send_response(self, send: Any, response: Any) -> None:
        if not isinstance(response, EventStream):
            await super()._send_response(send, response)
            return
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": encode_headers(response.headers)})
        scope = extensions(self.scope)
        record: AccessRecord = scope[ACCESS_KEY]
        watchdog, cancel_scope, send_body = self._state.watchdog, self._cancel_scope, self._send_body
        assert cancel_scope is not None, "handle_request sets it"
        async with response.response as chunks:
            async for chunk in chunks:
                key = watchdog.started(scope, cancel_scope)
                try:
                    await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
                finally:
                    watchdog.finished(key)
                record.bytes += len(chunk)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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


#: ``(rule, method, handler)`` of every route but the surfaces' generation, counting and render
#: routes (``SURFACES.routes``, ``SURFACES.counts``, ``SURFACES.renders``); the endpoint is the
#: handler's name.
ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/v1/messages/<message_id>", "GET", get_message),
    ("/v1/messages/<message_id>/stream", "GET", resume_stream),
    ("/v1/messages/<message_id>/stream_token", "POST", issue_stream_token),
    ("/v1/messages/<message_id>/cancel", "POST", cancel_message),
    ("/v1/responses/<response_id>", "GET", retrieve_response),
    ("/v1/responses/<response_id>/cancel", "POST", cancel_response),
    ("/v1/responses/<response_id>", "DELETE", delete_response),
    ("/v1/models", "GET", models),
    ("/v1/models/<path:model_id>", "GET", model),
    ("/models", "GET", models),
    ("/models/load", "POST", load_model),
    ("/models/unload", "POST", unload_model),
    ("/", "GET", playground),
    ("/health", "GET", health),
    ("/ready", "GET", ready),
    ("/metrics", "GET", metrics),
)


def _generating(surface: Surface) -> Handler:
    async def route() -> Response:
        return await generate(surface)

    return route


def _counting(surface: Counting) -> Handler:
    async def route() -> Response:
        return await count_tokens(surface)

    return route


def _rendering(surface: Surface) -> Handler:
    async def route() -> Response:
        return await render_prompt(surface)

    return route


def routes() -> list[tuple[str, str, str, Handler]]:
    """``(rule, method, endpoint, handler)`` of every route: each surface's generation, counting
    and render routes (one handler each, :func:`~ringserve.http.generate.generate`,
    :func:`~ringserve.http.generate.count_tokens` and :func:`~ringserve.http.generate.render_prompt`),
    then :data:`ROUTES`."""
    table = [(path, "POST", f"generate_{s.name}", _generating(s)) for path, s in SURFACES.routes.items()]
    table += [(path, "POST", f"count_{s.name}", _counting(s)) for path, s in SURFACES.counts.items()]
    table += [(path, "POST", f"render_{s.name}", _rendering(s)) for path, s in SURFACES.renders.items()]
    return table + [(rule, method, handler.__name__, handler) for rule, method, handler in ROUTES]
