"""Transport care for long-lived connections: TCP options, the slow-reader watchdog, aborts.

hypercorn's trio worker writes to a socket inside a shielded cancel scope
(``hypercorn/trio/tcp_server.py``, ``TCPServer.protocol_send``), so a peer
that stops reading pins the task writing to it, and neither a timeout around
the ASGI ``send`` nor cancelling the request can free it. Two layers deal
with that here:

* **Kernel**: the listening sockets get ``TCP_USER_TIMEOUT`` (unacknowledged
  data, zero-window probes included since Linux 5.11, kill the connection
  after that long) and keep-alive probes (a peer that vanished while nothing
  was being sent is noticed). Linux copies both onto every accepted socket.
  See :func:`tune_listening_socket` and :class:`HypercornConfig`; the server
  uses twice ``slow_reader_timeout``, so this backstop, which also catches
  writes the watchdog does not see, normally comes second.
* **Application**: :class:`SendWatchdog` times every ASGI ``send``. One
  blocked longer than ``slow_reader_timeout`` seconds has its request
  cancelled and its HTTP/2 stream reset (``RST_STREAM``, the connection's
  other streams go on), or its HTTP/1.x connection aborted;
  a send still blocked at the next check has its TCP connection aborted:
  :func:`abort_connection` shuts the socket down with ``SO_LINGER`` 0, which
  wakes the pinned write with ``EPIPE`` and makes the close a reset, so the
  kernel drops the unsent bytes too. The reader is released and can resume
  with ``Last-Event-ID``; the generation is not affected (the disconnect
  policy decides, as for any reader that leaves).

HTTP/2 needs two fixes to hypercorn for that (:class:`_StreamBuffer`,
:class:`_H2Protocol`): unpatched, a stream whose flow-control window stays
shut never blocks its sender, so its bytes pile up in hypercorn without
bound, and a send waiting on a stream buffer is never woken once its
connection closes.

The drain ends with :meth:`HypercornConfig.reset_connections` for every
connection still open once every stream has had its terminal event and a
short flush, so a client that stopped reading cannot keep the server from
exiting.
"""

from __future__ import annotations

import contextlib
import errno
import http
import logging
import math
import os
import socket
import struct
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import attrs
import h11
import h2.errors
import h2.events
import h2.exceptions
import hypercorn.config
import hypercorn.events
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.protocol.http_stream
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import trio

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.metrics import WatchdogStatistics
from ringserve.surfaces import registry
from ringserve.surfaces.base import dumps

__all__ = [
    "RESET_STREAM",
    "BindError",
    "HypercornConfig",
    "SendWatchdog",
    "abort_connection",
    "find_tcp_socket",
    "isolate_connection_faults",
    "tune_listening_socket",
]

log = logging.getLogger("ringserve")

#: ASGI scope key of an HTTP/2 request: a no-argument callable that resets its stream
#: (``RST_STREAM`` ``CANCEL``) and tells hypercorn and the app as if the client had.
RESET_STREAM = "ringserve.reset_stream"

#: Keep-alive probes sent before a silent peer is given up (with ``TCP_USER_TIMEOUT``
#: set, Linux gives up once that has passed instead).
KEEPALIVE_PROBES = 3


def tune_listening_socket(sock: socket.socket, timeout: float) -> None:
    """Set ``TCP_USER_TIMEOUT`` and keep-alive probes on a TCP socket (seconds).

    ``TCP_USER_TIMEOUT`` (RFC 5482; Linux ``tcp(7)``) is ``timeout`` in
    milliseconds: sent data unacknowledged that long, or a zero receive
    window that long, ends the connection with ``ETIMEDOUT``. Keep-alive
    probes start after ``timeout / 3`` seconds of silence and repeat every
    ``timeout / 3`` seconds (at least 1 s each). On a listening socket Linux
    copies both onto every accepted connection. Options the platform lacks
    are skipped; unix sockets are left alone.

    Args:
        sock: a TCP socket, before or after ``listen()``.
        timeout: seconds (> 0); the server passes twice ``slow_reader_timeout``.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probe = max(1, math.ceil(timeout / 3))
    for name, value in (
        ("TCP_KEEPIDLE", probe),
        ("TCP_KEEPINTVL", probe),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", max(1, round(timeout * 1000))),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class BindError(Exception):
    """The server cannot listen where ``[server] host`` and ``port`` say: the port is taken, the
    address is not one of this machine's, or a port below 1024 needs a right the process lacks.
    The message is one line naming the address and the system's reason."""


