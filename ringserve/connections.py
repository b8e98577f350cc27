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
  cancelled (enough for an HTTP/2 stream stalled on its own flow-control
  window) and, for HTTP/1.x or if it is still blocked at the next check, its
  TCP connection aborted: :func:`abort_connection` shuts the socket down with
  ``SO_LINGER`` 0, which wakes the pinned write with ``EPIPE`` and makes the
  close a reset, so the kernel drops the unsent bytes too. The reader is
  released and can resume with ``Last-Event-ID``; the generation is not
  affected (the disconnect policy decides, as for any reader that leaves).

The drain uses :meth:`SendWatchdog.abort_all` for writes still pinned once
every stream has its terminal event, so a non-reading client cannot keep the
server from exiting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import h2.events
import hypercorn.config
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import trio

__all__ = [
    "HypercornConfig",
    "SendWatchdog",
    "WatchdogStatistics",
    "abort_connection",
    "find_tcp_socket",
    "isolate_connection_faults",
    "tune_listening_socket",
]

log = logging.getLogger("ringserve")

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


class HypercornConfig(hypercorn.config.Config):
    """hypercorn's config whose listening sockets get :func:`tune_listening_socket`.

    Attributes:
        tcp_user_timeout: seconds for :func:`tune_listening_socket`; 0 leaves
            the sockets as hypercorn makes them.
    """

    tcp_user_timeout: float = 0.0

    def create_sockets(self) -> hypercorn.config.Sockets:
        sockets = super().create_sockets()
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
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    return True


@attrs.frozen
class WatchdogStatistics:
    """A snapshot of :class:`SendWatchdog`.

    Attributes:
        sends_in_flight: ASGI sends running now.
        oldest_send_seconds: how long the oldest of them has run (0 if none).
        readers_dropped_total: requests dropped because a send was blocked
            longer than the timeout (each counted once).
        connections_aborted_total: TCP connections reset by the watchdog or
            by :meth:`SendWatchdog.abort_all`.
    """

    sends_in_flight: int
    oldest_send_seconds: float
    readers_dropped_total: int
    connections_aborted_total: int


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
    scope cancelled and ``on_drop()`` called; an HTTP/1.x connection is also
    aborted at once (hypercorn shields HTTP/1 socket writes, so cancelling
    cannot reach them), any other one at the next check if the send is still
    there (an HTTP/2 stream stalled on its own flow-control window returns
    when cancelled, leaving the connection's other streams alone).

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
        key = self._next_key
        self._next_key += 1
        self._sends[key] = _Send(self.clock(), scope, cancel_scope)
        try:
            yield
        finally:
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
                if str(send.scope.get("http_version", "1.1")).startswith("1"):
                    self._abort(send)
            else:
                self._abort(send)
        return dropped

    def abort_all(self) -> int:
        """Abort the connection of every send in flight (the drain's last step).

        Returns:
            How many connections were found and reset.
        """
        aborted = 0
        for send in list(self._sends.values()):
            send.cancel_scope.cancel()
            aborted += self._abort(send)
        return aborted

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
# Two classes below are installed into hypercorn by :func:`isolate_connection_faults` (called by
# ``serve``). They are ringserve's own subclasses, swapped in by name; site-packages is untouched.


class _H2Protocol(hypercorn.protocol.h2.H2Protocol):
    """hypercorn's HTTP/2 protocol, tolerant of body data for a stream it has already closed.

    When the app answers before the request body has fully arrived (401, 404,
    413...), hypercorn removes the stream; the DATA frames still in flight then
    hit ``self.streams[stream_id]`` and raise ``KeyError`` out of the
    connection (its ``StreamEnded`` branch already ignores this case). The
    data is acknowledged for flow control and dropped.
    """

    async def _handle_events(self, events: list[Any]) -> None:
        # One at a time: a stream is created by its RequestReceived, which may come in the same
        # batch as its first DataReceived.
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                await super()._handle_events([event])
        await self._flush()


class _TCPServer(hypercorn.trio.tcp_server.TCPServer):
    """hypercorn's per-connection task; a fault in one connection closes that connection only.

    Unpatched, an exception escaping a connection's protocol code reaches
    ``trio.serve_listeners``' nursery and stops the whole server, and every
    stream with it.
    """

    async def run(self) -> None:
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


def isolate_connection_faults() -> None:
    """Install :class:`_H2Protocol` and :class:`_TCPServer` into hypercorn (idempotent)."""
    hypercorn.protocol.H2Protocol = _H2Protocol
    hypercorn.trio.run.TCPServer = _TCPServer
