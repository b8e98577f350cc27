"""The resume core: one message's stream as the client sees it, with no I/O and no clock of its own.

A shell (``_trio.py``, ``_sync.py``) asks :meth:`ResumeState.next_request`,
sends it, hands over the answer's status and headers
(:meth:`~ResumeState.received`, which says how to read the body), then either
its bytes as they arrive (:meth:`~ResumeState.feed`, an event stream) or the
whole body (:meth:`~ResumeState.answered`), and gets the events to deliver
back as values. When the connection is over and the message is not done, it
asks :meth:`~ResumeState.reconnect` how long to wait. The state decodes the
bytes with the server's own SSE parser (``core/sse.py``) and reads events
with the surface's wire (``_wires.py``). Times are seconds on the shell's
monotonic clock.

Rules of this file (h11's ``_state.py``): every move of :class:`Phase` is in
:data:`TRANSITIONS`; :meth:`ResumeState._move` is the only way the phase
changes, and a move the table lacks raises :class:`PhaseError` naming the
phase and the trigger. The phases::

    LOOKUP  GET /v1/messages/{id}: learn the message's surface (follow without one)
    CREATE  POST the create request (no message id yet)
    STREAM  GET /v1/messages/{id}/stream with Last-Event-ID
    READ    an event stream is open: feed its bytes
    FETCH   GET the stored message (the stream has ended, its log is gone, or it had no usage)
    DONE    the final message is known            FAILED  an error ended the stream

Wire formats: ringserve's event ids ``<message_id>:<seq>`` (``core/ringlog.py``),
its routes (docs/api.md "Routes"), and the surfaces in ``_wires.py``.
"""

from __future__ import annotations

import enum
import json
import math
import random
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar, assert_never

import attrs

from ringserve.client._errors import (
    APIError,
    ClientError,
    ConnectionLost,
    NoServer,
    RequestTimeout,
    StreamError,
)
from ringserve.client._models import Backoff, FinalMessage, Reconnect, Request, StreamEvent, ToolCall
from ringserve.client._wires import WIRES, Read, Reading, Stored, Wire, message_path, wire
from ringserve.core.ringlog import parse_event_id
from ringserve.core.sse import ServerSentEvent, SSEParser
from ringserve.core.status import Policy

#: Statuses a retry can fix (the server answers 503/529 with ``Retry-After`` when loading or full).
RETRYABLE_STATUS = frozenset({408, 429, 502, 503, 504, 529})


class Phase(enum.Enum):
    """Where one message's stream stands (see the module doc)."""

    LOOKUP = "lookup"
    CREATE = "create"
    STREAM = "stream"
    READ = "read"
    FETCH = "fetch"
    DONE = "done"
    FAILED = "failed"


class Trigger(enum.Enum):
    """What moves a :class:`Phase`.

    ``IDENTIFIED``: the message's surface is known. ``OPENED``: a 200 event
    stream answered. ``FINISHED``: the final message is known. ``FALLBACK``:
    the stream cannot go on (it has ended, 204; its log is gone, 410; it
    ended without usage): read the stored message. ``GENERATING``: the stored
    message is still being generated. ``DROPPED``: the attempt failed (a
    network error, an idle timeout, a close before the terminal event, a
    retryable status): the same again after a backoff. ``UNANSWERED``: the
    same for a create request whose answer named no message yet: send it
    again (same ``Idempotency-Key``). ``ERROR``: an error ended the stream.
    """

    IDENTIFIED = "identified"
    OPENED = "opened"
    FINISHED = "finished"
    FALLBACK = "fallback"
    GENERATING = "generating"
    DROPPED = "dropped"
    UNANSWERED = "unanswered"
    ERROR = "error"


_P, _T = Phase, Trigger

#: Every legal move: phase → trigger → the next phase.
TRANSITIONS: Mapping[Phase, Mapping[Trigger, Phase]] = {
    _P.LOOKUP: {_T.IDENTIFIED: _P.STREAM, _T.DROPPED: _P.LOOKUP, _T.ERROR: _P.FAILED},
    _P.CREATE: {_T.OPENED: _P.READ, _T.UNANSWERED: _P.CREATE, _T.ERROR: _P.FAILED},
    _P.STREAM: {_T.OPENED: _P.READ, _T.FALLBACK: _P.FETCH, _T.DROPPED: _P.STREAM, _T.ERROR: _P.FAILED},
    _P.READ: {_T.FINISHED: _P.DONE, _T.FALLBACK: _P.FETCH, _T.DROPPED: _P.STREAM, _T.UNANSWERED: _P.CREATE,
              _T.ERROR: _P.FAILED},
    _P.FETCH: {_T.FINISHED: _P.DONE, _T.GENERATING: _P.FETCH, _T.DROPPED: _P.FETCH, _T.ERROR: _P.FAILED},
    _P.DONE: {},
    _P.FAILED: {},
}


