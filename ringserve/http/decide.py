"""The POST decision, without I/O: what a generation request gets, as a value.

A ``POST`` on any surface's generation route (``/v1/messages``,
``/v1/chat/completions``, ``/v1/responses``) is decided in two steps, both plain
functions of values; ``http/generate.py`` only maps a decision to a response
(an exhaustive ``match``), and the waiting (the idempotency key's first
attempt, Redis, the generation itself) stays in the hub:

1. :func:`admit` takes the raw body, the headers that steer it
   (:class:`RequestHeaders`) and the config, and gives :class:`Refuse` (the
   body is not JSON or not a valid request, a limit is exceeded, the model
   name is not served, the disconnect-policy override is malformed) or
   :class:`Start` (the parsed request, its disconnect policy, whether the
   client prefers ``respond-async``); a request that continues a stored
   conversation is checked once it is in it (:func:`continued`), and the
   grammars of its freeform tools by :func:`check_grammars`, which the shell
   runs on a worker thread.
   ``Hub.create`` then starts the generation, or finds the message an
   ``Idempotency-Key`` already names.
2. :func:`answer` takes the :class:`Start` and the view of the message
   ``Hub.create`` started or found (``core/view.py``): :class:`Accepted` (202),
   :class:`StreamLive` (its log, from the start: a retry replays it),
   :class:`WaitLive` (then :func:`finished`), :class:`ReplayStored` (the
   stored log of a finished retry), :class:`WaitStored` (a retry of a message
   that another replica still generates: wait for its end, then
   :func:`finished`), :class:`Answer` at once for a ``background`` request, or
   :func:`finished` itself (a stored answer).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any, assert_never

import attrs

from ringserve.config import Config, PolicyConfig
from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import ChatMessage
from ringserve.core.lark import LarkGrammarError
from ringserve.core.lark import check as check_lark
from ringserve.core.limits import check_request
from ringserve.core.prefer import parse_prefer
from ringserve.core.status import MessageStatus, Policy
from ringserve.core.view import MessageView
from ringserve.surfaces.base import ParsedRequest, Surface, read_request
from ringserve.surfaces.registry import SURFACES

def request_hash(body: bytes) -> str:
    """Fingerprint of a request body, for ``Idempotency-Key`` checks (hex SHA-256)."""
    return hashlib.sha256(body).hexdigest()


def turn_hash(body: Any) -> str:
    """Fingerprint of a request body's JSON value whatever the order of its objects' keys (hex
    SHA-256 of its canonical JSON): Codex's retry of a turn sends its ``client_metadata``, a map,
    in another order."""
    canonical = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


#: The preference (RFC 7240 §4.1) that asks for a 202 and the message's URL instead of the answer.
RESPOND_ASYNC = "respond-async"

#: The request headers that name a client's session, the first one present wins: Claude Code's
#: (one UUID per session), then Codex CLI's (``session-id`` and ``x-client-request-id`` both hold
#: its session UUID); docs/agents.md. An identical request under the same session is a retry of
#: the same turn (``live/idempotency.py`` ``SessionTurns``).
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-client-request-id")


@attrs.frozen
class RequestHeaders:
    """The request headers that steer the decision, as values.

    Attributes:
        prefer: every ``Prefer`` header line, in order (RFC 7240 allows several).
        idempotency_key: ``Idempotency-Key``, as sent (``Hub.create`` checks it).
        disconnect_policy: ``Ringserve-Disconnect-Policy``: ``abort`` or ``continue``.
        session: the client's session, from the first of :data:`SESSION_HEADERS` it sent.
    """

    prefer: tuple[str, ...] = ()
    idempotency_key: str | None = None
    disconnect_policy: str | None = None
    session: str | None = None


@attrs.frozen
class Refuse:
    """Answer with ``error`` in the surface's error shape (the error carries its status)."""

    error: RingserveError


@attrs.frozen
class Start:
    """A valid request: hand it to ``Hub.create``.

    Attributes:
        parsed: the surface's parse of the body.
        policy: what the message does when its last reader leaves.
        respond_async: the client prefers a 202 (``Prefer: respond-async``).
        idempotency_key: as sent, for ``Hub.create``.
        turn: the client's session (its header) and the body's :func:`turn_hash`, for
            ``Hub.create`` (an identical retry of the turn attaches); None without a session.
        body_hash: the body's SHA-256 (``hub.request_hash``): a key reused with another body is a 422.
        request_json: the body as text, for the store.
    """

    parsed: ParsedRequest
    policy: Policy
    respond_async: bool
    idempotency_key: str | None
    turn: str | None
    body_hash: str
    request_json: str


@attrs.frozen
class Accepted:
    """202 with the message's URL and a stream token (``Prefer: respond-async``), new or retried."""

    message: MessageView


