"""The sync shell: :class:`Client` and :class:`MessageStream` over ``httpx.Client``."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Self

import httpx
import httpx_sse

from ringserve.client._errors import APIError, ClientError
from ringserve.client._models import Backoff, FinalMessage, Reconnect, StreamEvent
from ringserve.client._resume import ResumeState, auth_headers, error_fields, message_path
from ringserve.client._shell import CANCEL_TIMEOUT, DEFAULT_URL, Settings, StreamView, is_event_stream, timeouts

class MessageStream(StreamView):
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
            timeout = timeouts(state, time.monotonic(), client._settings.connect_timeout,
                                client._settings.idle_timeout)
            error: httpx.TransportError | None = None
            try:
                with client.http.stream(request.method, request.url, headers=request.headers,
                                        json=request.json, timeout=timeout) as response:
                    if is_event_stream(response):
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
        self._settings = Settings(api_key, timeout, idle_timeout, connect_timeout, max_retries, backoff, rng)
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
        return self._json(self.http.get(message_path(message_id), headers=auth_headers(self._settings.api_key),
                                        timeout=self._settings.connect_timeout))

    def cancel(self, message_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/messages/{id}/cancel``; the message's status once its generation has stopped.

        Raises:
            APIError: an error answer.
        """
        return self._json(self.http.post(message_path(message_id, "/cancel"),
                                         headers=auth_headers(self._settings.api_key),
                                         timeout=timeout or self._settings.connect_timeout))

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        if response.status_code != 200:
            raise APIError(response.status_code, *error_fields(response.content))
        return response.json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


