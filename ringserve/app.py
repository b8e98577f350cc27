"""The HTTP shell: quart-trio routes over the hub, the runner and the surfaces.

Handlers parse, submit and stream; policy lives in ``stream/hub.py`` and
``engine/runner.py``. Errors found before the first byte are answered with an
HTTP status and the surface's own error JSON; once a stream has started, errors
are in-band events written by the producer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import Usage
from ringserve.messages import StoredMessage
from ringserve.stream.hub import CancelReason, Hub, LiveMessage, request_hash
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
    """quart-trio's HTTP connection with two fixes of our own.

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
        cleanups: list[Callable[[], None]] = self.scope.setdefault(_CLEANUPS, [])
        try:
            await super().__call__(receive, send)
        finally:
            for fn in reversed(cleanups):
                fn()

    async def handle_request(self, nursery: trio.Nursery, request: Any, send: Any) -> None:
        async def send_final_shielded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().handle_request(nursery, request, send_final_shielded)


class RingserveQuart(QuartTrio):
    asgi_http_class = ClosingHTTPConnection


@attrs.define(eq=False)
class ServerState:
    """What the routes need; ``hub`` is set once the model is loaded and the runner runs."""

    config: Config
    hub: Hub | None = None
    model_id: str = ""
    urls: list[str] = attrs.Factory(list)
    started: float = attrs.Factory(time.time)


def _error_response(surface: Surface, error: RingserveError) -> Response:
    status = getattr(surface, "error_status", lambda e: e.status)(error)
    resp = Response(dumps(surface.error_json(error)), status, content_type="application/json")
    if error.retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, round(error.retry_after)))
    return resp


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, content_type="application/json")


def message_status_json(msg: LiveMessage | StoredMessage) -> dict[str, Any]:
    """``GET /v1/messages/{id}``: the message's status, text (so far), stop reason and usage."""
    if isinstance(msg, LiveMessage):
        text, usage, surface = "".join(msg.parts), msg.usage, msg.surface.name
        input_tokens, output_tokens = usage.input_tokens, usage.output_tokens
    else:
        text, surface = msg.text, msg.surface
        input_tokens, output_tokens = msg.input_tokens, msg.output_tokens
    return {
        "id": msg.id,
        "object": "ringserve.message",
        "surface": surface,
        "model": msg.model,
        "created": msg.created,
        "status": msg.status,
        "text": text,
        "stop_reason": msg.stop_reason,
        "stop_sequence": msg.stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "error": msg.error,
        "stream_url": f"/v1/messages/{msg.id}/stream",
    }


