"""Request and reader limits (sans-I/O): plain checks that raise errors carrying their HTTP hint.

Two kinds of limit, both configured in the ``[limits]`` table:

* :func:`check_request` bounds what one generation request may carry: how
  many messages, and how many characters of text in all (system prompt,
  tool calls in the history and tool definitions included). The body-size cap (``server.max_body_bytes``, HTTP 413)
  comes first and is enforced by the HTTP layer.
* :class:`ReaderGate` bounds concurrent readers (SSE connections and
  non-stream waits): per message, and per client (the peer's address).

Every refusal is a :class:`~ringserve.core.errors.RingserveError`, so each
surface answers it in its own error shape (400 ``invalid_request_error``,
429 ``rate_limit_error``). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import attrs

from ringserve.core.errors import ErrorKind, RingserveError, invalid
from ringserve.core.events import GenerationRequest

__all__ = ["ReaderGate", "check_request", "message_texts", "tool_texts"]


def message_texts(request: GenerationRequest) -> Iterator[str]:
    """The texts of the messages that go into the prompt: each message's content and, for
    the tool calls in the history, each call's name and arguments."""
    for m in request.messages:
        yield m.content
        for call in m.tool_calls:
            yield call.name
            yield call.arguments


def tool_texts(request: GenerationRequest) -> Iterator[str]:
    """The texts of the request's tool definitions that go into the prompt: each tool's
    name, description and schema (rendered unless the tool choice is ``NONE``; counted always)."""
    for tool in request.tools:
        yield tool.name
        yield tool.description
        yield tool.parameters


def check_request(request: GenerationRequest, *, max_messages: int, max_text_chars: int) -> None:
    """Refuse a request with too many messages or too much text.

    Args:
        request: the parsed request (system prompt included in ``messages``).
        max_messages: the most messages (0: no limit).
        max_text_chars: the most characters of text in all, counted as
            Python ``str`` code points (0: no limit): the message texts
            (:func:`message_texts`: contents, and the names and arguments of
            tool calls in the history) and the tool definitions
            (:func:`tool_texts`).

    Raises:
        RingserveError: ``INVALID_REQUEST``, the message giving the limit and
            the count; ``param`` is ``messages``, or ``tools`` when the
            messages alone are within the limit.
    """
    n = len(request.messages)
    if max_messages and n > max_messages:
        raise invalid(f"messages: at most {max_messages} messages are accepted, got {n}", "messages")
    if max_text_chars:
        chars = sum(map(len, message_texts(request)))
        if chars > max_text_chars:
            raise invalid(
                f"messages: at most {max_text_chars} characters of message text are accepted, got {chars}",
                "messages",
            )
        chars += sum(map(len, tool_texts(request)))
        if chars > max_text_chars:
            raise invalid(
                f"tools: at most {max_text_chars} characters of text (messages and tool definitions) are"
                f" accepted, got {chars}",
                "tools",
            )


@attrs.define(eq=False)
class ReaderGate:
    """Counts concurrent readers per client and refuses the one over a limit.

    Sync and lock-free: every call runs on the Trio thread and never awaits,
    so no two requests interleave inside one (the ``MemoryLogStore`` rule).
    The per-message count is the log's own reader count, passed in by the
    caller, so every kind of reader of a message is counted once.

    Args:
        max_per_message: the most readers of one message (0: no limit).
        max_per_client: the most readers one client may hold at once, over
            all messages (0: no limit).
    """

    max_per_message: int
    max_per_client: int
    _by_client: Counter[str] = attrs.field(factory=Counter, init=False)

    def enter(self, client: str, message_readers: int = 0) -> Callable[[], None]:
        """Admit one more reader for ``client``.

        Args:
            client: who is reading (the peer's address).
            message_readers: readers the message already has.

        Returns:
            ``leave()``: gives the place back; idempotent, synchronous.

        Raises:
            RingserveError: ``RATE_LIMIT`` (HTTP 429, ``retry_after`` 1 s)
                when either limit is already reached; nothing is counted.
        """
        if self.max_per_message and message_readers >= self.max_per_message:
            raise RingserveError(
                ErrorKind.RATE_LIMIT,
                f"this message already has {message_readers} readers (the limit is {self.max_per_message})",
                retry_after=1,
                retryable=True,
            )
        held = self._by_client[client]
        if self.max_per_client and held >= self.max_per_client:
            raise RingserveError(
                ErrorKind.RATE_LIMIT,
                f"too many concurrent streams from this client ({held}; the limit is {self.max_per_client})",
                retry_after=1,
                retryable=True,
            )
        self._by_client[client] = held + 1
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self._by_client[client] -= 1
                if not self._by_client[client]:
                    del self._by_client[client]

        return leave

    def readers(self, client: str) -> int:
        """How many readers ``client`` holds now."""
        return self._by_client[client]
