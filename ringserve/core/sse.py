"""The only Server-Sent Events encoder in ringserve, plus an incremental parser.

The wire format follows the WHATWG HTML Living Standard, section "Server-sent
events" (https://html.spec.whatwg.org/multipage/server-sent-events.html),
subsections "Parsing an event stream" and "Interpreting an event stream".
Every SSE byte ringserve sends is made here: surfaces return events, and
:func:`encode_event`, :func:`encode_comment` and :func:`encode_reconnect`
turn them into bytes. Nothing here does I/O; :class:`SSEParser` takes bytes in
and gives :class:`ServerSentEvent` values out, in the manner of h11.

Encoder guarantees (so framing can never break):

* one ``data:`` line per line of the payload; CRLF, CR and LF all split a
  line, so a parser gets the payload back with every line end as LF;
* ``id`` and ``event`` holding CR, LF or NUL are refused with ValueError
  (a NUL id would be silently ignored by a browser);
* every event block ends with a blank line, and the output is UTF-8;
* nothing it makes is a block without ``data``: a comment (a heartbeat, the
  reconnect hint) is one line with no blank line after it, and the
  reconnection time rides on an event (``encode_event(retry=...)``). The
  official SDKs' decoders dispatch a data-less block once an id has been
  seen, where the spec dispatches nothing; see :func:`encode_comment`.
"""

from __future__ import annotations

import json
import operator

import attrs

__all__ = [
    "ServerSentEvent",
    "SSEParser",
    "encode_comment",
    "encode_event",
    "encode_reconnect",
]

_BOM = b"\xef\xbb\xbf"


def _check_field(name: str, value: str) -> None:
    if "\n" in value or "\r" in value or "\0" in value:
        raise ValueError(f"SSE {name} must not contain CR, LF or NUL: {value!r}")


def encode_event(
    data: str,
    *,
    event: str | None = None,
    id: str | None = None,  # noqa: A002 - the SSE field is called id
    retry: int | None = None,
) -> bytes:
    """Encode one event as a complete SSE block (WHATWG HTML, "Server-sent events").

    Fields are written in the order ``id``, ``event``, ``retry``, then one
    ``data: `` line per line of ``data`` (CRLF, CR and LF all end a line, and
    an empty ``data`` still gives one ``data: `` line, so the event is
    dispatched with empty data), then a blank line. Each value is written
    after ``": "``; a parser strips exactly that one space, so leading spaces
    in a value survive. ``None`` omits a field; ``event=""`` is written and
    reads back as the default type ``"message"``.

    This is the per-token hot path: a plain ``data`` with no other fields and
    no line breaks is one concatenation and one encode.

    Args:
        data: the payload text; any line ends are normalised to LF on the
            receiving side.
        event: the event type, or None for the default ``"message"``.
        id: the event id (becomes the client's Last-Event-ID), or None.
        retry: reconnection time for the client, in milliseconds (>= 0).

    Returns:
        The UTF-8 bytes of the block, ending in ``b"\\n\\n"``.

    Raises:
        ValueError: ``id`` or ``event`` contains CR, LF or NUL; ``retry`` is
            negative; or a string holds a lone surrogate (UnicodeEncodeError).
        TypeError: ``retry`` is not an integer.
    """
    if event is None and id is None and retry is None and "\n" not in data and "\r" not in data:
        return ("data: " + data + "\n\n").encode("utf-8")
    parts: list[str] = []
    if id is not None:
        _check_field("id", id)
        parts.append("id: " + id + "\n")
    if event is not None:
        _check_field("event", event)
        parts.append("event: " + event + "\n")
    if retry is not None:
        parts.append(_retry_line(retry))
    if "\n" in data or "\r" in data:
        for line in data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            parts.append("data: " + line + "\n")
    else:
        parts.append("data: " + data + "\n")
    parts.append("\n")
    return "".join(parts).encode("utf-8")