class PhaseError(Exception):
    """A move that :data:`TRANSITIONS` lacks, or a call in a phase that has none: a bug in the shell."""


class Body(enum.Enum):
    """How a shell reads an answer's body: ``EVENTS``, its bytes as they arrive (:meth:`ResumeState.feed`);
    ``WHOLE``, all of it, then :meth:`ResumeState.answered`."""

    EVENTS = "events"
    WHOLE = "whole"


class _Pause(enum.Enum):
    """What comes before the next request: ``NEXT``, nothing (a step of the same stream, not a
    reconnect); ``SWITCH``, nothing but it counts as a reconnect; ``POLL``, a backoff between
    polls; ``RETRY``, a backoff after a failure (and at least ``Retry-After``)."""

    NEXT = "next"
    SWITCH = "switch"
    POLL = "poll"
    RETRY = "retry"


@attrs.frozen
class _Wait:
    pause: _Pause
    cause: str = ""
    retry_after: float | None = None


def error_fields(body: bytes) -> tuple[str, str]:
    """``(type, message)`` from any surface's error JSON, or ``("", body text)``."""
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


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Both spellings: the Anthropic SDK sends ``x-api-key``, the OpenAI SDK a bearer token."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


_E = TypeVar("_E", bound=ClientError)

_ACCEPT_EVENTS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}


