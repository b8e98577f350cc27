"""The one generation path: ``POST`` on any surface's generation or counting route.

:func:`generate` serves every route of ``SURFACES.routes`` (``/v1/messages``,
``/v1/chat/completions``, ``/v1/responses``): :func:`~ringserve.http.decide.admit`
decides from the body and the headers, the stored conversation a request
continues is read off the event loop (:func:`history`), and so are the grammars
of its freeform tools checked (:func:`_checked`), ``Hub.create`` starts
the generation or finds the one its ``Idempotency-Key`` names, and
:func:`respond` maps :func:`~ringserve.http.decide.answer`'s decision to the
response. What differs between surfaces is in the surface (its parse, its
objects, whether it takes ``Prefer: respond-async``), never in a branch here.
:func:`count_tokens` serves ``SURFACES.counts`` the same way, :func:`render_prompt`
``SURFACES.renders``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_never

import attrs
import trio
from quart import Response

from ringserve.core.errors import RingserveError
from ringserve.core.events import ChatMessage, GenerationRequest
from ringserve.http import context
from ringserve.http.context import error_response, json_response, object_surface
from ringserve.http.decide import (
    RESPOND_ASYNC,
    Accepted,
    Answer,
    Decision,
    Refuse,
    ReplayStored,
    StreamLive,
    WaitLive,
    WaitStored,
    admit,
    answer,
    check_grammars,
    continued,
    finished,
    parse_body,
)
from ringserve.live.hub import Hub
from ringserve.live.message import LiveMessage
from ringserve.logs.memory import store_unavailable
from ringserve.surfaces import ringserve as ringserve_json
from ringserve.surfaces.base import Continuation, Counting, ParsedRequest, Surface
from ringserve.surfaces.ringserve import message_url


async def history(hub: Hub, continuation: Continuation) -> tuple[ChatMessage, ...]:
    """The stored conversation a request continues, read on a worker thread (the stored bodies it
    parses may be many and large), bounded by ``server.max_body_bytes`` in all."""
    max_bytes = context.state().config.server.max_body_bytes
    return await trio.to_thread.run_sync(continuation.history, hub.stored_request, max_bytes)


async def _whole(hub: Hub, parsed: ParsedRequest) -> ParsedRequest:
    """``parsed`` with the conversation it continues in it (``decide.continued``), or as it is,
    its grammars checked (:func:`_checked`).

    Raises:
        RingserveError: as ``decide.continued`` and ``decide.check_grammars``.
    """
    await _checked(parsed)
    if parsed.continues is None:
        return parsed
    config = context.state().config
    return continued(parsed, await history(hub, parsed.continues), config, context.state().model_id)


async def _checked(parsed: ParsedRequest) -> None:
    """``decide.check_grammars`` on a worker thread: translating a grammar takes a time that
    grows with it, which the event loop, and every stream on it, must not wait for.

    Raises:
        RingserveError: as ``decide.check_grammars``.
    """
    if parsed.grammars:
        await trio.to_thread.run_sync(check_grammars, parsed)


async def generate(surface: Surface) -> Response:
    """``POST`` on ``surface``'s generation route: ``admit``, ``Hub.create``, then :func:`respond`."""
    state = context.state()
    try:
        hub = context.hub()
        if not hub.logs.available:
            raise store_unavailable()
        start = admit(surface, await context.body(), context.request_headers(), state.config, state.model_id)
        if isinstance(start, Refuse):
            return error_response(surface, start.error)
        context.access().note_ignored(start.parsed.ignored)
        start = attrs.evolve(start, parsed=await _whole(hub, start.parsed))
        context.admit_reader()
        created = await hub.create(surface, start.parsed, body_hash=start.body_hash, request_json=start.request_json,
                                   policy=start.policy, idempotency_key=start.idempotency_key,
                                   turn=start.turn)
    except RingserveError as exc:
        return error_response(surface, exc)
    live = created.live
    context.access().message_id = created.view.id
    if not start.parsed.store and live is not None:
        context.on_request_end(lambda: hub.delete_when_done(live))  # deleted once generated, read or not
    return await respond(hub, surface, answer(start, created.view), live)


