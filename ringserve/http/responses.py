"""The OpenAI Responses API routes, over the same hub, ring logs, store and runner as the others.

A response is a message of the ``responses`` surface with an id ``resp_...``:
its producer, log, disconnect policy, resume and stored row are the hub's.

- ``POST /v1/responses``: plain (the Response object once it ended), ``stream``
  (the event stream), ``background`` (the Response object at once, status
  ``queued``; policy ``continue``, like ``Prefer: respond-async``), and
  ``background`` + ``stream`` (the event stream; a reader that leaves does not
  cancel it).
- ``GET /v1/responses/{id}``: the Response object; with ``stream=true`` the
  events after ``starting_after=N`` (or after ``Last-Event-ID``, which wins, as a
  browser ``EventSource`` reconnecting sends it; ``?stream_token=`` as on
  ``/v1/messages/{id}/stream``): replay, then tail to the terminal event.
- ``POST /v1/responses/{id}/cancel``: cancel a background response; the object
  after it ended. Idempotent: a cancelled one answers the same object again. A
  foreground response is a 400, and so is one that ended otherwise.
- ``DELETE /v1/responses/{id}``: cancel it if it runs, then delete its row and
  its log; GET is then 404.
- ``POST /v1/responses/input_tokens``: ``{"object": "response.input_tokens",
  "input_tokens": N}``, N the prompt tokens the same create would have.

``previous_response_id`` prepends the stored conversation of that response (its
own previous ones first, then its input turns and its output: text and function
calls; not its ``instructions``, as OpenAI documents); a ``function_call_output``
may answer a call of any response of the chain. It needs the stored request bodies
(``[store] keep_prompts``, true by default).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from quart import Response, request

from ringserve.config import Config
from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import ChatMessage
from ringserve.core.limits import check_request
from ringserve.core.ringlog import format_event_id
from ringserve.core.status import FINAL_STATUSES, MessageStatus
from ringserve.core.view import MessageView
from ringserve.http.decide import Refuse, disconnect_policy, finished
from ringserve.live.hub import Hub, StreamEnded, request_hash
from ringserve.logs.memory import store_unavailable
from ringserve.surfaces.base import Surface
from ringserve.surfaces.responses import (
    RESPONSES,
    ResponseCreate,
    ResponsesSurface,
    history_messages,
    parse_count,
    options_echo,
    parse_create,
    stored_create,
)

#: The most responses a ``previous_response_id`` chain may go back.
MAX_CHAIN = 256


@attrs.frozen
class RouteKit:
    """What the routes borrow from ``app.create_app``: its closures and helpers.

    Attributes:
        config: the server config.
        hub: the hub, or a 503 while the model loads.
        sse_response: ``(hub, log, after, message_id) -> Response``, one reader of ``log``.
        admit_reader: count this request as a reader of its client (``message_readers``: the
            log's readers now); 429 over the limits.
        error_response: ``(surface, error) -> Response`` in the surface's error shape.
        json_response: ``(obj, status, headers) -> Response``.
        note_message: note the message id for the access log.
        on_request_end: run a function once the request's ASGI call returns.
    """

    config: Config
    hub: Callable[[], Hub]
    sse_response: Callable[..., Response]
    admit_reader: Callable[..., None]
    error_response: Callable[[Surface, RingserveError], Response]
    json_response: Callable[..., Response]
    note_message: Callable[[str], None]
    on_request_end: Callable[[Callable[[], None]], None]


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only a body holding one can hold a lone surrogate."""

def _not_found(response_id: str) -> RingserveError:
    """OpenAI's 404 for an unknown response (``Response with id '...' not found.``), with why."""
    return RingserveError(ErrorKind.NOT_FOUND, f"Response with id {response_id[:80]!r} not found: the id is unknown,"
                          " was deleted, or passed the store's retention ([store] max_age_seconds, max_bytes)")


def response_object(msg: MessageView) -> dict[str, Any]:
    """The Response object of a live or stored message (usage once it ended)."""
    return RESPONSES.restored(msg.echo).message_json(msg)


def _history(hub: Hub, previous_id: str) -> tuple[ChatMessage, ...]:
    """The conversation a ``previous_response_id`` continues: oldest response first.

    Raises:
        RingserveError: ``NOT_FOUND`` (unknown id), ``INVALID_REQUEST`` (still running, its
        request not kept, a chain longer than :data:`MAX_CHAIN` or a loop).
    """
    turns: list[tuple[ChatMessage, ...]] = []
    seen: set[str] = set()
    next_id: str | None = previous_id
    while next_id is not None:
        if next_id in seen or len(seen) >= MAX_CHAIN:
            raise invalid(f"previous_response_id: the chain of previous responses is longer than {MAX_CHAIN}",
                          param="previous_response_id")
        seen.add(next_id)
        if not next_id.startswith(RESPONSES.id_prefix):
            raise RingserveError(ErrorKind.NOT_FOUND, f"previous_response_id: {_not_found(next_id)}",
                                 param="previous_response_id")
        try:
            msg = None if hub.live(next_id) is not None else hub.stored(next_id)
        except RingserveError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:
                raise
            raise RingserveError(ErrorKind.NOT_FOUND, f"previous_response_id: {_not_found(next_id)}",
                                 param="previous_response_id") from None
        if msg is None or msg.status not in FINAL_STATUSES:
            raise invalid(f"previous_response_id: response {next_id} is still in progress",
                          param="previous_response_id")
        create = stored_create(msg.request)
        if create is None:
            raise invalid(f"previous_response_id: the input of {next_id} is not kept ([store] keep_prompts = false)",
                          param="previous_response_id")
        turns.append(create.input + history_messages(msg.blocks, next_id))
        next_id = create.options.previous_response_id
    return tuple(m for turn in reversed(turns) for m in turn)


def _starting_after(raw: str | None, response_id: str) -> str | None:
    """``starting_after`` as the ``Last-Event-ID`` it stands for; 400 unless a non-negative integer."""
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit():
        raise invalid(f"starting_after: must be a non-negative integer, got {raw[:40]!r}", param="starting_after")
    return format_event_id(response_id, int(raw))


def register_responses(app: Any, kit: RouteKit) -> None:
    """Add the Responses routes to the quart-trio ``app``."""
    config = kit.config

    def answering_errors(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        """A route whose ``RingserveError`` is answered in OpenAI's error shape."""

        @functools.wraps(handler)  # Quart names the endpoint after the function (``authenticate`` reads it)
        async def route(*args: Any, **kwargs: Any) -> Response:
            try:
                return await handler(*args, **kwargs)
            except RingserveError as exc:
                return kit.error_response(RESPONSES, exc)

        return route

    async def find(response_id: str) -> MessageView:
        """The live or stored response (``NOT_FOUND`` for an id of another surface)."""
        if not response_id.startswith(RESPONSES.id_prefix):
            raise _not_found(response_id)
        try:
            msg = await kit.hub().find(response_id)
        except RingserveError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:
                raise
            raise _not_found(response_id) from None
        if msg.surface != RESPONSES.name:
            raise _not_found(response_id)
        return msg

    async def parsed_body() -> tuple[bytes, Any]:
        raw = await request.get_data(cache=True, as_text=False, parse_form_data=False)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise invalid(f"request body is not valid JSON: {exc}") from None
        if _SURROGATE_ESCAPE.search(raw):
            # The Response object echoes fields (metadata, tools, ...) and the store keeps them as
            # UTF-8 text: a lone surrogate, which UTF-8 cannot encode, is refused here, not a 500 there.
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise invalid("request body holds a lone surrogate (a \\uD800-\\uDFFF escape that is not"
                              " half of a pair), which UTF-8 cannot encode") from None
        return raw, body

    def generation(hub: Hub, create: ResponseCreate) -> Any:
        history = () if create.options.previous_response_id is None else _history(hub, create.options.previous_response_id)
        parsed = create.generation(history)
        limits = config.limits
        check_request(parsed.request, max_messages=limits.max_messages, max_text_chars=limits.max_message_chars)
        if config.model.strict_model_name and parsed.model and parsed.model != hub.runner.model_id:
            raise RingserveError(ErrorKind.NOT_FOUND, f"model {parsed.model[:100]!r} is not served here", param="model")
        return parsed

    @app.post("/v1/responses")
    @answering_errors
    async def create_response() -> Response:
        hub = kit.hub()
        if not hub.logs.available:
            raise store_unavailable()
        raw, body = await parsed_body()
        create = parse_create(body)
        parsed = generation(hub, create)
        options = create.options
        policy = disconnect_policy(config.policy, RESPONSES, respond_async=options.background,
                                   override=request.headers.get("Ringserve-Disconnect-Policy"))
        kit.admit_reader()
        created = await hub.create(
            ResponsesSurface(options), parsed, body_hash=request_hash(raw),
            request_json=raw.decode("utf-8", "replace"), policy=policy,
            idempotency_key=request.headers.get("Idempotency-Key"),
            echo=options_echo(body, True), kept_echo=options_echo(body, config.store.keep_prompts),
        )
        view, live = created.view, created.live
        kit.note_message(view.id)
        headers = {"X-Message-Id": view.id}
        if live is None:  # an idempotent retry of a finished response
            if parsed.stream:
                log_, after = await hub.open_log(view.id, None)  # GONE once the log expired
                return kit.sse_response(hub, log_, after, view.id)
            return kit.json_response(response_object(view), 200, headers)
        if not options.store:
            kit.on_request_end(lambda: hub.delete_when_done(live))  # store: false
        if parsed.stream:
            return kit.sse_response(hub, live.open_log, None, view.id)
        if options.background:
            return kit.json_response(response_object(view), 200, headers)
        with live.open_log.reader():  # a reader, so that the abort policy does not fire
            await live.done.wait()
        ended = finished(live.view())  # failed and interrupted are errors, as on the other surfaces
        if isinstance(ended, Refuse):
            raise ended.error
        return kit.json_response(response_object(live.view()), 200, headers)

    @app.post("/v1/responses/input_tokens")
    @answering_errors
    async def count_input_tokens() -> Response:
        hub = kit.hub()
        _raw, body = await parsed_body()
        parsed = generation(hub, parse_count(body))
        prepared = await hub.runner.prepare(parsed.request)
        return kit.json_response({"object": "response.input_tokens", "input_tokens": len(prepared.prompt_tokens)})

    @app.get("/v1/responses/<response_id>")
    @answering_errors
    async def retrieve_response(response_id: str) -> Response:
        kit.note_message(response_id)
        hub = kit.hub()
        stream = request.args.get("stream", "false")
        if stream not in ("true", "false"):
            raise invalid("stream: must be true or false", param="stream")
        after_id = _starting_after(request.args.get("starting_after"), response_id)
        msg = await find(response_id)
        if stream == "false":
            if after_id is not None:
                raise invalid("starting_after: only allowed with stream=true", param="starting_after")
            return kit.json_response(response_object(msg), 200)
        last = request.headers.get("Last-Event-ID") or after_id
        try:
            log_, after = await hub.open_log(response_id, last)
        except StreamEnded:  # after the terminal event: 204 makes an EventSource stop reconnecting
            return Response(b"", 204, headers={"X-Message-Id": response_id})
        except RingserveError as exc:
            if exc.kind is ErrorKind.INVALID_REQUEST and last == after_id and after_id is not None:
                raise invalid(f"starting_after: no event {after_id.rsplit(':', 1)[1]} was sent in this stream",
                              param="starting_after") from None
            if exc.kind is ErrorKind.GONE:  # a row written before schema 5, or a live log longer than the ring
                raise RingserveError(ErrorKind.GONE, f"the event log of {response_id} has expired or left the"
                                     f" ring; GET /v1/responses/{response_id} has the response") from None
            raise
        kit.admit_reader(log_.readers)
        return kit.sse_response(hub, log_, after, response_id)

    @app.post("/v1/responses/<response_id>/cancel")
    @answering_errors
    async def cancel_response(response_id: str) -> Response:
        kit.note_message(response_id)
        hub = kit.hub()
        msg = await find(response_id)
        # (a response stored before schema 5 whose request was not kept may have been a background one)
        known = msg.live or msg.echo != ""
        if known and not RESPONSES.restored(msg.echo).options.background:
            raise invalid(f"response {response_id} was not created with background: true; only background"
                          " responses can be cancelled")
        if not msg.live and msg.status is not MessageStatus.CANCELLED and msg.status.final:
            status = response_object(msg)["status"]
            raise invalid(f"response {response_id} is already {status}; only a queued or in-progress response"
                          " can be cancelled")
        return kit.json_response(response_object(await hub.ended(msg)), 200)

    @app.delete("/v1/responses/<response_id>")
    @answering_errors
    async def delete_response(response_id: str) -> Response:
        kit.note_message(response_id)
        hub = kit.hub()
        await hub.ended(await find(response_id))
        hub.store.delete(response_id)
        hub.logs.forget(response_id)
        return kit.json_response({"id": response_id, "object": "response.deleted", "deleted": True}, 200)
