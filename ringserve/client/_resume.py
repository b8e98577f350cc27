"""A Python client for ringserve whose streams survive drops: sync :class:`Client`, Trio :class:`AsyncClient`.

Both stream one message, on the Anthropic surface (``POST /v1/messages``),
the OpenAI surface (``POST /v1/chat/completions``), or an existing message
(``GET /v1/messages/{id}/stream``), and hand out each event exactly once::

    with Client("http://127.0.0.1:8080") as client:
        with client.stream("Say hello in French.", max_tokens=64) as stream:
            for text in stream.text_stream:
                print(text, end="", flush=True)
            final = stream.final_message()      # FinalMessage: text, stop_reason, usage

    async with AsyncClient(url) as client:       # under trio.run
        async with client.stream(prompt) as stream:
            async for text in stream.text_stream: ...
            final = await stream.final_message()

How a stream resumes (the decisions live in :class:`ResumeState`, which does
no I/O; the two shells only send what it asks for and feed it what arrives):

* The POST stream itself is the first connection; no ``Prefer:
  respond-async`` round trip first. The message id comes from its
  ``X-Message-Id`` header (or the first event's id). The POST carries an
  ``Idempotency-Key``, so a POST that fails before its headers arrive is
  sent again and gets the same message, replayed from the start. It also
  carries ``Ringserve-Disconnect-Policy: continue``, so a dropped connection
  does not cancel the generation; leaving the stream early instead cancels
  it explicitly (``POST /v1/messages/{id}/cancel``).
* A stream ends only at its terminal event: Anthropic ``message_stop`` or
  ``error``, OpenAI ``[DONE]`` or ``{"error": ...}``. A network error, an
  idle read timeout or a stream that closes before its terminal event is a
  drop: the client waits (exponential backoff with full jitter, see
  :class:`Backoff`; at least ``Retry-After`` on 429/503/529) and reconnects
  with ``GET /v1/messages/{id}/stream`` and ``Last-Event-ID: <id>:<seq>``.
* Event ids are ``<message_id>:<seq>`` with ``seq`` 0, 1, 2, ...; an event
  whose seq was already delivered is dropped, and a seq that skips ahead is
  an error (it would be a gap in the text).
* When the stream log has expired or no longer holds the next event (410),
  or the stream has ended at the last event received (204), the client reads
  ``GET /v1/messages/{id}`` instead: it delivers the text not yet streamed as
  one ``"fallback"`` event and polls while the message is still generating.
* An in-band error event raises :class:`StreamError`. HTTP errors that a
  retry cannot fix raise :class:`APIError`; more than ``max_retries``
  consecutive failed attempts without progress raise :class:`ConnectionLost`.

Timeouts (seconds): ``idle_timeout`` is the longest silence allowed on a
connection between any two reads, heartbeats (``: ping``) included; hitting
it counts as a drop. ``timeout`` bounds the whole stream, every reconnect and
backoff wait included, and raises :class:`RequestTimeout`. The async client
enforces it exactly (a Trio cancel scope around each step); the sync client
checks it between reads and bounds every connect and read by the time left,
so it may end up to one ``idle_timeout`` late.

Wire formats read here: ringserve's event streams (README "Talking to it", docs/api.md),
Anthropic "Streaming Messages", OpenAI "Chat Completions" streaming, and
WHATWG HTML "Server-sent events" (decoded by httpx-sse).
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from contextlib import aclosing
from urllib.parse import quote
from typing import Any, Self, TypeVar

import attrs
import httpx
import httpx_sse
import trio

from ringserve.core.ringlog import parse_event_id
from ringserve.core.status import MessageStatus, Policy
from ringserve.surfaces.base import CANCELLED_KEY
from ringserve.surfaces.openai import OpenAISurface

__all__ = [
    "APIError",
    "AsyncClient",
    "AsyncMessageStream",
    "Backoff",
    "Client",
    "ClientError",
    "ConnectionLost",
    "FinalMessage",
    "MessageStream",
    "Reconnect",
    "RequestTimeout",
    "ResumeState",
    "StreamError",
    "StreamEvent",
    "Usage",
]

DEFAULT_URL = "http://127.0.0.1:8080"

#: Statuses a retry can fix (the server answers 503/529 with ``Retry-After`` when loading or full).
RETRYABLE_STATUS = frozenset({408, 429, 502, 503, 504, 529})


# -- values ----------------------------------------------------------------------------------


@attrs.frozen
class Usage:
    """Tokens billed for a message: prompt (``input_tokens``, the whole prompt, whether or not the server's
    prefix cache held part of it) and generated (``output_tokens``)."""

    input_tokens: int
    output_tokens: int


@attrs.frozen
class FinalMessage:
    """A finished message.

    Attributes:
        id: the message id (``msg_...`` or ``chatcmpl-...``).
        text: the whole reply text.
        stop_reason: in the surface's spelling (Anthropic ``end_turn``,
            ``max_tokens``, ``stop_sequence``, ``refusal``,
            ``model_context_window_exceeded``; OpenAI ``stop``, ``length``,
            ``content_filter``); a cancelled generation has the
            plain end of turn (``end_turn``, ``stop``).
        stop_sequence: the stop string that ended it, if any.
        usage: tokens billed.
        model: the model that answered.
        cancelled: True when a cancel ended the generation (the server's
            ``ringserve_cancelled`` key, or status ``cancelled``).
    """

    id: str
    text: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    model: str = ""
    cancelled: bool = False


@attrs.frozen
class StreamEvent:
    """One event of a message's stream, delivered once.

    Attributes:
        seq: the event's sequence number (the ``<seq>`` of its SSE id), or
            None for a ``"fallback"`` event.
        event: the SSE event type: Anthropic's names (``message_start``,
            ``content_block_delta``, ...), ``"message"`` for OpenAI chunks,
            or ``"fallback"`` for text read from ``GET /v1/messages/{id}``
            after the stream log was gone.
        data: the parsed JSON payload (``"[DONE]"`` stays a string; a
            fallback event holds the ``GET /v1/messages/{id}`` answer).
        text: the reply text this event adds ("" for most non-delta events).
    """

    seq: int | None
    event: str
    data: Any
    text: str = ""


@attrs.frozen
class Reconnect:
    """Why and when the client opens its next connection (passed to ``on_reconnect``).

    Attributes:
        attempt: consecutive failed attempts without a new event (0 when
            nothing failed: a switch to ``GET /v1/messages/{id}`` or a poll).
        delay: seconds the client waits before the next request.
        cause: what happened, in words.
        last_event_id: the ``Last-Event-ID`` the next stream request sends, if any.
    """

    attempt: int
    delay: float
    cause: str
    last_event_id: str | None


@attrs.frozen
class Backoff:
    """Exponential backoff with full jitter.

    After the n-th consecutive failure (n = 0, 1, ...) the client waits a
    uniformly random ``[0, min(cap, base * 2**n)]`` seconds ("Exponential
    Backoff And Jitter", AWS Architecture Blog, 2015): reconnects spread out
    instead of arriving together after a server restart.

    Args:
        base: seconds; the bound of the first wait (> 0).
        cap: seconds; the largest bound (>= base).
    """

    base: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    cap: float = attrs.field(default=8.0)

    @cap.validator
    def _check_cap(self, _attribute: attrs.Attribute, value: float) -> None:
        if value < self.base:
            raise ValueError(f"cap must be >= base ({self.base}), got {value}")

    def bound(self, failures: int) -> float:
        """The upper bound (seconds) of the wait after ``failures`` earlier consecutive failures."""
        return min(self.cap, self.base * 2.0 ** min(failures, 64))

    def delay(self, failures: int, rng: random.Random) -> float:
        """A random wait in ``[0, bound(failures)]`` seconds."""
        return rng.uniform(0.0, self.bound(failures))


# -- errors ----------------------------------------------------------------------------------


class ClientError(Exception):
    """Base of the client's errors.

    Attributes:
        message_id: the message, if known.
        text: the reply text delivered before the error.
    """

    def __init__(self, message: str, *, message_id: str | None = None, text: str = "") -> None:
        super().__init__(message)
        self.message_id = message_id
        self.text = text


class APIError(ClientError):
    """An HTTP error answer that a retry cannot fix (4xx, 500), or retryable ones past ``max_retries``.

    Attributes:
        status: the HTTP status.
        type: the error ``type`` from the surface's error JSON (e.g.
            ``invalid_request_error``), or "" if the body had none.
    """

    def __init__(self, status: int, type_: str, message: str, **kwargs: Any) -> None:
        super().__init__(f"HTTP {status} {type_}: {message}" if type_ else f"HTTP {status}: {message}", **kwargs)
        self.status = status
        self.type = type_


class StreamError(ClientError):
    """The stream ended with an in-band error event, or the stored message failed.

    Attributes:
        type: the error type (Anthropic ``api_error``/``overloaded_error``...,
            OpenAI ``server_error``...; ``interrupted`` for a message a
            server restart cut short).
    """

    def __init__(self, type_: str, message: str, **kwargs: Any) -> None:
        super().__init__(f"{type_}: {message}", **kwargs)
        self.type = type_


class ConnectionLost(ClientError):
    """More than ``max_retries`` consecutive attempts failed without a new event."""


class RequestTimeout(ClientError, TimeoutError):
    """The stream did not finish within the client's ``timeout``."""


