"""A raw HTTP/2 client on the ``h2`` library, for what httpx cannot do: streams whose receive window
never opens (``SETTINGS_INITIAL_WINDOW_SIZE`` = 0: what any HTTP/2 client ends up with once its
application stops reading), next to streams that read, on one connection, over h2c or TLS."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Callable
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio


@attrs.define
class H2Stream:
    """What one stream has received: response headers, body bytes, how it ended."""

    headers: dict[bytes, bytes] | None = None
    body: bytearray = attrs.Factory(bytearray)
    ended: bool = False
    reset_code: int | None = None  # RST_STREAM from the server


class H2Client:
    """One HTTP/2 connection; every stream's receive window starts at 0 and only the streams opened
    with ``read=True`` are given window (as they consume it).

    Use :func:`open_h2` to connect; call :meth:`run` in a task to receive.
    """

    def __init__(self, stream: trio.abc.Stream, authority: str, scheme: str) -> None:
        self.stream = stream
        self.authority, self.scheme = authority, scheme
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.conn.initiate_connection()
        self.streams: dict[int, H2Stream] = {}
        self.reading: set[int] = set()
        self.closed = False  # the server closed the connection (GOAWAY or end of file)
        self._changed = trio.Condition()
        self._sending = trio.Lock()

    async def _flush(self) -> None:
        async with self._sending:
            await self.stream.send_all(self.conn.data_to_send())

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                      read: bool, headers: dict[str, str] | None = None) -> int:
        """Send a request; its stream id. With ``read``, the body is let in as it arrives."""
        stream_id = self.conn.get_next_available_stream_id()
        payload = b"" if body is None else json.dumps(body).encode()
        heads = [(":method", method), (":scheme", self.scheme), (":authority", self.authority), (":path", path),
                 *(headers or {}).items()]
        if body is not None:
            heads += [("content-type", "application/json"), ("content-length", str(len(payload)))]
        self.streams[stream_id] = H2Stream()
        self.conn.send_headers(stream_id, heads, end_stream=body is None)
        if body is not None:
            self.conn.send_data(stream_id, payload, end_stream=True)
        if read:
            self.reading.add(stream_id)
            self.conn.increment_flow_control_window(65535, stream_id)
        await self._flush()
        return stream_id

    async def run(self) -> None:
        """Receive until the server closes the connection."""
        await self._flush()
        while not self.closed:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            events = self.conn.receive_data(data) if data else []
            for ev in events:
                stream = self.streams.get(getattr(ev, "stream_id", 0))
                if isinstance(ev, h2.events.ResponseReceived):
                    stream.headers = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    stream.body += ev.data
                    if ev.stream_id in self.reading and ev.flow_controlled_length:
                        # a reset in the same read may have closed the stream already: credit the connection
                        with contextlib.suppress(h2.exceptions.StreamClosedError):
                            self.conn.increment_flow_control_window(ev.flow_controlled_length, ev.stream_id)
                        self.conn.increment_flow_control_window(ev.flow_controlled_length)
                elif isinstance(ev, h2.events.StreamEnded):
                    stream.ended = True
                elif isinstance(ev, h2.events.StreamReset):
                    stream.reset_code = ev.error_code
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self.closed = True
            if not data:
                self.closed = True
            elif not self.closed:
                await self._flush()
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds (checked after each receive)."""
        async with self._changed:
            while not predicate():
                await self._changed.wait()


async def open_h2(url: str, cafile: str | None = None) -> H2Client:
    """Connect to ``http://host:port`` (h2c, prior knowledge) or ``https://host:port`` (TLS, ALPN h2)."""
    scheme, _, authority = url.partition("://")
    host, port = authority.rsplit(":", 1)
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, int(port))
    if scheme == "https":
        context = ssl.create_default_context(cafile=cafile)
        context.set_alpn_protocols(["h2"])
        stream = trio.SSLStream(stream, context, server_hostname=host)
        await stream.do_handshake()
        assert stream.selected_alpn_protocol() == "h2"
    return H2Client(stream, authority, scheme)