@attrs.define(eq=False)
class ResumeState:
    """One message's stream as the client sees it: what to send next, what arrived, when to retry.

    Build one with :meth:`create` or :meth:`follow`; the module doc says how
    a shell drives it.

    Attributes:
        phase: where the stream stands.
        message_id: the message's id (None until an answer names it).
        last_seq: the seq of the last event delivered.
        reconnects: requests made after a connection that did not finish
            the stream (a lookup's stream request is not one).
        final: the final message, once known.
        error: the error that ended the stream, if any.
    """

    _wire: Wire | None  # None until LOOKUP names the surface
    create_body: dict[str, Any] | None
    auth: dict[str, str] = attrs.field(repr=False)  # may hold the API key
    backoff: Backoff
    max_retries: int
    deadline: float
    phase: Phase
    rng: random.Random = attrs.field(factory=random.Random)
    message_id: str | None = None
    idempotency_key: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    last_seq: int | None = None
    reconnects: int = 0
    final: FinalMessage | None = None
    error: ClientError | None = None
    _parts: list[str] = attrs.field(factory=list)
    _reasoning: list[str] = attrs.field(factory=list)
    _reading: Reading = attrs.field(factory=Reading)
    _parser: SSEParser = attrs.field(factory=SSEParser)
    _wait: _Wait | None = None  # set when an answer decided the next step
    _failures: int = 0  # consecutive failed attempts without a new event
    _polls: int = 0  # consecutive polls of a message still generating, without new text

    @classmethod
    def create(cls, surface: str, body: dict[str, Any], *, now: float, timeout: float | None,
               api_key: str | None = None, backoff: Backoff = Backoff(), max_retries: int = 8,
               rng: random.Random | None = None) -> ResumeState:
        """A stream that starts by POSTing ``body`` to the create route of ``surface`` (a name of
        :data:`~ringserve.client._wires.WIRES`).

        Raises:
            ValueError: unknown surface.
        """
        return cls(wire(surface), body, auth_headers(api_key), backoff, max_retries, _deadline(now, timeout),
                   Phase.CREATE, rng or random.Random())

    @classmethod
    def follow(cls, message_id: str, *, surface: str | None = None, now: float, timeout: float | None,
               api_key: str | None = None, backoff: Backoff = Backoff(), max_retries: int = 8,
               rng: random.Random | None = None) -> ResumeState:
        """A stream that reads an existing message from its first event; without ``surface`` it
        first reads the message's status to learn it.

        Raises:
            ValueError: unknown surface.
        """
        return cls(None if surface is None else wire(surface), None, auth_headers(api_key), backoff, max_retries,
                   _deadline(now, timeout), Phase.STREAM if surface else Phase.LOOKUP, rng or random.Random(),
                   message_id=message_id)

    # -- what the shell asks -----------------------------------------------------------------

    @property
    def text(self) -> str:
        """The reply text delivered so far."""
        return "".join(self._parts)

    @property
    def reasoning(self) -> str:
        """The reasoning text delivered so far."""
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls completed so far."""
        return tuple(self._reading.calls.done)

    @property
    def done(self) -> bool:
        """True once the final message is known (the shell then stops)."""
        return self.phase is Phase.DONE

    @property
    def leave(self) -> bool:
        """True when the open connection has nothing more for this stream (done, failed, or reading
        the stored message next)."""
        return self.phase is not Phase.READ

    @property
    def last_event_id(self) -> str | None:
        """The ``Last-Event-ID`` of the next stream request."""
        return None if self.last_seq is None else f"{self.message_id}:{self.last_seq}"

    @property
    def wire(self) -> Wire:
        """The surface's wire.

        Raises:
            PhaseError: not known yet (phase ``LOOKUP``).
        """
        if self._wire is None:
            raise PhaseError(f"the surface is not known yet in phase {self.phase.name}")
        return self._wire

    def remaining(self, now: float) -> float:
        """Seconds left of the overall timeout (``inf`` without one).

        Raises:
            RequestTimeout: none left.
        """
        left = self.deadline - now
        if left <= 0:
            raise self.timed_out()
        return left

    def check_deadline(self, now: float) -> None:
        """Raise :class:`RequestTimeout` if the overall timeout has passed."""
        self.remaining(now)

    def timed_out(self, cause: str | None = None) -> RequestTimeout:
        """The :class:`RequestTimeout` that ends this stream (recorded as its error)."""
        why = f" ({cause})" if cause else ""
        return self._failed(RequestTimeout(f"the stream did not finish within its timeout{why}{self._about()}"))

    def next_request(self) -> Request:
        """The request to send now.

        Raises:
            PhaseError: no request is due (``READ``, ``DONE``, ``FAILED``).
        """
        match self.phase:
            case Phase.CREATE:
                headers = {**_ACCEPT_EVENTS, **self.auth, "Idempotency-Key": self.idempotency_key,
                           "Ringserve-Disconnect-Policy": Policy.CONTINUE.value}
                return Request("POST", self.wire.path, headers, self.create_body)
            case Phase.LOOKUP:
                return Request("GET", message_path(self._named()), {"Accept": "application/json", **self.auth})
            case Phase.STREAM:
                headers = {**_ACCEPT_EVENTS, **self.auth}
                if (last_event_id := self.last_event_id) is not None:
                    headers["Last-Event-ID"] = last_event_id
                return Request("GET", message_path(self._named(), "/stream"), headers)
            case Phase.FETCH:
                return Request("GET", self.wire.stored_path(self._named()), {"Accept": "application/json", **self.auth})
            case Phase.READ | Phase.DONE | Phase.FAILED:
                raise PhaseError(f"no request is due in phase {self.phase.name}")
            case _:
                assert_never(self.phase)

    # -- what the shell reports --------------------------------------------------------------

    def received(self, status: int, headers: Mapping[str, str]) -> Body:
        """The status and headers of the answer to :meth:`next_request`'s request; how to read its body.

        A 200 ``text/event-stream`` answer to a create or stream request opens
        the stream (the message id comes from ``X-Message-Id``, or else from
        the first event's id). ``headers`` is case-insensitive (httpx's) or
        has lower-case names.

        Raises:
            PhaseError: no request was due.
        """
        self._require("received", Phase.LOOKUP, Phase.CREATE, Phase.STREAM, Phase.FETCH)
        content_type = headers.get("content-type", "").partition(";")[0].strip()
        if status != 200 or content_type != "text/event-stream" or self.phase not in (Phase.CREATE, Phase.STREAM):
            return Body.WHOLE
        if self.message_id is None:
            self.message_id = headers.get("x-message-id") or None
        self._parser = SSEParser()  # what an earlier connection left unfinished is discarded
        self._move(Trigger.OPENED)
        return Body.EVENTS

    def feed(self, data: bytes) -> list[StreamEvent]:
        """More bytes of the open event stream, split anywhere; the events they complete, each
        delivered once (none for a duplicate). Bytes after the terminal event, or after the
        stream switched to the stored message, are not read (:attr:`leave` is then True).

        Raises:
            StreamError: an in-band error event.
            ClientError: an event id that is malformed, of another message, or that skips a
                sequence number (a gap in the stream); data that is not the surface's JSON.
            PhaseError: no stream is open.
        """
        self._require("feed", Phase.READ)
        events = []
        for sse in self._parser.feed(data):
            event = self._event(sse)
            if event is not None:
                events.append(event)
            if self.phase is not Phase.READ:
                break
        return events

    def answered(self, status: int, headers: Mapping[str, str], body: bytes) -> list[StreamEvent]:
        """A whole answer (:attr:`Body.WHOLE`); the events it delivers.

        Raises:
            APIError: an error a retry cannot fix.
            StreamError: the stored message failed or was interrupted.
            ClientError: a 200 answer of the wrong kind, or stored text that
                does not continue what was streamed.
            PhaseError: no request was due.
        """
        self._require("answered", Phase.LOOKUP, Phase.CREATE, Phase.STREAM, Phase.FETCH)
        if status in (204, 410) and self.phase is Phase.STREAM:
            why = "the stream has ended (204)" if status == 204 else "the stream log is gone (410)"
            self._next(Trigger.FALLBACK, _Wait(_Pause.SWITCH, f"{why}; reading the message"))
            return []
        if status in RETRYABLE_STATUS:  # (the cause names the server's reason: a retry may not help)
            type_, message = error_fields(body)
            cause = f"HTTP {status}: {message}" if type_ and message else f"HTTP {status}"
            self._next(self._dropped(), _Wait(_Pause.RETRY, cause, _retry_after(headers)))
            return []
        if status != 200:
            raise self._failed(APIError(status, *error_fields(body)))
        match self.phase:
            case Phase.LOOKUP:
                self._identify(self._json(body))
                return []
            case Phase.FETCH:
                stored = self._json(body)
                return self._from_stored(self.wire.stored(stored), stored)
            case _:
                raise self._failed(ClientError("expected an event stream, got a 200 answer of another type"))

    def reconnect(self, error: BaseException | None, now: float, *, refused: bool = False) -> Reconnect | None:
        """The connection is over and the message is not done: when to make the next request.

        Args:
            error: the network error (an idle timeout included) that ended
                the connection, or None (it closed, or the answer decided).
            now: the shell's clock.
            refused: the shell's finding that ``error`` is a refused
                connection and that its client has had no answer from the
                server yet: nothing listens there, and no retry will find
                anything sooner than the user can start it.

        Returns:
            How long to wait and why, or None when the next request follows at
            once as a step of the same stream (after a lookup), not a reconnect.

        Raises:
            NoServer: ``refused``.
            ConnectionLost: ``max_retries`` consecutive failures without progress.
            RequestTimeout: the next attempt would start after the deadline.
            PhaseError: the stream is over.
        """
        self._require("reconnect", Phase.LOOKUP, Phase.CREATE, Phase.STREAM, Phase.READ, Phase.FETCH)
        if refused:
            cause = "connection refused" if error is None else _cause(error)
            raise self._failed(NoServer(f"nothing listens at the server's address ({cause}){self._about()}")) from error
        if self._wait is None:  # nothing the server said: the attempt failed
            cause = "the stream closed before its terminal event" if error is None else _cause(error)
            self._next(self._dropped(), _Wait(_Pause.RETRY, cause))
        wait, self._wait = self._wait, None
        assert wait is not None
        attempt, delay = 0, 0.0
        match wait.pause:
            case _Pause.NEXT:
                return None
            case _Pause.SWITCH:
                pass
            case _Pause.POLL:
                delay, self._polls = self.backoff.delay(self._polls, self.rng), self._polls + 1
            case _Pause.RETRY:
                self._failures = attempt = self._failures + 1
                if attempt > self.max_retries:
                    lost = ConnectionLost(f"gave up after {self.max_retries} retries without progress ({wait.cause})"
                                          f"{self._about()}")
                    raise self._failed(lost) from error
                delay = max(self.backoff.delay(attempt - 1, self.rng), wait.retry_after or 0.0)
            case _:
                assert_never(wait.pause)
        if now + delay >= self.deadline:
            raise self.timed_out(wait.cause)
        self.reconnects += 1
        return Reconnect(attempt, delay, wait.cause, self.last_event_id if self.phase is Phase.STREAM else None)

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

    def _event(self, sse: ServerSentEvent) -> StreamEvent | None:
        """One dispatched SSE event: checked against the seqs delivered, read by the wire."""
        if self.message_id is None:
            self.message_id = (sse.id or "").rpartition(":")[0] or None
        try:
            seq = parse_event_id(sse.id or "", self.message_id or "")
        except ValueError as exc:
            raise self._failed(ClientError(f"unexpected event id: {exc}")) from None
        if self.last_seq is not None and seq <= self.last_seq:
            return None  # already delivered: a replay after a reconnect
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq != expected:
            raise self._failed(ClientError(f"event {seq} arrived where {expected} was due: the stream has a gap"))
        self.last_seq = seq
        self._progressed()
        try:
            data = self.wire.decode(sse.data)
        except ValueError:
            raise self._failed(ClientError(f"event {sse.id} does not hold JSON: {sse.data[:100]!r}")) from None
        reading = self._reading
        read = self.wire.read(sse.event, data, reading)
        self._add(read)
        if reading.error is not None:
            raise self._failed(StreamError(*reading.error))
        if reading.terminal:
            self._terminal()
        return StreamEvent(seq, sse.event, data, read.text, read.reasoning, read.tool_deltas, read.tool_calls)

    def _terminal(self) -> None:
        reading = self._reading
        if reading.usage is None:  # an OpenAI stream without include_usage: the stored message has it
            self._next(Trigger.FALLBACK, _Wait(_Pause.SWITCH, "the stream had no usage; reading the message"))
            return
        self.final = FinalMessage(self._named(), self.text, reading.stop_reason, reading.stop_sequence,
                                  reading.usage, reading.model, reading.cancelled, self.tool_calls, self.reasoning)
        self._move(Trigger.FINISHED)

    def _identify(self, status: Any) -> None:
        """The lookup's answer (``GET /v1/messages/{id}``) names the message's surface."""
        surface = status.get("surface") if isinstance(status, dict) else None
        if not isinstance(surface, str) or surface not in WIRES:
            raise self._failed(ClientError(f"the message is on surface {surface!r}, which this client does not"
                                           f" read{self._about()}"))
        self._wire = WIRES[surface]
        self._next(Trigger.IDENTIFIED, _Wait(_Pause.NEXT))

    def _from_stored(self, stored: Stored, body: Any) -> list[StreamEvent]:
        """Continue from the stored message: what it holds beyond what was streamed, then poll,
        fail or finish. Its tool calls count once it has ended (a running one's last call may be
        cut short)."""
        text = self._rest(stored.text, self.text, "text")
        reasoning = self._rest(stored.reasoning, self.reasoning, "reasoning")
        done = self._reading.calls.done
        calls = () if stored.running else stored.tool_calls[len(done):]
        events = []
        if text or reasoning or calls:
            self._add(Read(text, reasoning, tool_calls=calls))
            done.extend(calls)
            self._progressed()
            events.append(StreamEvent(None, "fallback", body, text, reasoning, tool_calls=calls))
        if stored.running:
            self._next(Trigger.GENERATING, _Wait(_Pause.POLL, "the message is still generating"))
        elif stored.error is not None:
            raise self._failed(StreamError(*stored.error))
        else:
            self.final = FinalMessage(self._named(), self.text, stored.stop_reason, stored.stop_sequence,
                                      stored.usage, stored.model or self._reading.model, stored.cancelled,
                                      self.tool_calls, self.reasoning)
            self._move(Trigger.FINISHED)
        return events

    def _rest(self, stored: str, have: str, what: str) -> str:
        if not stored.startswith(have):
            raise self._failed(ClientError(f"the stored {what} does not continue the streamed {what}"))
        return stored[len(have):]

    def _json(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise self._failed(ClientError(f"expected JSON, got {body[:100]!r}")) from None

    def _add(self, read: Read) -> None:
        if read.text:
            self._parts.append(read.text)
        if read.reasoning:
            self._reasoning.append(read.reasoning)

    def _progressed(self) -> None:
        """Something new arrived: the count of failed attempts (and of polls) starts again."""
        self._failures = self._polls = 0

    def _dropped(self) -> Trigger:
        """The trigger of a failed attempt: a create request that named no message yet is sent again."""
        return Trigger.UNANSWERED if self.message_id is None else Trigger.DROPPED

    def _next(self, trigger: Trigger, wait: _Wait) -> None:
        self._move(trigger)
        self._wait = wait

    def _move(self, trigger: Trigger) -> None:
        """The one place the phase changes.

        Raises:
            PhaseError: :data:`TRANSITIONS` has no ``trigger`` in this phase.
        """
        try:
            self.phase = TRANSITIONS[self.phase][trigger]
        except KeyError:
            raise PhaseError(f"{trigger.name} is not a move in phase {self.phase.name}") from None

    def _require(self, what: str, *phases: Phase) -> None:
        if self.phase not in phases:
            raise PhaseError(f"{what} is not allowed in phase {self.phase.name}")

    def _named(self) -> str:
        """The message id, once an answer has named it."""
        if self.message_id is None:
            raise PhaseError(f"no message id yet in phase {self.phase.name}")
        return self.message_id

    def _about(self) -> str:
        return f" (message {self.message_id})" if self.message_id else ""

    def _failed(self, error: _E) -> _E:
        error.message_id, error.text = self.message_id, self.text
        self.error = error
        self._move(Trigger.ERROR)
        return error


def _deadline(now: float, timeout: float | None) -> float:
    return math.inf if timeout is None else now + timeout