# -- the two surfaces as the client reads them ------------------------------------------------


@attrs.frozen
class Request:
    """One HTTP request the client should send next (paths are relative to the base URL)."""

    method: str
    url: str
    headers: dict[str, str] = attrs.field(repr=False)  # may hold the API key
    json: Any = None


@attrs.define(eq=False)
class _Reading:
    """What a stream's events have said so far."""

    model: str = ""
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None
    terminal: bool = False
    error: tuple[str, str] | None = None
    cancelled: bool = False


class _AnthropicWire:
    """Anthropic Messages streaming, read side (Anthropic docs: "Streaming Messages")."""

    path = "/v1/messages"

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True}
        if system is not None:
            body["system"] = system
        return {**body, **params}

    def read(self, event: str, data: Any, into: _Reading) -> str:
        """Apply one event to ``into``; return the text it adds."""
        if event == "content_block_delta":
            delta = data.get("delta") or {}
            return delta.get("text") or "" if delta.get("type") == "text_delta" else ""
        if event == "message_start":
            message = data.get("message") or {}
            into.model = message.get("model") or into.model
        elif event == "message_delta":
            delta = data.get("delta") or {}
            into.stop_reason = delta.get("stop_reason")
            into.stop_sequence = delta.get("stop_sequence")
            into.cancelled = delta.get(CANCELLED_KEY) is True
            usage = data.get("usage") or {}
            # Anthropic's input_tokens is the uncached part; cache_read_input_tokens the rest
            prompt = usage.get("input_tokens", 0) + (usage.get("cache_read_input_tokens") or 0)
            into.usage = Usage(prompt, usage.get("output_tokens", 0))
        elif event == "message_stop":
            into.terminal = True
        elif event == "error":
            error = data.get("error") or {}
            into.error = (error.get("type") or "error", error.get("message") or "")
            into.terminal = True
        return ""


