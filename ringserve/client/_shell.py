"""What both shells share: their settings, the stream view, per-request timeouts."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx

from ringserve.client._errors import StreamError
from ringserve.client._models import Backoff
from ringserve.client._resume import ResumeState
from ringserve.client._wires import user_messages, wire

DEFAULT_URL = "http://127.0.0.1:8080"


def timeouts(state: ResumeState, now: float, connect: float, idle: float | None) -> httpx.Timeout:
    """Per-request httpx timeouts: ``connect``/``idle`` seconds, none past the overall deadline."""
    remaining = state.remaining(now)
    left = None if math.isinf(remaining) else remaining

    def cap(seconds: float | None) -> float | None:
        return left if seconds is None else seconds if left is None else min(seconds, left)

    return httpx.Timeout(connect=cap(connect), read=cap(idle), write=cap(connect), pool=cap(connect))


def is_event_stream(response: httpx.Response) -> bool:
    content_type = response.headers.get("content-type", "").partition(";")[0].strip()
    return response.status_code == 200 and content_type == "text/event-stream"


@attrs.frozen
class Settings:
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
        body = wire(surface).body(user_messages(prompt), model=model, max_tokens=max_tokens, system=system,
                                   params=params)
        return ResumeState.create(surface, body, now=now, timeout=self.timeout, api_key=self.api_key,
                                  backoff=self.backoff, max_retries=self.max_retries, rng=self.rng)

    def follow(self, now: float, message_id: str) -> ResumeState:
        return ResumeState.follow(message_id, now=now, timeout=self.timeout, api_key=self.api_key,
                                  backoff=self.backoff, max_retries=self.max_retries, rng=self.rng)


#: Seconds a best-effort cancel on leaving a stream early may take.
CANCEL_TIMEOUT = 5.0


class StreamView:
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


