"""A TCP proxy for tests that drops connections: at random points, on demand, or by going silent.

It sits between a client and an in-process ringserve, so a test can break
connections the way a flaky network or a restarting load balancer does,
without any hook in the server. Everything runs in the test's Trio run.
"""

from __future__ import annotations

import random
import re
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from tests.support.server import fake_config, running_server

#: Bytes a pump reads at a time.
CHUNK = 4096


@attrs.frozen
class Cut:
    """What the proxy does to one connection.

    Attributes:
        after_bytes: server-to-client bytes forwarded before the connection
            ends (None: never); 0 ends it as soon as the server answers.
        at_accept: end it at once, before the request is forwarded.
        reset: end it with a TCP RST instead of a FIN.
        stall: at the cut, stop forwarding but keep the connection open
            (a silent, half-dead connection) instead of closing it.
    """

    after_bytes: int | None = None
    at_accept: bool = False
    reset: bool = False
    stall: bool = False


def random_cuts(rng: random.Random, *, p_cut: float = 0.7, max_bytes: int = 4000) -> Callable[[], Cut]:
    """A cut plan: each connection is cut with probability ``p_cut`` at a uniform byte offset.

    One cut in ten happens at accept, and half of the cuts are resets.
    """

    def plan() -> Cut:
        if rng.random() >= p_cut:
            return Cut()
        return Cut(after_bytes=rng.randint(0, max_bytes), at_accept=rng.random() < 0.1, reset=rng.random() < 0.5)

    return plan


@attrs.define(eq=False)
class DroppingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` and ends connections as ``plan`` says.

    Args:
        upstream_port: the server's port on 127.0.0.1.
        plan: called once per accepted connection.
        request_filter: rewrites each client-to-server chunk (e.g. :func:`forget_last_event_id`).

    Attributes:
        url: ``http://127.0.0.1:<port>`` once :meth:`run` has started.
        connections: connections accepted.
        cuts: connections the proxy ended (or stalled) itself.
    """

    upstream_port: int
    plan: Callable[[], Cut] = Cut
    request_filter: Callable[[bytes], bytes] | None = None
    url: str = ""
    connections: int = 0
    cuts: int = 0
    _live: set[trio.CancelScope] = attrs.field(factory=set)

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started(url)`` once listening."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.url)

    def cut_all(self) -> int:
        """End every open connection now (FIN); returns how many."""
        scopes = list(self._live)
        for scope in scopes:
            scope.cancel()
        self.cuts += len(scopes)
        return len(scopes)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        cut = self.plan()
        async with client:
            if cut.at_accept:
                self.cuts += 1
                _reset(client, cut.reset)
                return
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
            except OSError:
                return
            async with upstream:
                stalled = trio.Event()
                with trio.CancelScope() as scope:
                    self._live.add(scope)
                    try:
                        async with trio.open_nursery() as nursery:

                            async def finish() -> None:
                                nursery.cancel_scope.cancel()

                            nursery.start_soon(self._pump, client, upstream, None, finish, stalled,
                                               self.request_filter)
                            nursery.start_soon(self._pump, upstream, client, cut, finish, stalled)
                    finally:
                        self._live.discard(scope)
                if stalled.is_set():
                    await trio.sleep_forever()  # until the test ends: a silent connection
                _reset(client, cut.reset and cut.after_bytes is not None)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream, cut: Cut | None,
                    finish: Callable[[], object], stalled: trio.Event,
                    rewrite: Callable[[bytes], bytes] | None = None) -> None:
        budget = None if cut is None else cut.after_bytes
        try:
            while True:
                if budget == 0:
                    self.cuts += 1
                    if cut is not None and cut.stall:
                        stalled.set()
                    break
                data = await source.receive_some(CHUNK if budget is None else min(CHUNK, budget))
                if not data:
                    break
                await sink.send_all(data if rewrite is None else rewrite(data))
                if budget is not None:
                    budget -= len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await finish()


_LAST_EVENT_ID = re.compile(rb"^last-event-id:[^\r\n]*\r\n", re.IGNORECASE | re.MULTILINE)


def forget_last_event_id(chunk: bytes) -> bytes:
    """A request filter that deletes ``Last-Event-ID`` header lines, so the server replays from the start.

    It works on each chunk alone; a local client sends a request's head in one chunk.
    """
    return _LAST_EVENT_ID.sub(b"", chunk)


def _reset(stream: trio.SocketStream, reset: bool) -> None:
    """Make the coming close send an RST (SO_LINGER 0) instead of a FIN."""
    if reset:
        try:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass


@asynccontextmanager
async def server_behind_proxy(tmp_path: Path, plan: Callable[[], Cut] = Cut, *, server: dict[str, Any] | None = None,
                              stream: dict[str, Any] | None = None,
                              request_filter: Callable[[bytes], bytes] | None = None,
                              **engine: Any) -> AsyncIterator[tuple[Any, DroppingProxy]]:
    """A fake-engine server (one stream event per token) and a :class:`DroppingProxy` in front of it.

    Yields ``(server state, proxy)``: ``state.urls[0]`` is the server itself, ``proxy.url`` the way through.
    """
    config = fake_config(tmp_path, stream={"flush_tokens": 1, **(stream or {})}, server=server or {})
    async with running_server(config, **engine) as state:
        proxy = DroppingProxy(int(state.urls[0].rsplit(":", 1)[1]), plan, request_filter)
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            try:
                yield state, proxy
            finally:
                nursery.cancel_scope.cancel()


#: The client tests' reply: multi-byte characters, split across tokens by :func:`server_and_proxy`.
REPLY = "Résumé ✓ 👍🏽 你好 🇯🇵 Привет ½. " * 8


def server_and_proxy(tmp_path: Path, plan: Callable[[], Cut] = Cut, **kwargs: Any) -> Any:
    """:func:`server_behind_proxy` replying :data:`REPLY` (unless ``reply`` is given), cut into
    3-byte tokens."""
    kwargs.setdefault("reply", REPLY)
    kwargs.setdefault("piece_bytes", 3)
    return server_behind_proxy(tmp_path, plan, **kwargs)