def _retry_line(ms: int) -> str:
    ms = operator.index(ms)
    if ms < 0:
        raise ValueError(f"SSE retry must be >= 0 milliseconds, got {ms}")
    return f"retry: {ms}\n"


def encode_comment(text: str = "ping") -> bytes:
    """Encode one comment line, used as a heartbeat (``b": ping\\n"``).

    A line starting with a colon is ignored by clients (WHATWG HTML,
    "Interpreting an event stream"), but its bytes keep proxies and idle
    timers from closing the connection.

    No blank line follows it, on purpose. A blank line ends a block, and the
    decoders of the official SDKs (``openai/_streaming.py`` and
    ``anthropic/_streaming.py``, both from httpx-sse's ``SSEDecoder``)
    dispatch a block whose data buffer is empty once an ``id`` has been
    seen, because they keep the last event id across blocks; the OpenAI SDK
    then parses ``""`` as JSON and raises. Without the blank line the comment
    joins the block that comes next, which it leaves unchanged, so every
    parser dispatches exactly the events it would without it. At the end of
    the stream such a line is an unfinished block holding nothing, which the
    spec discards.

    Args:
        text: the comment text, one line.

    Returns:
        ``b": " + text + b"\\n"`` in UTF-8.

    Raises:
        ValueError: ``text`` contains CR or LF.
    """
    if "\n" in text or "\r" in text:
        raise ValueError(f"SSE comment must be one line: {text!r}")
    return (": " + text + "\n").encode("utf-8")


def encode_reconnect(last_event_id: str | None) -> bytes:
    """Encode ringserve's ``reconnect`` hint: the server ends this connection on purpose.

    Sent as the last bytes of a connection that reached
    ``server.max_stream_seconds``: the comment line
    ``: reconnect {"last_event_id":...}`` (:func:`encode_comment`), naming the
    id of the last event this connection delivered (``null`` if none: resume
    from the start). The generation goes on; the client resumes on a fresh
    connection with that ``Last-Event-ID``.

    It is a comment, not an event, so that no parser dispatches anything for
    it: the OpenAI SDK yields every dispatched event as a chunk (an
    ``event: reconnect`` block became a malformed ``ChatCompletionChunk``),
    and the Anthropic SDK yields every named event but ``ping``. A browser
    ``EventSource`` reconnects by itself when the server closes, and its
    last event ID still names the last real event, so it resumes at the
    right place (WHATWG HTML, "Interpreting an event stream").

    Args:
        last_event_id: ``<message_id>:<seq>`` of the last event sent, or None.

    Returns:
        The comment line's bytes.
    """
    return encode_comment("reconnect " + json.dumps({"last_event_id": last_event_id}, separators=(",", ":")))


@attrs.frozen
class ServerSentEvent:
    """One dispatched event, as a client sees it.

    Attributes:
        event: the event type; ``"message"`` when the block set none (or an
            empty one).
        data: the data lines joined with LF (the final LF removed).
        id: the value of the block's own ``id`` field, or None if the block
            had none. (The browser's ``lastEventId`` carries the previous id
            forward; that persistent value is :attr:`SSEParser.last_event_id`.)
        retry: the block's valid ``retry`` value in milliseconds, or None.
    """

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry: int | None = None