def create_app(state: ServerState) -> RingserveQuart:
    """Build the quart-trio app for ``state`` (routes listed in README.md)."""
    config = state.config
    app = RingserveQuart("ringserve")
    # Quart's 60 s RESPONSE_TIMEOUT would cut long streams; bodies are bounded by size instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes

    def hub_or_unavailable() -> Hub:
        if state.hub is None:
            raise RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading", retry_after=1, retryable=True)
        return state.hub

    def sse_response(hub: Hub, log_: Any, after: int | None, headers: dict[str, str] | None = None) -> Response:
        reader = log_.reader()
        reader.__enter__()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                reader.__exit__(None, None, None)

        request.scope.setdefault(_CLEANUPS, []).append(release)

        async def body() -> AsyncIterator[bytes]:
            try:
                async with aclosing(hub.stream(log_, after)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except ReaderLagged:
                pass  # the client resumes with Last-Event-ID and gets a defined answer
            finally:
                release()

        resp = Response(body(), 200, headers={**SSE_HEADERS, **(headers or {})})
        resp.timeout = None
        return resp

    async def generate(surface: Surface) -> Response:
        try:
            hub = hub_or_unavailable()
            raw = await request.get_data()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise RingserveError(ErrorKind.INVALID_REQUEST, f"request body is not valid JSON: {exc}") from None
            parsed = surface.parse_request(body)
            if config.model.strict_model_name and parsed.model and parsed.model != state.model_id:
                raise RingserveError(ErrorKind.NOT_FOUND, f"model {parsed.model[:100]!r} is not served here", param="model")
            prefer = {p.strip().split("=")[0].lower() for p in request.headers.get("Prefer", "").split(",")}
            respond_async = "respond-async" in prefer
            policy = "continue" if respond_async else getattr(config.policy, surface.name)
            override = request.headers.get("Ringserve-Disconnect-Policy")
            if override is not None:
                if override not in ("abort", "continue"):
                    raise RingserveError(
                        ErrorKind.INVALID_REQUEST, "Ringserve-Disconnect-Policy must be 'abort' or 'continue'"
                    )
                policy = override
            key = request.headers.get("Idempotency-Key")
            if key is not None and not (0 < len(key) <= 255 and key.isprintable()):
                raise RingserveError(ErrorKind.INVALID_REQUEST, "Idempotency-Key must be 1-255 printable characters")
            msg, _created = await hub.create(
                surface,
                parsed,
                body_hash=request_hash(raw),
                request_json=raw.decode("utf-8", "replace"),
                policy=policy,
                idempotency_key=key,
            )
            if respond_async:
                location = f"/v1/messages/{msg.id}"
                payload = {"id": msg.id, "status": msg.status, "url": location, "stream_url": f"{location}/stream"}
                return _json(payload, 202, {"Location": location, "Preference-Applied": "respond-async"})
            if isinstance(msg, StoredMessage):
                return stored_answer(surface, msg, parsed.stream)
            if parsed.stream:
                return sse_response(hub, msg.log, None, {"X-Message-Id": msg.id})
            with msg.log.reader():
                await msg.done.wait()
            return finished_answer(surface, msg)
        except RingserveError as exc:
            return _error_response(surface, exc)

    def finished_answer(surface: Surface, msg: LiveMessage) -> Response:
        if msg.status == "failed":
            kind = ErrorKind.UNAVAILABLE if msg.cancel_reason == CancelReason.DRAIN else ErrorKind.API_ERROR
            return _error_response(surface, RingserveError(kind, msg.error or "generation failed", retryable=True))
        return _json(surface.message_json(msg.result()), headers={"X-Message-Id": msg.id})

    def stored_answer(surface: Surface, msg: StoredMessage, stream: bool) -> Response:
        if stream:
            raise RingserveError(
                ErrorKind.GONE, f"the stream of {msg.id} has expired; GET /v1/messages/{msg.id} has the message"
            )
        if msg.status != "complete":
            raise RingserveError(ErrorKind.CONFLICT, f"message {msg.id} is {msg.status}")
        result = MessageResult(msg.id, msg.model, msg.created, msg.text, msg.stop_reason, msg.stop_sequence,
                               Usage(msg.input_tokens, msg.output_tokens))
        return _json(surface.message_json(result), headers={"X-Message-Id": msg.id})

    def surface_of(message_id: str) -> Surface:
        return OPENAI if message_id.startswith(OPENAI.id_prefix) else ANTHROPIC

    @app.post("/v1/messages")
    async def anthropic_messages() -> Response:
        return await generate(ANTHROPIC)

    @app.post("/v1/chat/completions")
    async def openai_chat_completions() -> Response:
        return await generate(OPENAI)

    @app.get("/v1/messages/<message_id>")
    async def get_message(message_id: str) -> Response:
        try:
            return _json(message_status_json(hub_or_unavailable().lookup(message_id)))
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)

    @app.get("/v1/messages/<message_id>/stream")
    async def resume_stream(message_id: str) -> Response:
        try:
            hub = hub_or_unavailable()
            last = request.headers.get("Last-Event-ID")
            if last is None:
                last = request.args.get("last_event_id")
            log_, after = hub.open_log(message_id, last or None)
            return sse_response(hub, log_, after, {"X-Message-Id": message_id})
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)

    @app.post("/v1/messages/<message_id>/cancel")
    async def cancel_message(message_id: str) -> Response:
        try:
            hub = hub_or_unavailable()
            msg = hub.lookup(message_id)
            if isinstance(msg, LiveMessage):
                hub.cancel(msg, CancelReason.REQUESTED)
                await msg.done.wait()
            return _json(message_status_json(msg))
        except RingserveError as exc:
            return _error_response(surface_of(message_id), exc)

    @app.get("/v1/models")
    async def models() -> Response:
        if state.hub is None:
            return _error_response(OPENAI, RingserveError(ErrorKind.UNAVAILABLE, "the model is still loading"))
        item = {
            "id": state.model_id,
            "object": "model",
            "type": "model",
            "created": int(state.started),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started)),
            "display_name": state.model_id,
            "owned_by": "ringserve",
        }
        return _json({"object": "list", "data": [item], "has_more": False,
                      "first_id": state.model_id, "last_id": state.model_id})

    @app.get("/health")
    async def health() -> Response:
        if state.hub is None:
            return _json({"status": "loading"}, 503)
        return _json({"status": "ok", "model": state.model_id})

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        kinds = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.INVALID_REQUEST, 413: ErrorKind.REQUEST_TOO_LARGE}
        kind = kinds.get(exc.code or 500, ErrorKind.INVALID_REQUEST if (exc.code or 500) < 500 else ErrorKind.API_ERROR)
        surface = OPENAI if request.path.startswith("/v1/chat") else ANTHROPIC
        resp = _error_response(surface, RingserveError(kind, exc.description or exc.name))
        resp.status_code = exc.code or 500
        return resp

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        surface = OPENAI if request.path.startswith("/v1/chat") else ANTHROPIC
        return _error_response(surface, RingserveError(ErrorKind.API_ERROR, "internal server error"))

    return app