class HypercornConfig(hypercorn.config.Config):
    """hypercorn's config whose listening sockets get :func:`tune_listening_socket`, and which
    knows every connection open on them (:class:`_TCPServer` enters and leaves ``connections``).

    Attributes:
        tcp_user_timeout: seconds for :func:`tune_listening_socket`; 0 leaves
            the sockets as hypercorn makes them.
        connections: the connections open now.
    """

    tcp_user_timeout: float = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.connections: set[_TCPServer] = set()

    def reset_connections(self) -> int:
        """Reset every connection open now (as :func:`abort_connection` does): any write pinned
        on one wakes with ``EPIPE`` and hypercorn ends it.

        Returns:
            How many connections were reset.
        """
        for connection in self.connections:
            _reset_socket(connection.socket())
        return len(self.connections)

    def create_sockets(self) -> hypercorn.config.Sockets:
        """hypercorn's listening sockets, tuned.

        Raises:
            BindError: a socket could not be bound (``bind(2)``, or the host's name not resolved).
        """
        try:
            sockets = super().create_sockets()
        except OSError as exc:
            hint = ": another process has that port (choose another: --port or [server] port)" \
                if exc.errno == errno.EADDRINUSE else ""
            raise BindError(f"cannot listen on {', '.join(self.bind)}: {exc.strerror or exc}{hint}") from None
        if self.tcp_user_timeout > 0:
            for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
                tune_listening_socket(sock, self.tcp_user_timeout)
        return sockets


def _fd_dir() -> str:
    return "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def _address(addr: Any) -> tuple[str, int] | None:
    if isinstance(addr, (tuple, list)) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return None


def find_tcp_socket(local: Any, peer: Any) -> socket.socket | None:
    """A duplicate of this process's TCP socket connecting ``local`` to ``peer``.

    The ASGI scope names a connection only by its addresses (``scope["server"]``
    and ``scope["client"]``, ``(host, port)``), so this walks the process's
    file descriptors (``/proc/self/fd``) and compares each socket's
    ``getsockname()`` and ``getpeername()``; O(open descriptors), for the rare
    abort only.

    Returns:
        A new socket object on a ``dup`` of the descriptor (the caller closes
        it; shutting it down affects the connection itself), or None.
    """
    want = (_address(local), _address(peer))
    if None in want:
        return None
    for name in os.listdir(_fd_dir()):
        try:
            sock = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, ValueError):
            continue
        try:
            if (_address(sock.getsockname()), _address(sock.getpeername())) == want:
                return sock
        except OSError:
            pass
        sock.close()
    return None


def abort_connection(local: Any, peer: Any) -> bool:
    """Reset the TCP connection ``local`` ↔ ``peer`` of this process.

    Sets ``SO_LINGER`` to 0 (the final close sends RST and frees the unsent
    bytes) and shuts both directions down: a write pinned on the full socket
    wakes with ``EPIPE`` and the read loop sees end of file, so hypercorn
    ends the connection its usual way and closes the descriptor itself.

    Returns:
        Whether the connection was found.
    """
    sock = find_tcp_socket(local, peer)
    if sock is None:
        return False
    with sock:
        _reset_socket(sock)
    return True