@attrs.frozen
class StreamLive:
    """The live message's log as SSE from its first event (for a retry: a replay, then live)."""

    message: MessageView


@attrs.frozen
class WaitLive:
    """Wait for the live message to end (as a reader, so ``abort`` does not fire), then :func:`finished`."""

    message: MessageView


@attrs.frozen
class ReplayStored:
    """A streaming retry of a message not live here: its log from the start (410 once the log expired)."""

    message: MessageView


@attrs.frozen
class WaitStored:
    """A JSON retry of a message another replica is generating: wait for its end (``Hub.settled``),
    then :func:`finished`."""

    message: MessageView


@attrs.frozen
class Answer:
    """The message as the surface's non-stream JSON (its object: a ``background`` request's at once,
    whatever its status)."""

    message: MessageView


#: What :func:`answer` (and :func:`finished`) decide.
Decision = Accepted | StreamLive | WaitLive | ReplayStored | WaitStored | Answer | Refuse


def disconnect_policy(policies: PolicyConfig, surface: Surface, *, respond_async: bool, override: str | None) -> Policy:
    """The disconnect policy of a new message.

    ``Ringserve-Disconnect-Policy`` wins; else ``Prefer: respond-async`` means
    ``continue`` (nobody is reading yet); else the surface's ``[policy]`` setting
    (``Surfaces.policy``: the key named like the surface).

    Raises:
        RingserveError: ``INVALID_REQUEST`` for an override other than ``abort``/``continue``.
    """
    if override is not None:
        if override not in tuple(Policy):
            raise RingserveError(ErrorKind.INVALID_REQUEST, "Ringserve-Disconnect-Policy must be 'abort' or 'continue'")
        return Policy(override)
    if respond_async:
        return Policy.CONTINUE
    return SURFACES.policy(policies, surface)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only a body holding one can hold a lone surrogate."""


def parse_json(raw: bytes, *, refuse_lone_surrogates: bool = False) -> Any:
    """The JSON value of a request body.

    Raises:
        RingserveError: ``INVALID_REQUEST``: not JSON; or, with ``refuse_lone_surrogates``
            (``Surface.refuses_lone_surrogates``), a body holding a lone surrogate, which UTF-8
            cannot encode.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RingserveError(ErrorKind.INVALID_REQUEST, f"request body is not valid JSON: {exc}") from None
    if refuse_lone_surrogates and _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("request body holds a lone surrogate (a \\uD800-\\uDFFF escape that is not"
                          " half of a pair), which UTF-8 cannot encode") from None
    return body


def checked(parsed: ParsedRequest, config: Config, model_id: str) -> ParsedRequest:
    """``parsed``, once it is within ``[limits]`` and ``[model] strict_model_name``.

    Raises:
        RingserveError: ``INVALID_REQUEST`` (over a limit) or ``NOT_FOUND`` (a model that is not
            served, with ``strict_model_name``).
    """
    limits = config.limits
    check_request(parsed.request, max_messages=limits.max_messages, max_text_chars=limits.max_message_chars)
    if config.model.strict_model_name and parsed.model and parsed.model != model_id:
        raise RingserveError(ErrorKind.NOT_FOUND, f"model {parsed.model[:100]!r} is not served here", param="model")
    return parsed


def check_grammars(parsed: ParsedRequest) -> None:
    """The grammars of ``parsed``'s freeform tools (``ParsedRequest.grammars``), checked as
    ``core/lark.py`` ``check`` checks them: translated, and taken by llama.cpp's grammar sampler.
    It blocks for a time that grows with the grammars (up to ``core/lark.py`` ``MAX_CHARS``
    characters each): the shell runs it on a worker thread.

    Raises:
        RingserveError: ``INVALID_REQUEST`` naming ``tools``, the message the grammar's field
            (``tools[0].format.definition: ...``) and why.
    """
    for where, grammar in parsed.grammars:
        try:
            check_lark(grammar)
        except LarkGrammarError as exc:
            raise invalid(f"{where}: {exc}", param="tools") from None


def parse_body(surface: Surface, parse: Callable[[Any], ParsedRequest], raw: bytes, config: Config,
               model_id: str) -> ParsedRequest:
    """The request in ``raw``, parsed by ``parse`` (``surface``'s ``parse_request`` or
    ``parse_count``) and :func:`checked`; a request that continues a stored conversation is
    checked once that is in it (:func:`continued`). The fields it accepted and ignored are in its
    ``ignored``, and the reasoning it was handed back is restored where its signature verifies
    (``surfaces/base.py`` ``read_request``).

    Raises:
        RingserveError: as :func:`parse_json`, ``parse`` and :func:`checked`.
    """
    body = parse_json(raw, refuse_lone_surrogates=surface.refuses_lone_surrogates)
    parsed = read_request(parse, body, config.server.signing_key)
    return parsed if parsed.continues is not None else checked(parsed, config, model_id)