class _OpenAIWire:
    """OpenAI Chat Completions streaming, read side (OpenAI API reference: "Streaming")."""

    path = "/v1/chat/completions"
    done = "[DONE]"

    def body(self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, system: str | None,
             params: Mapping[str, Any]) -> dict[str, Any]:
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        body = {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        return {**body, **params}

    def read(self, event: str, data: Any, into: _Reading) -> str:
        """Apply one event to ``into``; return the text it adds."""
        if data == self.done:
            into.terminal = True
            return ""
        if "error" in data:
            error = data["error"] or {}
            into.error = (error.get("type") or "error", error.get("message") or "")
            into.terminal = True
            return ""
        into.model = data.get("model") or into.model
        usage = data.get("usage")
        if usage:
            into.usage = Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        text = ""
        for choice in data.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason") is not None:
                into.stop_reason = choice["finish_reason"]
                into.cancelled = choice.get(CANCELLED_KEY) is True
        return text


WIRES: dict[str, _AnthropicWire | _OpenAIWire] = {"anthropic": _AnthropicWire(), "openai": _OpenAIWire()}


def _wire(surface: str) -> _AnthropicWire | _OpenAIWire:
    """The read side of ``surface``.

    Raises:
        ValueError: not ``"anthropic"`` or ``"openai"``.
    """
    if surface not in WIRES:
        raise ValueError(f"surface must be one of {sorted(WIRES)}, got {surface!r}")
    return WIRES[surface]


def _wire_of(message_id: str) -> _AnthropicWire | _OpenAIWire:
    return WIRES["openai"] if message_id.startswith(OpenAISurface.id_prefix) else WIRES["anthropic"]


def _deadline(now: float, timeout: float | None) -> float:
    return math.inf if timeout is None else now + timeout


def _error_fields(body: bytes) -> tuple[str, str]:
    """``(type, message)`` from either surface's error JSON, or ``("", body text)``."""
    try:
        error = json.loads(body).get("error")
        return str(error.get("type") or ""), str(error.get("message") or "")
    except (ValueError, AttributeError):
        return "", body[:300].decode("utf-8", "replace")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds (the delta-seconds form only; an HTTP-date is ignored)."""
    try:
        return max(0.0, float(headers.get("retry-after", "")))
    except ValueError:
        return None


def message_path(message_id: str, tail: str = "") -> str:
    """``/v1/messages/{id}`` plus ``tail`` (``"/stream"``, ``"/cancel"``), the id percent-escaped as one
    path segment (RFC 3986 §3.3), so that an id with ``/``, ``..`` or spaces cannot name another route."""
    return f"/v1/messages/{quote(message_id, safe='')}{tail}"


def _auth_headers(api_key: str | None) -> dict[str, str]:
    # Both spellings: the Anthropic SDK sends x-api-key, the OpenAI SDK a bearer token.
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}


def user_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A prompt string as one user turn; a list of ``{"role", "content"}`` turns as is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


# -- the decisions, without I/O ----------------------------------------------------------------

_E = TypeVar("_E", bound=ClientError)


@attrs.define(eq=False)
class ResumeState:
    """One message's stream as the client sees it: what to send next, what arrived, when to retry.

    No I/O and no clock of its own (h11 style): a shell asks
    :meth:`next_request`, sends it, and reports back with
    :meth:`stream_opened` and :meth:`feed` (an event-stream answer),
    :meth:`answered` (any other answer), then :meth:`reconnect` when the
    connection is over and :attr:`done` is still False. Times are seconds on
    the shell's monotonic clock.

    Build one with :meth:`create` or :meth:`follow`.
    """

    wire: _AnthropicWire | _OpenAIWire
    create_body: dict[str, Any] | None
    auth: dict[str, str] = attrs.field(repr=False)  # may hold the API key
    backoff: Backoff
    max_retries: int
    deadline: float
    rng: random.Random = attrs.field(factory=random.Random)
    message_id: str | None = None
    idempotency_key: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    last_seq: int | None = None
    reconnects: int = 0
    final: FinalMessage | None = None
    error: ClientError | None = None
    _parts: list[str] = attrs.field(factory=list)
    _reading: _Reading = attrs.field(factory=_Reading)
    _fetch: bool = False  # read GET /v1/messages/{id} instead of the stream
    _switch: str | None = None  # a reason to make the next request at once, not a failure
    _poll: bool = False  # the message is still generating: ask again after a wait
    _polls: int = 0
    _failures: int = 0
    _progress: bool = False
    _retry_after: float | None = None
    _cause: str | None = None

    @classmethod
    def create(cls, surface: str, body: dict[str, Any], *, now: float, timeout: float | None,
               api_key: str | None = None, backoff: Backoff = Backoff(), max_retries: int = 8,
               rng: random.Random | None = None) -> ResumeState:
        """A stream that starts by POSTing ``body`` to ``surface`` (``"anthropic"`` or ``"openai"``).

        Raises:
            ValueError: unknown surface.
        """
        return cls(_wire(surface), body, _auth_headers(api_key), backoff, max_retries, _deadline(now, timeout),
                   rng or random.Random())

    @classmethod
    def follow(cls, message_id: str, *, now: float, timeout: float | None, api_key: str | None = None,
               backoff: Backoff = Backoff(), max_retries: int = 8, rng: random.Random | None = None) -> ResumeState:
        """A stream that reads an existing message from its first event."""
        return cls(_wire_of(message_id), None, _auth_headers(api_key), backoff, max_retries, _deadline(now, timeout),
                   rng or random.Random(), message_id=message_id)

    # -- what the shell asks -----------------------------------------------------------------

    @property
    def text(self) -> str:
        """The reply text delivered so far."""
        return "".join(self._parts)

    @property
    def done(self) -> bool:
        """True once the final message is known (the shell then stops)."""
        return self.final is not None

    @property
    def leave(self) -> bool:
        """True when the open connection has nothing more for this stream (done, or reading the message)."""
        return self.done or self._fetch

    @property
    def last_event_id(self) -> str | None:
        """The ``Last-Event-ID`` of the next stream request."""
        return None if self.last_seq is None else f"{self.message_id}:{self.last_seq}"

    def remaining(self, now: float) -> float:
        """Seconds left of the overall timeout (``inf`` without one).

        Raises:
            RequestTimeout: none left.
        """
        left = self.deadline - now
        if left <= 0:
            raise self.timed_out()
        return left

    def timed_out(self, cause: str | None = None) -> RequestTimeout:
        """The :class:`RequestTimeout` that ends this stream (recorded as its error)."""
        why = f" ({cause})" if cause else ""
        return self._failed(RequestTimeout(f"the stream did not finish within its timeout{why}{self._about()}"))

    def next_request(self) -> Request:
        """The request to send now."""
        accept = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
        if self.message_id is None:
            assert self.create_body is not None
            headers = {**accept, **self.auth, "Idempotency-Key": self.idempotency_key,
                       "Ringserve-Disconnect-Policy": Policy.CONTINUE.value}
            return Request("POST", self.wire.path, headers, self.create_body)
        if self._fetch:
            return Request("GET", message_path(self.message_id), {"Accept": "application/json", **self.auth})
        headers = {**accept, **self.auth}
        if (last_event_id := self.last_event_id) is not None:
            headers["Last-Event-ID"] = last_event_id
        return Request("GET", message_path(self.message_id, "/stream"), headers)

    # -- what the shell reports --------------------------------------------------------------

    def stream_opened(self, headers: Mapping[str, str]) -> None:
        """A 200 ``text/event-stream`` answer arrived; learn the message id from ``X-Message-Id``."""
        if self.message_id is None:
            self.message_id = headers.get("x-message-id") or None

    def feed(self, sse: httpx_sse.ServerSentEvent) -> list[StreamEvent]:
        """One decoded SSE block; returns the events it delivers (none for a duplicate).

        httpx-sse also dispatches blocks without data, which WHATWG says not
        to; ringserve sends none (its heartbeats and reconnect hint are
        comment lines, ``core/sse.py``), but a proxy might, so they are
        skipped.

        Raises:
            StreamError: the event is an in-band error.
            ClientError: an id that is malformed, of another message, or that
                skips a sequence number (a gap in the stream).
        """
        if not sse.data:
            return []
        if self.message_id is None:
            self.message_id = (sse.id or "").rpartition(":")[0] or None
        try:
            seq = parse_event_id(sse.id or "", self.message_id or "")
        except ValueError as exc:
            raise self._failed(ClientError(f"unexpected event id: {exc}")) from None
        if self.last_seq is not None and seq <= self.last_seq:
            return []  # already delivered: a replay after a reconnect
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq != expected:
            raise self._failed(ClientError(f"event {seq} arrived where {expected} was due: the stream has a gap"))
        self.last_seq = seq
        self._progress = True
        try:
            data = sse.data if sse.data == _OpenAIWire.done else json.loads(sse.data)
        except ValueError:
            raise self._failed(ClientError(f"event {sse.id} does not hold JSON: {sse.data[:100]!r}")) from None
        reading = self._reading
        text = self.wire.read(sse.event, data, reading)
        if text:
            self._parts.append(text)
        if reading.error is not None:
            raise self._failed(StreamError(*reading.error))
        if reading.terminal:
            if reading.usage is None:  # an OpenAI stream without include_usage: the message has it
                self._fetch, self._switch = True, "the stream had no usage; reading the message"
            else:
                self.final = FinalMessage(self.message_id or "", self.text, reading.stop_reason,
                                          reading.stop_sequence, reading.usage, reading.model, reading.cancelled)
        return [StreamEvent(seq, sse.event, data, text)]

    def answered(self, status: int, headers: Mapping[str, str], body: bytes) -> list[StreamEvent]:
        """Any answer that is not a 200 event stream; returns the events it delivers.

        Raises:
            APIError: an error a retry cannot fix.
            StreamError: the stored message failed or was interrupted.
            ClientError: a 200 answer of the wrong kind, or stored text that
                does not continue what was streamed.
        """
        if status in (204, 410) and self.message_id is not None and not self._fetch:
            why = "the stream has ended (204)" if status == 204 else "the stream log is gone (410)"
            self._fetch, self._switch = True, f"{why}; reading the message"
            return []
        if status in RETRYABLE_STATUS:
            self._retry_after = _retry_after(headers)
            self._cause = f"HTTP {status}"
            return []
        if status != 200:
            raise self._failed(APIError(status, *_error_fields(body)))
        if not self._fetch:
            raise self._failed(ClientError("expected an event stream, got a 200 answer of another type"))
        return self._from_message(json.loads(body))

    def reconnect(self, error: BaseException | None, now: float) -> Reconnect:
        """The connection is over and the message is not done: when to make the next request.

        Args:
            error: the network error (an idle timeout included) that ended
                the connection, or None (it closed, or the answer asked for a
                retry or a switch).
            now: the shell's clock.

        Raises:
            ConnectionLost: ``max_retries`` consecutive failures without progress.
            RequestTimeout: the next attempt would start after the deadline.
        """
        if self._progress:
            self._failures, self._polls = 0, 0
        self._progress = False
        attempt = 0
        if self._switch is not None:
            delay, cause, self._switch = 0.0, self._switch, None
        elif self._poll:
            self._poll = False
            delay, cause = self.backoff.delay(self._polls, self.rng), "the message is still generating"
            self._polls += 1
        else:
            if error is not None:
                cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            else:
                cause = self._cause or "the stream closed before its terminal event"
            self._cause = None
            self._failures += 1
            attempt = self._failures
            if attempt > self.max_retries:
                lost = ConnectionLost(f"gave up after {self.max_retries} retries without progress ({cause})"
                                      f"{self._about()}")
                raise self._failed(lost) from error
            delay = self.backoff.delay(attempt - 1, self.rng)
            if self._retry_after is not None:
                delay, self._retry_after = max(delay, self._retry_after), None
        if now + delay >= self.deadline:
            raise self.timed_out(cause)
        self.reconnects += 1
        return Reconnect(attempt, delay, cause, None if self._fetch else self.last_event_id)

    def check_deadline(self, now: float) -> None:
        """Raise :class:`RequestTimeout` if the overall timeout has passed."""
        self.remaining(now)

    def finish_or_raise(self) -> FinalMessage:
        """The final message; the stream's error if it ended in one.

        Raises:
            ClientError: the error that ended the stream, or a ClientError if
                the stream was closed before it finished.
        """
        if self.error is not None:
            raise self.error
        if self.final is None:
            raise ClientError(f"the stream was closed before it finished{self._about()}",
                              message_id=self.message_id, text=self.text)
        return self.final

    # -- internals ---------------------------------------------------------------------------

    def _from_message(self, message: dict[str, Any]) -> list[StreamEvent]:
        """Continue from a ``GET /v1/messages/{id}`` answer (docs/api.md "Routes")."""
        stored, have = message.get("text") or "", self.text
        if not stored.startswith(have):
            raise self._failed(ClientError("the stored text does not continue the streamed text"))
        events = []
        if len(stored) > len(have):
            rest = stored[len(have):]
            self._parts.append(rest)
            self._progress = True
            events.append(StreamEvent(None, "fallback", message, rest))
        spelled = message.get("status")
        status = MessageStatus(spelled) if spelled in tuple(MessageStatus) else None
        match status:
            case MessageStatus.QUEUED | MessageStatus.GENERATING:  # still being written
                self._poll = True
            case MessageStatus.FAILED:
                raise self._failed(StreamError("api_error", message.get("error") or "generation failed"))
            case MessageStatus.INTERRUPTED:
                raise self._failed(StreamError("interrupted", "the server stopped before the message was finished"))
            case _:  # complete or cancelled (or a status this client does not know)
                usage = message.get("usage") or {}
                self.final = FinalMessage(
                    self.message_id or "", self.text, message.get("stop_reason"), message.get("stop_sequence"),
                    Usage(usage.get("input_tokens", 0), usage.get("output_tokens", 0)),
                    message.get("model") or self._reading.model, status is MessageStatus.CANCELLED,
                )
        return events

    def _about(self) -> str:
        return f" (message {self.message_id})" if self.message_id else ""

    def _failed(self, error: _E) -> _E:
        error.message_id, error.text = self.message_id, self.text
        self.error = error
        return error


def _timeouts(state: ResumeState, now: float, connect: float, idle: float | None) -> httpx.Timeout:
    """Per-request httpx timeouts: ``connect``/``idle`` seconds, none past the overall deadline."""
    remaining = state.remaining(now)
    left = None if math.isinf(remaining) else remaining

    def cap(seconds: float | None) -> float | None:
        return left if seconds is None else seconds if left is None else min(seconds, left)

    return httpx.Timeout(connect=cap(connect), read=cap(idle), write=cap(connect), pool=cap(connect))


def _is_event_stream(response: httpx.Response) -> bool:
    content_type = response.headers.get("content-type", "").partition(";")[0].strip()
    return response.status_code == 200 and content_type == "text/event-stream"


@attrs.frozen
class _Settings:
    """A client's arguments, and the streams they make (shared by both shells)."""

    api_key: str | None = attrs.field(repr=False)
    timeout: float | None
    idle_timeout: float | None
    connect_timeout: float
    max_retries: int
    backoff: Backoff
    rng: random.Random | None

    def create(self, now: float, surface: str, prompt: str | Sequence[Mapping[str, Any]], *, model: str,
               max_tokens: int, system: str | None, params: Mapping[str, Any]) -> ResumeState:
        body = _wire(surface).body(user_messages(prompt), model=model, max_tokens=max_tokens, system=system,
                                   params=params)
        return ResumeState.create(surface, body, now=now, timeout=self.timeout, api_key=self.api_key,
                                  backoff=self.backoff, max_retries=self.max_retries, rng=self.rng)

    def follow(self, now: float, message_id: str) -> ResumeState:
        return ResumeState.follow(message_id, now=now, timeout=self.timeout, api_key=self.api_key,
                                  backoff=self.backoff, max_retries=self.max_retries, rng=self.rng)


#: Seconds a best-effort cancel on leaving a stream early may take.
CANCEL_TIMEOUT = 5.0


class _StreamView:
    """What both stream shells show of their :class:`ResumeState`."""

    _state: ResumeState
    _owned: bool  # this stream created the message
    _cancelled: bool

    @property
    def message_id(self) -> str | None:
        """The message id (None until the first answer)."""
        return self._state.message_id

    @property
    def text(self) -> str:
        """The text delivered so far."""
        return self._state.text

    @property
    def reconnects(self) -> int:
        """Requests made after the first one."""
        return self._state.reconnects

    def _cancel_on_close(self) -> str | None:
        """The id of the message to cancel as this stream closes, if any."""
        state = self._state
        # After a StreamError the server's generation is over; after any other error it may still run.
        if self._owned and not self._cancelled and state.final is None and not isinstance(state.error, StreamError):
            return state.message_id
        return None


# -- the sync shell ----------------------------------------------------------------------------


class MessageStream(_StreamView):
    """A resuming stream of one message (sync). Use it as a context manager.

    Iterate it for :class:`StreamEvent` values, or :attr:`text_stream` for
    the text; :meth:`final_message` reads to the end. Leaving the ``with``
    block (or :meth:`close`) before the end cancels the generation on the
    server if this stream created it.
    """

    def __init__(self, client: Client, state: ResumeState, *, owned: bool,
                 on_reconnect: Callable[[Reconnect], None] | None) -> None:
        self._client = client
        self._state = state
        self._owned = owned
        self._on_reconnect = on_reconnect
        self._events = self._run()
        self._cancelled = False

    def __iter__(self) -> Iterator[StreamEvent]:
        return self._events

    @property
    def text_stream(self) -> Iterator[str]:
        """The reply text, delta by delta."""
        return (event.text for event in self if event.text)

    def final_message(self) -> FinalMessage:
        """Read to the end; the final message.

        Raises:
            ClientError: any error that ended the stream (see the module doc).
        """
        for _ in self:
            pass
        return self._state.finish_or_raise()

    def cancel(self) -> dict[str, Any] | None:
        """Cancel the generation on the server; its status (``GET /v1/messages/{id}``), or None if no id yet."""
        if self.message_id is None:
            return None
        self._cancelled = True
        return self._client.cancel(self.message_id)

    def close(self) -> None:
        """Stop reading; cancel the generation if this stream created it and it is unfinished (best effort)."""
        self._events.close()
        if (message_id := self._cancel_on_close()) is not None:
            try:
                self._client.cancel(message_id, timeout=CANCEL_TIMEOUT)
            except (httpx.HTTPError, ClientError):
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> Generator[StreamEvent, None, None]:
        state, client = self._state, self._client
        while True:
            request = state.next_request()
            timeout = _timeouts(state, time.monotonic(), client._settings.connect_timeout,
                                client._settings.idle_timeout)
            error: httpx.TransportError | None = None
            try:
                with client.http.stream(request.method, request.url, headers=request.headers,
                                        json=request.json, timeout=timeout) as response:
                    if _is_event_stream(response):
                        state.stream_opened(response.headers)
                        for sse in httpx_sse.EventSource(response).iter_sse():
                            yield from state.feed(sse)
                            if state.leave:
                                break
                            state.check_deadline(time.monotonic())
                    else:
                        response.read()
                        yield from state.answered(response.status_code, response.headers, response.content)
            except httpx.TransportError as exc:
                error = exc
            if state.done:
                return
            reconnect = state.reconnect(error, time.monotonic())
            if self._on_reconnect is not None:
                self._on_reconnect(reconnect)
            time.sleep(reconnect.delay)


class Client:
    """A sync ringserve client (httpx) whose streams resume by themselves.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8080``.
        api_key: sent as ``Authorization: Bearer`` and ``x-api-key``.
        timeout: seconds one stream may take in all, reconnects and waits
            included (None: no limit).
        idle_timeout: seconds of silence allowed between two reads on a
            connection, heartbeats included, before it counts as dropped
            (None: wait forever). Keep it above the server's
            ``heartbeat_interval``.
        connect_timeout: seconds to connect (and to send a request).
        max_retries: consecutive failed attempts without a new event before
            :class:`ConnectionLost`.
        backoff: the wait between attempts.
        rng: randomness for the jitter (tests pass a seeded one).
        transport: an httpx transport (tests).
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout: float | None = 600.0,
                 idle_timeout: float | None = 60.0, connect_timeout: float = 10.0, max_retries: int = 8,
                 backoff: Backoff = Backoff(), rng: random.Random | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._settings = _Settings(api_key, timeout, idle_timeout, connect_timeout, max_retries, backoff, rng)
        self.http = httpx.Client(base_url=base_url, transport=transport)

    def stream(self, prompt: str | Sequence[Mapping[str, Any]], *, max_tokens: int = 1024,
               surface: str = "anthropic", model: str = "ringserve", system: str | None = None,
               on_reconnect: Callable[[Reconnect], None] | None = None, **params: Any) -> MessageStream:
        """Create a message and stream it (the POST is sent on the first read).

        Args:
            prompt: a user prompt, or a list of ``{"role", "content"}`` turns.
            max_tokens: the most tokens to generate.
            surface: ``"anthropic"`` (``POST /v1/messages``) or ``"openai"``
                (``POST /v1/chat/completions``).
            model: the model name sent (ringserve answers any name unless
                ``model.strict_model_name`` is set).
            system: a system prompt.
            on_reconnect: called before each wait and new request.
            **params: more body fields (``temperature``, ``stop_sequences``
                or ``stop``, ...).

        Raises:
            ValueError: unknown surface.
        """
        state = self._settings.create(time.monotonic(), surface, prompt, model=model, max_tokens=max_tokens,
                                      system=system, params=params)
        return MessageStream(self, state, owned=True, on_reconnect=on_reconnect)

    def follow(self, message_id: str, *, on_reconnect: Callable[[Reconnect], None] | None = None) -> MessageStream:
        """Stream an existing message from its first event (never cancels it)."""
        state = self._settings.follow(time.monotonic(), message_id)
        return MessageStream(self, state, owned=False, on_reconnect=on_reconnect)

    def get_message(self, message_id: str) -> dict[str, Any]:
        """``GET /v1/messages/{id}``: status, text so far, stop reason, usage.

        Raises:
            APIError: an error answer.
        """
        return self._json(self.http.get(message_path(message_id), headers=_auth_headers(self._settings.api_key),
                                        timeout=self._settings.connect_timeout))

    def cancel(self, message_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/messages/{id}/cancel``; the message's status once its generation has stopped.

        Raises:
            APIError: an error answer.
        """
        return self._json(self.http.post(message_path(message_id, "/cancel"),
                                         headers=_auth_headers(self._settings.api_key),
                                         timeout=timeout or self._settings.connect_timeout))

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        if response.status_code != 200:
            raise APIError(response.status_code, *_error_fields(response.content))
        return response.json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- the Trio shell ----------------------------------------------------------------------------


class AsyncMessageStream(_StreamView):
    """A resuming stream of one message (Trio). Use it as an async context manager.

    Same behaviour as :class:`MessageStream`. The overall timeout is exact:
    each step runs under ``trio.move_on_at(deadline)``, opened and closed
    inside ``__anext__`` (never across a ``yield``). Cancellation by an
    enclosing scope leaves the stream unusable; leaving the ``async with``
    block then still cancels an owned, unfinished generation (shielded, at
    most :data:`CANCEL_TIMEOUT` seconds).
    """

    def __init__(self, client: AsyncClient, state: ResumeState, *, owned: bool,
                 on_reconnect: Callable[[Reconnect], None] | None) -> None:
        self._client = client
        self._state = state
        self._owned = owned
        self._on_reconnect = on_reconnect
        self._events = self._run()
        self._cancelled = False

    def __aiter__(self) -> AsyncMessageStream:
        return self

    async def __anext__(self) -> StreamEvent:
        with trio.move_on_at(self._state.deadline):
            return await self._events.__anext__()
        raise self._state.timed_out()

    @property
    def text_stream(self) -> AsyncIterator[str]:
        """The reply text, delta by delta."""
        return (event.text async for event in self if event.text)

    async def final_message(self) -> FinalMessage:
        """Read to the end; the final message.

        Raises:
            ClientError: any error that ended the stream (see the module doc).
        """
        async for _ in self:
            pass
        return self._state.finish_or_raise()

    async def cancel(self) -> dict[str, Any] | None:
        """Cancel the generation on the server; its status, or None if no id yet."""
        if self.message_id is None:
            return None
        self._cancelled = True
        return await self._client.cancel(self.message_id)

    async def aclose(self) -> None:
        """Stop reading; cancel the generation if this stream created it and it is unfinished (best effort)."""
        with trio.CancelScope(shield=True):
            await self._events.aclose()
            if (message_id := self._cancel_on_close()) is not None:
                with trio.move_on_after(CANCEL_TIMEOUT):
                    try:
                        await self._client.cancel(message_id, timeout=CANCEL_TIMEOUT)
                    except (httpx.HTTPError, ClientError):
                        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[StreamEvent, None]:
        state, client = self._state, self._client
        while True:
            request = state.next_request()
            timeout = _timeouts(state, trio.current_time(), client._settings.connect_timeout,
                                client._settings.idle_timeout)
            error: httpx.TransportError | None = None
            try:
                async with client.http.stream(request.method, request.url, headers=request.headers,
                                              json=request.json, timeout=timeout) as response:
                    if _is_event_stream(response):
                        state.stream_opened(response.headers)
                        async with aclosing(httpx_sse.EventSource(response).aiter_sse()) as events:
                            async for sse in events:
                                for event in state.feed(sse):
                                    yield event
                                if state.leave:
                                    break
                    else:
                        await response.aread()
                        for event in state.answered(response.status_code, response.headers, response.content):
                            yield event
            except httpx.TransportError as exc:
                error = exc
            if state.done:
                return
            reconnect = state.reconnect(error, trio.current_time())
            if self._on_reconnect is not None:
                self._on_reconnect(reconnect)
            await trio.sleep(reconnect.delay)


class AsyncClient:
    """The Trio twin of :class:`Client` (httpx.AsyncClient); same arguments."""

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout: float | None = 600.0,
                 idle_timeout: float | None = 60.0, connect_timeout: float = 10.0, max_retries: int = 8,
                 backoff: Backoff = Backoff(), rng: random.Random | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._settings = _Settings(api_key, timeout, idle_timeout, connect_timeout, max_retries, backoff, rng)
        self.http = httpx.AsyncClient(base_url=base_url, transport=transport)

    def stream(self, prompt: str | Sequence[Mapping[str, Any]], *, max_tokens: int = 1024,
               surface: str = "anthropic", model: str = "ringserve", system: str | None = None,
               on_reconnect: Callable[[Reconnect], None] | None = None, **params: Any) -> AsyncMessageStream:
        """Create a message and stream it; see :meth:`Client.stream`."""
        state = self._settings.create(trio.current_time(), surface, prompt, model=model, max_tokens=max_tokens,
                                      system=system, params=params)
        return AsyncMessageStream(self, state, owned=True, on_reconnect=on_reconnect)

    def follow(self, message_id: str, *,
               on_reconnect: Callable[[Reconnect], None] | None = None) -> AsyncMessageStream:
        """Stream an existing message from its first event (never cancels it)."""
        state = self._settings.follow(trio.current_time(), message_id)
        return AsyncMessageStream(self, state, owned=False, on_reconnect=on_reconnect)

    async def get_message(self, message_id: str) -> dict[str, Any]:
        """``GET /v1/messages/{id}``; see :meth:`Client.get_message`."""
        return Client._json(await self.http.get(message_path(message_id),
                                                headers=_auth_headers(self._settings.api_key),
                                                timeout=self._settings.connect_timeout))

    async def cancel(self, message_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/messages/{id}/cancel``; see :meth:`Client.cancel`."""
        return Client._json(await self.http.post(message_path(message_id, "/cancel"),
                                                 headers=_auth_headers(self._settings.api_key),
                                                 timeout=timeout or self._settings.connect_timeout))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