def _reset_socket(sock: socket.socket | trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


@attrs.define(eq=False)
class _Send:
    started: float
    scope: dict[str, Any]
    cancel_scope: trio.CancelScope
    dropped: bool = False
    aborted: bool = False


@attrs.define(eq=False)
class SendWatchdog:
    """Drops readers whose writes are blocked longer than ``timeout`` seconds.

    Every ASGI ``send`` of a request runs inside :meth:`watch`; :meth:`run`
    (one task in the server nursery) checks every ``min(timeout / 4, 1)``
    seconds. A send older than ``timeout`` gets, once, its request's cancel
    scope cancelled and ``on_drop()`` called, and then its HTTP/2 stream
    reset (the scope's :data:`RESET_STREAM`; this wakes the send, also the
    final one that the app shields, and leaves the connection's other streams
    alone) or, without one (HTTP/1.x: hypercorn shields its socket writes, so
    cancelling cannot reach them), its connection aborted at once. A send
    still there at the next check has its connection aborted (an HTTP/2
    write pinned on the socket itself).

    Args:
        timeout: seconds (> 0), ``server.slow_reader_timeout``.
        on_drop: called with no arguments once per dropped reader (metrics).
        clock: seconds; ``trio.current_time`` by default.

    Ownership: only the Trio thread touches it; :meth:`watch` enters and
    leaves synchronously, :meth:`check` never awaits.
    """

    timeout: float
    on_drop: Callable[[], None] | None = None
    clock: Callable[[], float] = trio.current_time
    _sends: dict[int, _Send] = attrs.field(factory=dict, init=False)
    _next_key: int = attrs.field(default=0, init=False)
    _dropped: int = attrs.field(default=0, init=False)
    _aborted: int = attrs.field(default=0, init=False)

    @contextlib.contextmanager
    def watch(self, scope: dict[str, Any], cancel_scope: trio.CancelScope) -> Iterator[None]:
        """Time one ``send`` of the request ``scope`` (ASGI), cancellable by ``cancel_scope``."""
        key = self.started(scope, cancel_scope)
        try:
            yield
        finally:
            self.finished(key)

    def started(self, scope: dict[str, Any], cancel_scope: trio.CancelScope) -> int:
        """:meth:`watch` without the context manager: a send starts; the key for :meth:`finished`."""
        key = self._next_key
        self._next_key += 1
        self._sends[key] = _Send(self.clock(), scope, cancel_scope)
        return key

    def finished(self, key: int) -> None:
        """The send that :meth:`started` gave ``key`` ended (returned or raised)."""
        del self._sends[key]

    def check(self) -> int:
        """Act on every send older than the timeout (see the class docstring).

        Returns:
            How many readers were newly dropped.
        """
        now = self.clock()
        dropped = 0
        for send in list(self._sends.values()):
            if now - send.started < self.timeout:
                continue
            if not send.dropped:
                send.dropped = True
                dropped += 1
                self._dropped += 1
                log.warning(
                    "dropping a slow reader: %s %s from %s, a write blocked for %.1f s",
                    send.scope.get("method"), send.scope.get("path"), _peer(send.scope), now - send.started,
                )
                send.cancel_scope.cancel()
                if self.on_drop is not None:
                    self.on_drop()
                reset_stream = send.scope.get(RESET_STREAM)
                if reset_stream is not None:
                    reset_stream()
                else:
                    self._abort(send)
            else:
                self._abort(send)
        return dropped

    def _abort(self, send: _Send) -> bool:
        if send.aborted:
            return False  # already reset; the write is unwinding
        send.aborted = True
        found = abort_connection(send.scope.get("server"), send.scope.get("client"))
        self._aborted += found
        return found

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The check loop; start it in the server nursery. Never returns.

        Cancellation: safe at any point (:meth:`check` is synchronous).
        """
        interval = min(self.timeout / 4, 1.0)
        task_status.started()
        while True:
            await trio.sleep(interval)
            self.check()

    def statistics(self) -> WatchdogStatistics:
        """A frozen snapshot."""
        now = self.clock()
        oldest = min((s.started for s in self._sends.values()), default=now)
        return WatchdogStatistics(
            sends_in_flight=len(self._sends),
            oldest_send_seconds=now - oldest,
            readers_dropped_total=self._dropped,
            connections_aborted_total=self._aborted,
        )


def _peer(scope: dict[str, Any]) -> str:
    client = _address(scope.get("client"))
    return "?" if client is None else f"{client[0]}:{client[1]}"


# -- hypercorn per-connection faults ------------------------------------------------------------
#
# The classes below are installed into hypercorn by :func:`isolate_connection_faults` (called by
# ``serve``). They are ringserve's own subclasses, swapped in by name; site-packages is untouched.


class _StreamBuffer(hypercorn.protocol.h2.StreamBuffer):
    """hypercorn's per-stream send buffer, paused by what it holds rather than by what it sent.

    ``push`` waits once the buffer holds ``BUFFER_HIGH_WATER`` (32 KiB) until
    ``pop`` lets it go on. hypercorn lets it go on whenever one ``pop`` returns
    less than ``BUFFER_LOW_WATER`` (16 KiB), and a stream whose flow-control
    window is shut (a client with ``SETTINGS_INITIAL_WINDOW_SIZE`` 0, or one
    that stopped reading) pops nothing, again and again: its sender never
    blocked and the buffer took the whole answer. Here ``pop`` lets it go on
    only once the buffer holds less than ``BUFFER_LOW_WATER``, so a stream
    buffers at most the high-water mark plus two sends, and a send to a shut
    window blocks (which :class:`SendWatchdog` sees).
    """

    async def pop(self, max_length: int) -> bytes:
        data = bytes(self.buffer[:max_length])
        del self.buffer[:max_length]
        if len(self.buffer) < hypercorn.protocol.h2.BUFFER_LOW_WATER:
            await self._paused.set()
        if not self.buffer:
            await self._is_empty.set()
        return data


class _H2Protocol(hypercorn.protocol.h2.H2Protocol):
    """hypercorn's HTTP/2 protocol with three fixes.

    * Body data for a stream it has already closed is dropped: when the app
      answers before the request body has fully arrived (401, 404, 413...),
      hypercorn removes the stream; the DATA frames still in flight then hit
      ``self.streams[stream_id]`` and raise ``KeyError`` out of the connection
      (its ``StreamEnded`` branch already ignores this case). The data is
      acknowledged for flow control and dropped.
    * Every request's scope gets :data:`RESET_STREAM`, which resets its stream.
    * When the connection closes, or its task group is cancelled (a shutdown),
      every stream buffer is closed, which wakes the sends waiting on them
      (unpatched, a send waiting for a shut window to drain its stream's last
      bytes waited forever, and the app shields that send, so the connection
      task and the server's shutdown never ended).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ended = trio.Event()

    async def initiate(self, *args: Any, **kwargs: Any) -> None:
        await super().initiate(*args, **kwargs)
        self.task_group.spawn(self._close_buffers_at_end)

    async def _close_buffers_at_end(self) -> None:
        try:
            await self._ended.wait()
        finally:  # closing never checkpoints, so it runs to the end also when cancelled
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    async def handle(self, event: hypercorn.events.Event) -> None:
        await super().handle(event)
        if isinstance(event, hypercorn.events.Closed):
            self._ended.set()

    async def _handle_events(self, events: list[Any]) -> None:
        # One at a time: a stream is created by its RequestReceived, which may come in the same
        # batch as its first DataReceived.
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                await super()._handle_events([event])
        await self._flush()

    async def _create_stream(self, request: h2.events.RequestReceived) -> None:
        await super()._create_stream(request)
        stream = self.streams.get(request.stream_id)
        if isinstance(stream, hypercorn.protocol.http_stream.HTTPStream):
            # The app has not run yet: it was only scheduled, and holds this same scope dict.
            scope = cast(dict[str, Any], stream.scope)  # RESET_STREAM is an ASGI extension key
            scope[RESET_STREAM] = partial(self.task_group.spawn, self._reset_stream, request.stream_id)

    async def _reset_stream(self, stream_id: int) -> None:
        """``RST_STREAM`` (``CANCEL``) for ``stream_id``; then as for one from the client: the
        stream's buffer is closed (waking its send), and the app gets ``http.disconnect``."""
        buffer = self.stream_buffers.get(stream_id)
        if buffer is None or self.closed:
            return  # it has ended already, or the whole connection has
        with contextlib.suppress(h2.exceptions.ProtocolError):  # closed meanwhile
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await buffer.close()
        await self._close_stream(stream_id)
        await self._window_updated(stream_id)  # the send task drops the stream's buffer
        await self._flush()


class _H11Protocol(hypercorn.protocol.h11.H11Protocol):
    """hypercorn's HTTP/1.1 protocol whose own error answers have a JSON body in the error shape
    of the registry's default surface (``surfaces/registry.py`` ``SURFACES.default``: OpenAI's,
    as the app's answers outside ``/v1/messages``) instead of an empty one.

    hypercorn answers by itself a request that h11 cannot parse (a NUL or a
    newline in a header, a malformed request line: 400; headers too large:
    431), and closes the connection. Nothing of such a request (path,
    headers) is trusted to choose a surface by.
    """

    async def _send_error_response(self, status_code: int) -> None:
        phrase = http.HTTPStatus(status_code).phrase
        error = RingserveError(ErrorKind.INVALID_REQUEST, f"malformed HTTP request ({status_code} {phrase})")
        body = dumps(registry.SURFACES.default.error_json(error)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


class _TCPServer(hypercorn.trio.tcp_server.TCPServer):
    """hypercorn's per-connection task; a fault in one connection closes that connection only,
    and the connection is in its config's ``connections`` while it runs (:class:`HypercornConfig`).

    Unpatched, an exception escaping a connection's protocol code reaches
    ``trio.serve_listeners``' nursery and stops the whole server, and every
    stream with it.
    """

    def socket(self) -> trio.socket.SocketType:
        """The connection's TCP socket (under TLS too)."""
        return getattr(self.stream, "transport_stream", self.stream).socket

    async def run(self) -> None:
        connections: set[_TCPServer] = getattr(self.config, "connections", set())
        connections.add(self)
        try:
            await super().run()
        except BaseException as exc:
            # hypercorn's task group wraps a fault together with its siblings' Cancelled.
            errors = exc.split(trio.Cancelled)[1] if isinstance(exc, BaseExceptionGroup) else exc
            if errors is None or not isinstance(errors, Exception):
                raise
            log.error("an HTTP connection failed; it is closed, the server goes on", exc_info=errors)
            with contextlib.suppress(Exception), trio.CancelScope(shield=True):
                await self.stream.aclose()
        finally:
            connections.discard(self)


def isolate_connection_faults() -> None:
    """Install :class:`_StreamBuffer`, :class:`_H2Protocol`, :class:`_H11Protocol` and
    :class:`_TCPServer` into hypercorn (idempotent)."""
    # hypercorn has no hook for these classes: they are replaced in its modules (hence the ignores).
    hypercorn.protocol.h2.StreamBuffer = _StreamBuffer  # type: ignore[misc]
    hypercorn.protocol.H2Protocol = _H2Protocol  # type: ignore[misc]
    hypercorn.protocol.H11Protocol = _H11Protocol  # type: ignore[misc]
    hypercorn.trio.run.TCPServer = _TCPServer  # type: ignore[misc]
