"""The client's values: usage, tool calls, final message, stream event, reconnect, backoff, request."""

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
class ToolCall:
    """A complete tool call of the reply.

    Attributes:
        call_id: the call's id in the surface's spelling (``toolu_...``, ``call_...``).
        name: the tool's name.
        arguments: the arguments, JSON text (of an object, unless the call
            was cut short by ``max_tokens`` or a cancel).
    """

    call_id: str
    name: str
    arguments: str


@attrs.frozen
class ToolCallDelta:
    """A piece of a tool call as it streams.

    Attributes:
        index: the call's place among the reply's tool calls, from 0 (text
            and reasoning do not count), the same on every surface.
        call_id: the call's id, on the call's first delta only ("" after).
        name: the tool's name, on the call's first delta only ("" after).
        arguments: the next fragment of the arguments' JSON text ("" on a
            first delta that carries none).
    """

    index: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""


@attrs.frozen
class FinalMessage:
    """A finished message.

    Attributes:
        id: the message id (``msg_...``, ``chatcmpl-...`` or ``resp_...``).
        text: the whole reply text.
        stop_reason: in the surface's spelling (Anthropic ``end_turn``,
            ``max_tokens``, ``stop_sequence``, ``tool_use``, ``refusal``,
            ``model_context_window_exceeded``; OpenAI Chat ``stop``,
            ``length``, ``tool_calls``, ``content_filter``; OpenAI Responses
            the response's ``status``, ``completed`` or ``cancelled``, or
            for an ``incomplete`` one its ``incomplete_details.reason``,
            ``max_output_tokens`` or ``content_filter``); a cancelled
            generation has the plain end of turn on the first two
            (``end_turn``, ``stop``).
        stop_sequence: the stop string that ended it, if any.
        usage: tokens billed.
        model: the model that answered.
        cancelled: True when a cancel ended the generation (the server's
            ``ringserve_cancelled`` key, or status ``cancelled``).
        tool_calls: the reply's tool calls, in order.
        reasoning: the reply's reasoning text (thinking blocks,
            ``reasoning_content``, reasoning items), "" when it has none.
    """

    id: str
    text: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    model: str = ""
    cancelled: bool = False
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""


@attrs.frozen
class StreamEvent:
    """One event of a message's stream, delivered once, with what it adds to the reply.

    Attributes:
        seq: the event's sequence number (the ``<seq>`` of its SSE id), or
            None for a ``"fallback"`` event.
        event: the SSE event type: Anthropic's names (``message_start``,
            ``content_block_delta``, ...) and the Responses types
            (``response.output_text.delta``, ...), ``"message"`` for OpenAI
            Chat chunks, or ``"fallback"`` for what was read from the stored
            message after the stream log was gone.
        data: the parsed JSON payload (``"[DONE]"`` stays a string; a
            fallback event holds the stored message's JSON).
        text: the reply text this event adds ("" for most non-delta events).
        reasoning: the reasoning text this event adds.
        tool_deltas: the pieces of tool calls this event carries.
        tool_calls: the tool calls this event completes.
    """

    seq: int | None
    event: str
    data: Any
    text: str = ""
    reasoning: str = ""
    tool_deltas: tuple[ToolCallDelta, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class Reconnect:
    """Why and when the client opens its next connection (passed to ``on_reconnect``).

    Attributes:
        attempt: consecutive failed attempts without a new event (0 when
            nothing failed: a switch to reading the stored message, or a poll).
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
    def _check_cap(self, _attribute: attrs.Attribute[float], value: float) -> None:
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
    """One HTTP request the client should send next (paths are relative to the base URL).

    Attributes:
        method: ``GET`` or ``POST``.
        url: the path, e.g. ``/v1/messages/msg_1/stream``.
        headers: the request headers (``Last-Event-ID`` on a resume).
        json: the JSON body of a POST, else None.
    """

    method: str
    url: str
    headers: dict[str, str] = attrs.field(repr=False)  # may hold the API key
    json: Any = None