def continued(parsed: ParsedRequest, history: tuple[ChatMessage, ...], config: Config, model_id: str) -> ParsedRequest:
    """A request that continues a stored conversation, with ``history`` (its conversation, read by
    ``parsed.continues.history``) in it, then :func:`checked`.

    Raises:
        RingserveError: the request does not fit the conversation (an answer to no call of it), or
            as :func:`checked`.
    """
    assert parsed.continues is not None, "the request continues no conversation"
    return checked(attrs.evolve(parsed.continues.apply(history), ignored=parsed.ignored), config, model_id)


def admit(surface: Surface, raw: bytes, headers: RequestHeaders, config: Config, model_id: str) -> Start | Refuse:
    """Decide whether a generation request may start, and how.

    Checks, in order: the body is JSON (and, on a surface that echoes request fields, holds no
    lone surrogate) and a valid request of ``surface`` (``Surface.parse_request``); ``[limits]``
    ``max_messages`` and ``max_message_chars`` (``core/limits.py``); with ``[model]
    strict_model_name``, a ``model`` other than ``model_id`` is a 404 (both once the stored
    conversation a request continues is in it: :func:`continued`); a malformed
    ``Ringserve-Disconnect-Policy`` is a 400.

    ``Prefer: respond-async`` (on a surface that takes it) and the request's own ``background``
    make the disconnect policy ``continue``.

    Args:
        surface: the route's surface.
        raw: the request body as received.
        headers: the headers that steer the request.
        config: the server config (``limits``, ``model``, ``policy`` are read).
        model_id: the served model's id.

    Returns:
        :class:`Start`, or :class:`Refuse` with the first failed check's error.
    """
    try:
        parsed = parse_body(surface, surface.parse_request, raw, config, model_id)
        prefer = surface.prefer_respond_async and RESPOND_ASYNC in parse_prefer(",".join(headers.prefer))
        policy = disconnect_policy(
            config.policy, surface, respond_async=prefer or parsed.background, override=headers.disconnect_policy
        )
    except RingserveError as exc:
        return Refuse(exc)
    return Start(
        parsed=parsed,
        policy=policy,
        respond_async=prefer,
        idempotency_key=headers.idempotency_key,
        turn=None if headers.session is None else f"{headers.session[:200]}:{turn_hash(json.loads(raw))}",
        body_hash=request_hash(raw),
        request_json=raw.decode("utf-8", "replace"),
    )


def answer(start: Start, message: MessageView) -> Decision:
    """What a started request gets, given the view of the message ``Hub.create`` started or found.

    ``Hub.create`` gives a live message (new, or a retry of one still
    generating here) or, for an idempotent retry, the one its key names
    elsewhere (complete or cancelled; or ``queued``/``generating`` on another
    replica, which a JSON retry waits for: :class:`WaitStored`): a failed or
    interrupted one is generated again by ``Hub.create`` itself.
    """
    if start.respond_async:
        return Accepted(message)
    if start.parsed.background and not start.parsed.stream:
        return Answer(message)  # the object at once, whatever its status
    if message.live:
        return StreamLive(message) if start.parsed.stream else WaitLive(message)
    if start.parsed.stream:
        return ReplayStored(message)
    if not message.status.final:
        return WaitStored(message)
    return finished(message)


def finished(message: MessageView) -> Answer | Refuse:
    """The non-stream answer of a message that has ended (here, or on another replica while a retry
    waited for it): complete and cancelled ones are answered; a failed or interrupted one is the
    error its first attempt's client got (:func:`generation_error`); one still ``queued`` or
    ``generating`` (its end was not seen) is a 409 naming its status."""
    match message.status:
        case MessageStatus.COMPLETE | MessageStatus.CANCELLED:
            return Answer(message)
        case MessageStatus.FAILED | MessageStatus.INTERRUPTED:
            return generation_error(message.error, interrupted=message.status is MessageStatus.INTERRUPTED)
        case MessageStatus.QUEUED | MessageStatus.GENERATING:
            return Refuse(RingserveError(ErrorKind.CONFLICT, f"message {message.id} is {message.status.value}"))
        case _:
            assert_never(message.status)


def generation_error(error: str | None, *, interrupted: bool) -> Refuse:
    """The non-stream answer of a generation that failed (``error``, the message's own): a 500
    ``api_error``; one interrupted (by the drain, or the death of the replica that generated it)
    a 503; both retryable. The same for the first attempt and every ``Idempotency-Key`` retry
    that waited for it, on any replica."""
    kind = ErrorKind.UNAVAILABLE if interrupted else ErrorKind.API_ERROR
    return Refuse(RingserveError(kind, error or "generation failed", retryable=True))
