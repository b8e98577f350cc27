"""The app: :func:`create_app` registers every route (``http/asgi.py`` ``routes``) over a
:class:`~ringserve.http.context.ServerState`, with the authentication that runs before each and
the handlers of the errors no route answered itself."""

from __future__ import annotations

import logging
import sqlite3

from quart import Response, request
from werkzeug.exceptions import HTTPException

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.http import context
from ringserve.http.asgi import RingserveQuart, routes
from ringserve.http.context import ServerState, error_response, request_surface
from ringserve.store.sqlite import store_failed

log = logging.getLogger("ringserve")

def _stream_route() -> bool:
    """Whether this request reads a message's stream, the one thing a ``?stream_token=`` opens:
    ``GET /v1/messages/{id}/stream``, or ``GET /v1/responses/{id}`` with ``stream=true`` (without
    it, the route answers the whole Response object)."""
    if request.endpoint == "resume_stream":
        return True
    return request.endpoint == "retrieve_response" and request.args.get("stream") == "true"


async def authenticate() -> Response | None:
    """Note the route for the access log; refuse /v1 requests without a valid key (401).

    A stream route (``GET /v1/messages/{id}/stream``, ``GET /v1/responses/{id}?stream=true``)
    also takes ``?stream_token=`` for that message, and no other route does. /health, /ready
    and /metrics stay open.
    """
    if request.url_rule is not None:
        context.access().route = request.url_rule.rule
    auth = context.state().auth
    protected = request.path.startswith(("/v1/", "/models"))
    if not auth.enabled or not protected or auth.request_key_ok(request.headers):
        return None
    message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
    token = request.args.get("stream_token")
    if token is not None and _stream_route():
        view_args = request.view_args or {}  # None only when no route matched
        message_id = view_args.get("message_id") or view_args["response_id"]
        if auth.token_ok(token, message_id):
            return None
        message = (
            f"the stream token is invalid, expired or for another message; get a new one with"
            f" POST /v1/messages/{message_id}/stream_token (with the API key), or send the API key"
        )
    resp = error_response(request_surface(), RingserveError(ErrorKind.AUTHENTICATION, message))
    resp.headers["WWW-Authenticate"] = 'Bearer realm="ringserve"'
    return resp


#: HTTP status of a werkzeug error → the kind it is answered as (others: 4xx invalid, 5xx api error).
_HTTP_KINDS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.INVALID_REQUEST, 413: ErrorKind.REQUEST_TOO_LARGE}


async def http_error(exc: HTTPException) -> Response:
    """A werkzeug error (no route, wrong method, body too large) in the request's error shape."""
    code = exc.code or 500
    kind = _HTTP_KINDS.get(code, ErrorKind.INVALID_REQUEST if code < 500 else ErrorKind.API_ERROR)
    message = exc.description or exc.name
    if code == 413:
        limit = context.state().config.server.max_body_bytes
        message = f"the request body is larger than server.max_body_bytes ({limit} bytes)"
    resp = error_response(request_surface(), RingserveError(kind, message))
    resp.status_code = code
    return resp


async def store_error(exc: sqlite3.DatabaseError) -> Response:
    log.exception("message store failed on %s %s", request.method, request.path)
    return error_response(request_surface(), store_failed(exc))


async def internal_error(exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(request_surface(), RingserveError(ErrorKind.API_ERROR, "internal server error"))


def create_app(state: ServerState) -> RingserveQuart:
    """Build the quart-trio app for ``state`` (routes listed in docs/api.md)."""
    app = RingserveQuart("ringserve")
    app.ringserve_state = state
    # Quart's 60 s RESPONSE_TIMEOUT would cut long streams; bodies are bounded by size instead.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = state.config.server.max_body_bytes
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = None  # the playground's files: no stale app.js after an upgrade
    app.before_request(authenticate)
    for rule, method, endpoint, handler in routes():
        app.add_url_rule(rule, endpoint, handler, methods=[method])
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(sqlite3.DatabaseError, store_error)
    app.register_error_handler(Exception, internal_error)
    return app
