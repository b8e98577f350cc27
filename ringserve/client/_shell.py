"""What the two shells share: their settings, the stream view, per-request timeouts, and the few
primitives where Trio and blocking code differ.

``_trio.py`` uses :class:`TrioBackend`; ``scripts/unasync.py`` writes ``_sync.py`` from it with
:class:`SyncBackend` in its place (httpcore's ``_backends``: one small interface, one class per
backend).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx
import trio

from ringserve.client._errors import APIError, StreamError
from ringserve.client._models import Backoff, ToolCall
from ringserve.client._resume import ResumeState, error_fields
from ringserve.client._wires import user_messages, wire

DEFAULT_URL = "http://127.0.0.1:8080"

#: Seconds a best-effort cancel on leaving a stream early may take.
CANCEL_TIMEOUT = 5.0


class TrioBackend:
    """Trio's clock, sleep and cancel scopes, as the Trio shell uses them."""

    @staticmethod
    def now() -> float:
        return trio.current_time()

    @staticmethod
    async def sleep(seconds: float) -> None:
        await trio.sleep(seconds)

    @staticmethod
    def deadline(at: float) -> trio.CancelScope:
        """A scope that stops its block at ``at``: the overall timeout, exact."""
        return trio.move_on_at(at)

    @staticmethod
    def limit(seconds: float) -> trio.CancelScope:
        """A scope that stops its block after ``seconds``."""
        return trio.move_on_after(seconds)

    @staticmethod
    def shield() -> trio.CancelScope:
        """A scope that an enclosing cancellation does not reach (cleanup)."""
        return trio.CancelScope(shield=True)


class SyncBackend:
    """The same for blocking code: the monotonic clock, ``time.sleep``, and scopes that do nothing
    (the sync shell bounds every connect and read by the time left, :meth:`Settings.timeouts`, instead)."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    @staticmethod
    def deadline(at: float) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def limit(seconds: float) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def shield() -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def is_refused(error: BaseException) -> bool:
    """Whether a connection failed with ``ECONNREFUSED`` (nothing listens there): a
    :class:`ConnectionRefusedError` among ``error``'s causes, which httpx and httpcore wrap, and trio
    groups (one per address it tried)."""
    seen, todo = set(), [error]
    while todo:
        exc = todo.pop()
        if isinstance(exc, ConnectionRefusedError):
            return True
        if id(exc) not in seen:
            seen.add(id(exc))
            todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
            if isinstance(exc, BaseExceptionGroup):
                todo += exc.exceptions
    return False


def json_answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a 200 answer.

    Raises:
        APIError: any other status.
    """
    if response.status_code != 200:
        raise APIError(response.status_code, *error_fields(response.content))
    body: dict[str, Any] = response.json()
    return body


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

    def follow(self, now: float, message_id: str, surface: str | None) -> ResumeState:
        return ResumeState.follow(message_id, surface=surface, now=now, timeout=self.timeout, api_key=self.api_key,
                                  backoff=self.backoff, max_retries=self.max_retries, rng=self.rng)

    def timeouts(self, state: ResumeState, now: float) -> httpx.Timeout:
        """The httpx timeouts of the next request of ``state``: ``connect_timeout`` and
        ``idle_timeout`` seconds, none past the overall deadline.

        Raises:
            RequestTimeout: the deadline has passed.
        """
        remaining = state.remaining(now)
        left = None if math.isinf(remaining) else remaining

        def cap(seconds: float | None) -> float | None:
            return left if seconds is None else seconds if left is None else min(seconds, left)

        connect = cap(self.connect_timeout)
        return httpx.Timeout(connect=connect, read=cap(self.idle_timeout), write=connect, pool=connect)


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
    def reasoning(self) -> str:
        """The reasoning text delivered so far."""
        return self._state.reasoning

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls completed so far."""
        return self._state.tool_calls

    @property
    def reconnects(self) -> int:
        """Requests made after a connection that did not finish the stream."""
        return self._state.reconnects

    def _cancel_on_close(self) -> str | None:
        """The id of the message to cancel as this stream closes, if any."""
        state = self._state
        # After a StreamError the server's generation is over; after any other error it may still run.
        if self._owned and not self._cancelled and state.final is None and not isinstance(state.error, StreamError):
            return state.message_id
        return None
