"""The client's values: usage, final message, stream event, reconnect, backoff, request."""

from __future__ import annotations

import random
from typing import Any

import attrs


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



@attrs.frozen
class Request:
    """One HTTP request the client should send next (paths are relative to the base URL)."""

    method: str
    url: str
    headers: dict[str, str] = attrs.field(repr=False)  # may hold the API key
    json: Any = None

