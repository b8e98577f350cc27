"""The resume core, without I/O: what to send next, what arrived, when to retry."""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import attrs
import httpx_sse

from ringserve.client._errors import APIError, ClientError, ConnectionLost, RequestTimeout, StreamError
from ringserve.client._models import Backoff, FinalMessage, Reconnect, Request, StreamEvent, Usage
from ringserve.client._wires import OpenAIWire, Reading, Wire, wire, wire_of
from ringserve.core.ringlog import parse_event_id
from ringserve.core.status import MessageStatus, Policy

#: Statuses a retry can fix (the server answers 503/529 with ``Retry-After`` when loading or full).
RETRYABLE_STATUS = frozenset({408, 429, 502, 503, 504, 529})



def _deadline(now: float, timeout: float | None) -> float:
    return math.inf if timeout is None else now + timeout


def error_fields(body: bytes) -> tuple[str, str]:
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


def auth_headers(api_key: str | None) -> dict[str, str]:
    # Both spellings: the Anthropic SDK sends x-api-key, the OpenAI SDK a bearer token.
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}



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

    wire: Wire
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
    _reading: Reading = attrs.field(factory=Reading)
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
        return cls(wire(surface), body, auth_headers(api_key), backoff, max_retries, _deadline(now, timeout),
                   rng or random.Random())

    @classmethod
    def follow(cls, message_id: str, *, now: float, timeout: float | None, api_key: str | None = None,
               backoff: Backoff = Backoff(), max_retries: int = 8, rng: random.Random | None = None) -> ResumeState:
        """A stream that reads an existing message from its first event."""
        return cls(wire_of(message_id), None, auth_headers(api_key), backoff, max_retries, _deadline(now, timeout),
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
            data = sse.data if sse.data == OpenAIWire.done else json.loads(sse.data)
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
            raise self._failed(APIError(status, *error_fields(body)))
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