@attrs.define(eq=False)
class SSEParser:
    """Incremental event-stream parser (WHATWG HTML, "Parsing an event stream").

    Feed it bytes split anywhere: inside a multi-byte UTF-8 character,
    between the CR and LF of a CRLF, inside the leading BOM. It returns each
    event once its blank line has arrived. Behaviour follows the spec:

    * one UTF-8 BOM at the very start of the stream is dropped; invalid UTF-8
      decodes to U+FFFD;
    * lines end with CRLF, CR or LF;
    * a line starting with ``:`` is a comment: counted in :attr:`comments`,
      otherwise ignored;
    * ``field: value`` splits at the first colon and drops one leading space
      of the value; a line without a colon is a field with an empty value;
    * ``data`` appends a line; ``event`` sets the type; ``id`` sets the last
      event id unless the value contains NUL; ``retry`` is used only if it
      is all ASCII digits; unknown fields are ignored;
    * a blank line dispatches: the last event id is committed to
      :attr:`last_event_id`, and if no ``data`` line was seen nothing is
      dispatched; otherwise the data lines are joined with LF.

    At the end of the stream an unfinished block is discarded, as the spec
    says; :attr:`pending_bytes` tells how many fed bytes that would be.

    Attributes:
        comments: number of comment lines seen so far.
        last_event_id: the spec's "last event ID string": the last id
            committed by a blank line ("" until one is), what a client sends
            as ``Last-Event-ID`` when it reconnects.
        retry: the last valid reconnection time seen, in milliseconds, or None.
    """

    comments: int = attrs.field(init=False, default=0)
    last_event_id: str = attrs.field(init=False, default="")
    retry: int | None = attrs.field(init=False, default=None)
    _buf: bytearray = attrs.field(init=False, factory=bytearray)  # incomplete line
    _bom_done: bool = attrs.field(init=False, default=False)
    _skip_lf: bool = attrs.field(init=False, default=False)  # last line ended in a bare CR
    _block_bytes: int = attrs.field(init=False, default=0)  # complete lines of the open block
    _data: list[str] = attrs.field(init=False, factory=list)
    _event: str = attrs.field(init=False, default="")
    _id_buffer: str = attrs.field(init=False, default="")
    _block_id: str | None = attrs.field(init=False, default=None)
    _block_retry: int | None = attrs.field(init=False, default=None)

    @property
    def pending_bytes(self) -> int:
        """Bytes fed since the last blank line: the unfinished block, in bytes.

        0 means the stream so far ends on a block boundary; if the stream
        ended now, this many bytes would be discarded. The LF of a CRLF that
        ends a blank line, arriving in a later feed, counts as part of that
        blank line.
        """
        return self._block_bytes + len(self._buf)

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse more bytes of the stream.

        Args:
            data: the next bytes, in any split (empty is fine).

        Returns:
            The events completed by these bytes, in order (often empty).
        """
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 0x0A:  # the LF of a CRLF split across feeds
                if self._block_bytes:
                    self._block_bytes += 1
                data = data[1:]
                if not data:
                    return []
        buf = self._buf
        if not self._bom_done:
            buf += data
            if len(buf) < 3 and _BOM.startswith(buf):
                return []
            self._bom_done = True
            if buf.startswith(_BOM):
                del buf[:3]
                self._block_bytes += 3
            data = bytes(buf)
            buf.clear()
        if b"\n" not in data and b"\r" not in data:
            buf += data
            return []
        buf += data
        lines = buf.splitlines(keepends=True)  # bytes split on CR, LF, CRLF only
        tail: bytes | bytearray = lines[-1]
        if tail.endswith((b"\n", b"\r")):
            tail = b""
            if lines[-1].endswith(b"\r"):
                self._skip_lf = True
        else:
            lines.pop()
        self._buf = bytearray(tail)
        events: list[ServerSentEvent] = []
        for raw in lines:
            end = 2 if raw.endswith(b"\r\n") else 1
            if len(raw) == end:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
                continue
            self._block_bytes += len(raw)
            self._line(raw[:-end].decode("utf-8", "replace"))
        return events

    def _line(self, line: str) -> None:
        if line[0] == ":":
            self.comments += 1
            return
        field, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._id_buffer = value
                self._block_id = value
        elif field == "retry":
            if value.isascii() and value.isdigit():
                self.retry = self._block_retry = int(value)

    def _dispatch(self) -> ServerSentEvent | None:
        self._block_bytes = 0
        self.last_event_id = self._id_buffer
        event = None
        if self._data:
            event = ServerSentEvent(
                event=self._event or "message",
                data="\n".join(self._data),
                id=self._block_id,
                retry=self._block_retry,
            )
            self._data = []
        self._event = ""
        self._block_id = None
        self._block_retry = None
        return event
