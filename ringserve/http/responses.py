"""The OpenAI Responses API's routes of one response: thin maps onto the routes every surface shares.

A response is a message of the ``responses`` surface with an id ``resp_...``:
``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` are the surface's
generation and counting routes (``http/generate.py``), and its producer, log,
disconnect policy, resume and stored row are the hub's. What is the Responses
API's own is spelled in ``surfaces/responses.py``.

- ``GET /v1/responses/{id}``: the Response object; with ``stream=true`` the
  events after ``starting_after=N`` (or after ``Last-Event-ID``, which wins, as a
  browser ``EventSource`` reconnecting sends it; ``?stream_token=`` as on
  ``/v1/messages/{id}/stream``): replay, then tail to the terminal event
  (``http/messages.py`` ``resume``).
- ``POST /v1/responses/{id}/cancel``: cancel a background response; the object
  after it ended. Idempotent: a cancelled one answers the same object again. A
  foreground response is a 400, and so is one that ended otherwise.
- ``DELETE /v1/responses/{id}``: cancel it if it runs, then delete its row and
  its log, on the replica that made it (with the Redis backend, a delete through
  another replica is relayed, and answered once it is done, or a 503 that says it
  was not); GET is then 404 on every replica.
"""

from __future__ import annotations

from typing import Any

from quart import Response, request

from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.ringlog import format_event_id
from ringserve.core.view import MessageView
from ringserve.http import context
from ringserve.http.context import answering_errors, json_response, object_surface
from ringserve.http.messages import resume
from ringserve.surfaces.responses import RESPONSES, cancel_refusal, not_found, resume_error, starting_after


async def find(response_id: str) -> MessageView:
    """The live or stored response (``NOT_FOUND`` in OpenAI's words, also for another surface's id)."""
    if not response_id.startswith(RESPONSES.id_prefix):
        raise not_found(response_id)
    try:
        view = await context.hub().find(response_id)
    except RingserveError as exc:
        if exc.kind is not ErrorKind.NOT_FOUND:
            raise
        raise not_found(response_id) from None
    if view.surface != RESPONSES.name:
        raise not_found(response_id)
    return view


def response_object(view: MessageView) -> dict[str, Any]:
    """The Response object of a live or stored response (usage once it ended)."""
    return object_surface(view).message_json(view)


@answering_errors
async def retrieve_response(response_id: str) -> Response:
    """``GET /v1/responses/{id}[?stream=true[&starting_after=N]]``."""
    context.access().message_id = response_id
    stream = request.args.get("stream", "false")
    if stream not in ("true", "false"):
        raise invalid("stream: must be true or false", param="stream")
    after = starting_after(request.args.get("starting_after"))
    view = await find(response_id)
    if stream == "false":
        if after is not None:
            raise invalid("starting_after: only allowed with stream=true", param="starting_after")
        return json_response(response_object(view))
    header = request.headers.get("Last-Event-ID")
    last = header or (None if after is None else format_event_id(response_id, after))
    return await resume(RESPONSES, response_id, last,
                        lambda error: resume_error(error, response_id, None if header else after))


@answering_errors
async def cancel_response(response_id: str) -> Response:
    """``POST /v1/responses/{id}/cancel``: a background response, once it ended."""
    context.access().message_id = response_id
    view = await find(response_id)
    if (refusal := cancel_refusal(view)) is not None:
        raise refusal
    return json_response(response_object(await context.hub().ended(view)))


@answering_errors
async def delete_response(response_id: str) -> Response:
    """``DELETE /v1/responses/{id}``: cancelled if it runs, then its row and its log deleted, here or
    on the replica that made it (``Hub.delete_anywhere``; a 503 if it was not)."""
    context.access().message_id = response_id
    await context.hub().delete_anywhere(await find(response_id))
    return json_response(RESPONSES.deleted_json(response_id))
