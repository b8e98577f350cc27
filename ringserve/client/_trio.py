"""The Trio shell: :class:`AsyncClient` and :class:`AsyncMessageStream` over ``httpx.AsyncClient``."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Self

import httpx
import httpx_sse
import trio

from ringserve.client._errors import ClientError
from ringserve.client._models import Backoff, FinalMessage, Reconnect, StreamEvent
from ringserve.client._resume import ResumeState, auth_headers, message_path
from ringserve.client._shell import CANCEL_TIMEOUT, DEFAULT_URL, Settings, StreamView, is_event_stream, timeouts
from ringserve.client._sync import Client

class AsyncMessageStream(StreamView):
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
            timeout = timeouts(state, trio.current_time(), client._settings.connect_timeout,
                                client._settings.idle_timeout)
            error: httpx.TransportError | None = None
            try:
                async with client.http.stream(request.method, request.url, headers=request.headers,
                                              json=request.json, timeout=timeout) as response:
                    if is_event_stream(response):
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
        self._settings = Settings(api_key, timeout, idle_timeout, connect_timeout, max_retries, backoff, rng)
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
                                                headers=auth_headers(self._settings.api_key),
                                                timeout=self._settings.connect_timeout))

    async def cancel(self, message_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/messages/{id}/cancel``; see :meth:`Client.cancel`."""
        return Client._json(await self.http.post(message_path(message_id, "/cancel"),
                                                 headers=auth_headers(self._settings.api_key),
                                                 timeout=timeout or self._settings.connect_timeout))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
