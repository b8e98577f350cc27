"""The routes of one message, whatever its surface: its status, its stream, a stream token, cancel.

:func:`resume` is the one resume: ``GET /v1/messages/{id}/stream`` here and
``GET /v1/responses/{id}?stream=true`` (``http/responses.py``) both answer
through it, so both are counted in ``ringserve_resumes_total`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quart import Response, request

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.view import MessageView
from ringserve.http import context
from ringserve.http.context import answering_errors, error_response, json_response
from ringserve.live.hub import Hub
from ringserve.live.resume import StreamEnded
from ringserve.surfaces import ringserve as ringserve_json
from ringserve.surfaces.base import Surface


def message_status_json(hub: Hub, view: MessageView) -> dict[str, Any]:
    """``GET /v1/messages/{id}``: the message's status, text and content blocks (so far, in its
    surface's shape: ``Hub.surface_of``), stop reason and usage (``surfaces/ringserve.py``)."""
    return ringserve_json.message_status_json(view, hub.surface_of(view))


async def resume(surface: Surface, message_id: str, last_event_id: str | None,
                 errors: Callable[[RingserveError], RingserveError] = lambda error: error) -> Response:
    """The stream of ``message_id`` after ``last_event_id`` (None: from its start), counted in
    ``ringserve_resumes_total`` by its result; 204 after the terminal event (on which a browser
    ``EventSource`` stops reconnecting). An error is answered in ``surface``'s shape, as
    ``errors`` spells it (the Responses routes name their own parameter and route)."""
    record, metrics = context.access(), context.state().metrics
    record.message_id, record.resume = message_id, True
    try:
        hub = context.hub()
        log, after = await hub.resume.open_log(message_id, last_event_id)
        context.admit_reader(log.readers)
    except StreamEnded:
        metrics.resumed("ended")
        return Response(b"", 204, headers={"X-Message-Id": message_id})
    except RingserveError as exc:
        metrics.resumed("expired" if exc.kind is ErrorKind.GONE else "rejected")
        return error_response(surface, errors(exc))
    metrics.resumed("ok")
    return context.sse_response(hub, log, after, message_id)


@answering_errors
async def get_message(message_id: str) -> Response:
    """``GET /v1/messages/{id}``: ringserve's status of any message (``surfaces/ringserve.py``)."""
    hub = context.hub()
    return json_response(message_status_json(hub, await hub.find(message_id)))


async def resume_stream(message_id: str) -> Response:
    """``GET /v1/messages/{id}/stream``: the stream after ``Last-Event-ID`` (or ``?last_event_id=``)."""
    last = request.headers.get("Last-Event-ID")
    if last is None:
        last = request.args.get("last_event_id")
    return await resume(context.request_surface(), message_id, last or None)


@answering_errors
async def issue_stream_token(message_id: str) -> Response:
    """A short-lived token that lets ``GET .../stream?stream_token=`` read this one message."""
    context.access().message_id = message_id
    await context.hub().find(message_id)
    return json_response(ringserve_json.stream_token_json(context.stream_token(message_id)))


@answering_errors
async def cancel_message(message_id: str) -> Response:
    """``POST /v1/messages/{id}/cancel``: cancel it (here or on its replica), answer its status once ended."""
    hub = context.hub()
    return json_response(message_status_json(hub, await hub.ended(await hub.find(message_id))))
