# Generated from _trio.py by scripts/unasync.py: edit _trio.py, then run the script.
"""The sync shell of the client: :class:`Client` and :class:`MessageStream` over httpx.

The shell sends the requests :class:`~ringserve.client._resume.ResumeState` asks for, hands it
what arrives, waits as it says, and delivers the events it returns; every decision is the
state's. ``_sync.py`` is generated from ``_trio.py`` by ``scripts/unasync.py`` (httpcore's
pattern; ``tests/client/test_unasync.py`` checks that it is up to date): edit ``_trio.py``, then
run ``python scripts/unasync.py``.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Iterator, Callable, Mapping, Sequence
from contextlib import closing
from typing import Any, Self, cast

import httpx

from ringserve.client._errors import ClientError
from ringserve.client._models import Backoff, FinalMessage, Reconnect, StreamEvent
from ringserve.client._resume import Body, ResumeState, auth_headers
from ringserve.client._shell import (
    CANCEL_TIMEOUT,
    DEFAULT_URL,
    Settings,
    StreamView,
    SyncBackend,
    is_refused,
    json_answer,
)
from ringserve.client._wires import message_path


class MessageStream(StreamView):
    """A resuming stream of one message: ``with client.stream(...) as stream``.

    Iterate it for :class:`~ringserve.client.StreamEvent` values, or
    :attr:`text_stream` for the text; :meth:`final_message` reads to the end.
    Leaving the ``with`` block (or :meth:`close`) before the end
    cancels the generation on the server if this stream created it (best
    effort, at most :data:`CANCEL_TIMEOUT` seconds).
    """

    def __init__(self, client: Client, state: ResumeState, *, owned: bool,
                 on_reconnect: Callable[[Reconnect], None] | None) -> None:
        self._client = client
        self._state = state
        self._owned = owned
        self._on_reconnect = on_reconnect
        self._events = self._run()
        self._cancelled = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> StreamEvent:
        with SyncBackend.deadline(self._state.deadline):
            return self._events.__next__()
        if self._state.done:  # the final message came as the deadline passed
            raise StopIteration
        raise self._state.timed_out()

    @property
    def text_stream(self) -> Iterator[str]:
        """The reply text, delta by delta."""
        return (event.text for event in self if event.text)

    def final_message(self) -> FinalMessage:
        """Read to the end; the final message.

        Raises:
            ClientError: any error that ended the stream (see the package doc).
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
        with SyncBackend.shield():
            self._events.close()
            if (message_id := self._cancel_on_close()) is not None:
                with SyncBackend.limit(CANCEL_TIMEOUT):
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
            timeout = client._settings.timeouts(state, SyncBackend.now())
            error: httpx.TransportError | None = None
            try:
                opened = client.http.stream(request.method, request.url, headers=request.headers, json=request.json,
                                            timeout=timeout)
                with opened as response:
                    client.reached = True
                    if state.received(response.status_code, response.headers) is Body.WHOLE:
                        for event in state.answered(response.status_code, response.headers, response.read()):
                            yield event
                    else:
                        # httpx types it as an iterator; it is a generator, closed here if the stream leaves early
                        with closing(cast("Generator[bytes, None, None]", response.iter_bytes())) as chunks:
                            for chunk in chunks:
                                for event in state.feed(chunk):
                                    yield event
                                if state.leave:
                                    break
                                state.check_deadline(SyncBackend.now())
            except httpx.TransportError as exc:
                error = exc
            if state.done:
                return
            reconnect = state.reconnect(error, SyncBackend.now(),
                                        refused=error is not None and not client.reached and is_refused(error))
            if reconnect is not None:
                if self._on_reconnect is not None:
                    self._on_reconnect(reconnect)
                SyncBackend.sleep(reconnect.delay)


class Client:
    """A ringserve client (httpx) whose streams resume by themselves.

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
            :class:`~ringserve.client.ConnectionLost`.
        backoff: the wait between attempts.
        rng: randomness for the jitter (tests pass a seeded one).
        transport: an httpx transport (tests).

    Attributes:
        reached: whether the server has answered any of this client's
            requests: until then a refused connection raises
            :class:`~ringserve.client.NoServer` at once (nothing listens);
            after, it is a drop, retried (a server restarting).
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout: float | None = 600.0,
                 idle_timeout: float | None = 60.0, connect_timeout: float = 10.0, max_retries: int = 8,
                 backoff: Backoff = Backoff(), rng: random.Random | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._settings = Settings(api_key, timeout, idle_timeout, connect_timeout, max_retries, backoff, rng)
        self.http = httpx.Client(base_url=base_url, transport=transport)
        self.reached = False

    def stream(self, prompt: str | Sequence[Mapping[str, Any]], *, max_tokens: int = 1024,
               surface: str = "anthropic", model: str = "ringserve", system: str | None = None,
               on_reconnect: Callable[[Reconnect], None] | None = None, **params: Any) -> MessageStream:
        """Create a message and stream it (the request is sent on the first read).

        Args:
            prompt: a user prompt, or a list of ``{"role", "content"}`` turns.
            max_tokens: the most tokens to generate.
            surface: ``"anthropic"`` (``POST /v1/messages``), ``"openai"``
                (``POST /v1/chat/completions``) or ``"responses"``
                (``POST /v1/responses``).
            model: the model name sent (ringserve answers any name unless
                ``model.strict_model_name`` is set).
            system: a system prompt (``instructions`` on Responses).
            on_reconnect: called before each wait and new request.
            **params: more body fields (``temperature``, ``tools``,
                ``stop_sequences`` or ``stop``, ...).

        Raises:
            ValueError: unknown surface.
        """
        state = self._settings.create(SyncBackend.now(), surface, prompt, model=model, max_tokens=max_tokens,
                                      system=system, params=params)
        return MessageStream(self, state, owned=True, on_reconnect=on_reconnect)

    def follow(self, message_id: str, *, surface: str | None = None,
               on_reconnect: Callable[[Reconnect], None] | None = None) -> MessageStream:
        """Stream an existing message from its first event (never cancels it). Without ``surface``
        the stream first reads the message's status (``GET /v1/messages/{id}``) to learn it.

        Raises:
            ValueError: unknown surface.
        """
        state = self._settings.follow(SyncBackend.now(), message_id, surface)
        return MessageStream(self, state, owned=False, on_reconnect=on_reconnect)

    def get_message(self, message_id: str) -> dict[str, Any]:
        """``GET /v1/messages/{id}``: status, text so far, stop reason, usage.

        Raises:
            APIError: an error answer.
        """
        headers, timeout = auth_headers(self._settings.api_key), self._settings.connect_timeout
        return json_answer(self.http.get(message_path(message_id), headers=headers, timeout=timeout))

    def cancel(self, message_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/messages/{id}/cancel``; the message's status once its generation has stopped.

        Raises:
            APIError: an error answer.
        """
        headers, timeout = auth_headers(self._settings.api_key), timeout or self._settings.connect_timeout
        return json_answer(self.http.post(message_path(message_id, "/cancel"), headers=headers, timeout=timeout))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