async def respond(hub: Hub, surface: Surface, decision: Decision, live: LiveMessage | None = None) -> Response:
    """The response to a started request's :data:`Decision`: the one map from decisions to responses.
    ``live`` is the message's handle when it is live here (:class:`StreamLive`, :class:`WaitLive`)."""
    match decision:
        case Refuse():
            return error_response(surface, decision.error)
        case Accepted(message=msg):
            headers = {"Location": message_url(msg.id), "Preference-Applied": RESPOND_ASYNC, "X-Message-Id": msg.id}
            return json_response(ringserve_json.accepted_json(msg.status, context.stream_token(msg.id)), 202, headers)
        case StreamLive(message=msg):
            assert live is not None, "a live decision comes with the live message"
            return context.sse_response(hub, live.open_log, None, msg.id)
        case ReplayStored(message=stored):
            try:
                log, after = await hub.resume.open_log(stored.id, None)  # GONE once the log expired
            except RingserveError as exc:
                return error_response(surface, exc)
            return context.sse_response(hub, log, after, stored.id)
        case WaitStored(message=stored):
            try:
                stored = await hub.settled(stored)  # generated on another replica: wait for its end
            except RingserveError as exc:
                return error_response(surface, exc)
            return await respond(hub, surface, finished(stored))
        case WaitLive():
            assert live is not None, "a live decision comes with the live message"
            with live.open_log.reader():  # a reader, so that the abort policy does not fire
                await live.done.wait()
            return await respond(hub, surface, finished(live.view()))
        case Answer(message=msg):
            return json_response(object_surface(msg).message_json(msg), headers={"X-Message-Id": msg.id})
        case _:
            assert_never(decision)


async def _prompt_request(hub: Hub, surface: Surface, parse: Callable[[Any], ParsedRequest]) -> GenerationRequest:
    """The generation request of a counting or render route's body, parsed by ``parse`` (the
    conversation it continues in it), its ignored fields noted.

    Raises:
        RingserveError: as ``decide.parse_body`` and ``decide.continued``.
    """
    state = context.state()
    parsed = parse_body(surface, parse, await context.body(), state.config, state.model_id)
    context.access().note_ignored(parsed.ignored)
    return (await _whole(hub, parsed)).request


async def count_tokens(surface: Counting) -> Response:
    """``POST`` on ``surface``'s counting route: the prompt the same generation request would be
    given, in tokens (system prompt, tools and output format included; its usage's ``input_tokens``).
    Nothing is generated; a prompt longer than a slot is counted too (the generation route refuses
    it). It is tokenized apart from the generations' prepares (``Runner.count``), so a burst of
    counts does not queue behind them."""
    try:
        hub = context.hub()
        count = await hub.runner.count(await _prompt_request(hub, surface, surface.parse_count))
    except RingserveError as exc:
        return error_response(surface, exc)
    return json_response(surface.count_json(count.input_tokens, count.original_input_tokens))


async def render_prompt(surface: Surface) -> Response:
    """``POST`` on ``surface``'s render route (``SURFACES.renders``): the body of a generation
    request of that surface, answered with the prompt it would be given (``Runner.render``: the
    model's chat template's text, its tokens; ``surfaces/ringserve.py`` ``prompt_json``), as
    llama-server's ``POST /apply-template``. Nothing is generated; the prompt may be longer than a
    slot. A request the template cannot render is the surface's 400, as on its generation route."""
    try:
        hub = context.hub()
        prompt = await hub.runner.render(await _prompt_request(hub, surface, surface.parse_request))
    except RingserveError as exc:
        return error_response(surface, exc)
    return json_response(ringserve_json.prompt_json(prompt.text, len(prompt.tokens), prompt.reasoning_open))
