"""Resuming a message's stream: the log to read after a ``Last-Event-ID``, rebuilt once it expired.

:meth:`Resume.open_log` finds the log (this replica's, a copy of another's, or
one rebuilt from the store: :func:`rebuilt`), and says what a resume point
means: the events after it, nothing after the terminal event
(:class:`StreamEnded`, answered 204), or a 400/410. :meth:`Resume.stream`
tails a log for one reader and holds the message for a reader that was told
to reconnect. Every entry a rebuilt log or the end of a dead owner's stream
holds is the producer's (``core/producer.py`` :func:`replay`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import assert_never

import attrs
import trio

from ringserve.config import ServerConfig
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import Failure, Finish, StopReason, Usage
from ringserve.core.producer import Trace, replay
from ringserve.core.render import Renderer
from ringserve.core.ringlog import LogState, RingLog, parse_event_id
from ringserve.core.signing import ReasoningSigner
from ringserve.core.status import INTERRUPTED_MESSAGE, OWNER_LOST_MESSAGE, MessageStatus
from ringserve.logs.memory import LogStore, MemoryMessageLog, MessageLog, Position
from ringserve.logs.reader import tail
from ringserve.store.sqlite import RenderArgs, StoredMessage, stored_render, stored_trace
from ringserve.surfaces.registry import SURFACES

log = logging.getLogger("ringserve.hub")


class StreamEnded(Exception):
    """Nothing follows the resume point: it is the terminal event of a stream that has ended.

    Answered 204 No Content, on which a browser ``EventSource`` stops
    reconnecting (WHATWG HTML, "Server-sent events": a 204 fails the
    connection for good), where a 200 with an empty body would make it
    reconnect forever.
    """


def _resume_after(value: str, message_id: str) -> int:
    """The seq a ``Last-Event-ID`` names, or a 400 in the surface's shape."""
    if len(value) > 200:
        raise RingserveError(ErrorKind.INVALID_REQUEST, "Last-Event-ID is too long", param="Last-Event-ID")
    try:
        return parse_event_id(value, message_id)
    except ValueError as exc:
        raise RingserveError(ErrorKind.INVALID_REQUEST, str(exc)[:300], param="Last-Event-ID") from None


def _renderer(stored: StoredMessage, args: RenderArgs, signer: ReasoningSigner) -> Renderer:
    """A renderer made as the stored message's producer made its own (``signer``: the server's)."""
    surface = SURFACES.by_name(stored.surface).restored(args.echo, signer)
    return surface.renderer(stored.id, stored.model, stored.created, args.include_usage)


def rebuilt(stored: StoredMessage, signer: ReasoningSigner) -> MemoryMessageLog | None:
    """The ended log of a stored message, rendered again (``core/producer.py`` :func:`replay`);
    None when the row cannot rebuild it (written before schema 5, not final, or a trace
    that does not fit its text).

    It ends with the terminal event the stored status says: the log's own for a message
    that ended, and for one a crash left ``interrupted`` a retryable ``api_error`` failure
    (:data:`~ringserve.core.status.INTERRUPTED_MESSAGE`) after the text the store had; a
    reader that had read past that text then sees the rebuilt seqs, which may differ.
    The log is held by its readers only, not by the log store.
    """
    trace, args = stored_trace(stored), stored_render(stored)
    if trace is None or args is None or not stored.status.final:
        return None
    usage = stored.usage
    terminal: Finish | Failure
    match stored.status:
        case MessageStatus.COMPLETE | MessageStatus.CANCELLED:
            terminal = Finish(stored.stop_reason or StopReason.END, usage, stored.stop_sequence)
        case MessageStatus.FAILED | MessageStatus.INTERRUPTED:
            kind, retryable = trace.failure or (ErrorKind.API_ERROR, True)
            terminal = Failure(kind, stored.error or INTERRUPTED_MESSAGE, usage, retryable)
        case MessageStatus.QUEUED | MessageStatus.GENERATING:
            return None
        case _:
            assert_never(stored.status)
    try:
        entries = replay(stored.id, _renderer(stored, args, signer), Usage(stored.input_tokens, 0), stored.blocks,
                         trace, terminal, args.retry_ms)
    except ValueError:
        log.exception("the stored trace of message %s does not fit its text", stored.id)
        return None
    if stored.final_seq is not None and stored.final_seq != len(entries) - 1:
        log.error("message %s rebuilt %d entries, its log had %d", stored.id, len(entries), stored.final_seq + 1)
        return None
    log_ = MemoryMessageLog(stored.id, RingLog(len(entries), sum(map(len, entries))))
    for entry in entries:
        log_.append(entry)
    log_.close(LogState.FINISHED if isinstance(terminal, Finish) else LogState.FAILED)
    return log_


def owner_lost_entries(stored: StoredMessage, seq: int, signer: ReasoningSigner) -> list[bytes]:
    """The end of a stream whose owning replica died, from entry ``seq`` on (``logs/redis.py``
    writes them into the stream): the retryable in-band failure the producer renders after the
    stored state (``core/producer.py`` :func:`replay` with the stored trace), so it carries the
    message's own fields (a Responses object's options, its output so far) and its seqs follow
    the log's (a Response event's ``sequence_number`` too)."""
    failure = Failure(ErrorKind.UNAVAILABLE, OWNER_LOST_MESSAGE, stored.usage, True)
    args = stored_render(stored) or RenderArgs(include_usage=False, retry_ms=None)
    start = Usage(stored.input_tokens, 0)
    try:
        entries = replay(stored.id, _renderer(stored, args, signer), start, stored.blocks,
                         stored_trace(stored) or Trace(()), failure, args.retry_ms, terminal_seq=seq)
    except ValueError:  # a trace that does not fit its text: the failure alone
        log.exception("the stored trace of message %s does not fit its text", stored.id)
        entries = replay(stored.id, _renderer(stored, args, signer), start, (), Trace(()), failure, args.retry_ms,
                         terminal_seq=seq)
    return list(entries)


@attrs.frozen
class Resume:
    """Where a resume finds its log, and how a reader tails it.

    Args:
        server: ``[server]`` (heartbeats, the longest connection, ``retry_ms``).
        logs: the stream-log backend.
        nursery: the server's, where a reconnect hold waits.
        signer: the server's reasoning signer (a rebuilt stream signs as its producer did).
        stored: the store's row of a message, else the state another replica wrote of it
            (``Hub.find_stored``; raises ``NOT_FOUND``).
        is_live: whether a message's generation runs on this replica (its log is then held).
    """

    server: ServerConfig
    logs: LogStore
    nursery: trio.Nursery
    signer: ReasoningSigner
    stored: Callable[[str], Awaitable[StoredMessage]]
    is_live: Callable[[str], bool]

    async def open_log(self, message_id: str, last_event_id: str | None) -> tuple[MessageLog, int | None]:
        """The log to resume and the seq to resume after (None: from the start).

        A message whose log has expired, or whose ended log no longer holds the resume point
        (ring caps), is rebuilt from the store (:func:`rebuilt`) with the seqs and bytes its log
        had, so a reader resumes after expiry and after a restart without a gap or a duplicate.

        Raises:
            StreamEnded: ``last_event_id`` is the terminal event of the
            message's stream, whether its log is still held or has expired
            (the store keeps the terminal event's seq).
            RingserveError: ``NOT_FOUND`` (unknown message), ``GONE`` (the log
            expired and the store cannot rebuild it: a row written before schema 5, or a
            message still generating on another replica; or the id is older than the ring of
            a live log holds: fetch ``GET /v1/messages/{id}``), ``INVALID_REQUEST`` (malformed
            id, or one that was never sent).
        """
        after = None if last_event_id is None else _resume_after(last_event_id, message_id)
        log_ = await self.logs.find(message_id, after)  # a replica's copy may first catch up to after
        if log_ is None or (log_.closed and log_.position(after) is Position.LEFT_RING):
            row = None if self.is_live(message_id) else await self.stored(message_id)  # NOT_FOUND: unknown
            if after is not None and row is not None and row.final_seq == after:
                raise StreamEnded(message_id)
            log_ = None if row is None else rebuilt(row, self.signer)
            if log_ is None and row is not None and not row.status.final:
                raise RingserveError(
                    ErrorKind.GONE,
                    f"{message_id} is generating on another server that shares this message store (its stream"
                    f" log is held there: resume it there), or one that stopped without saying so (its next start"
                    f" marks it interrupted); GET /v1/messages/{message_id} has the text stored so far",
                )
            if log_ is None:
                raise RingserveError(
                    ErrorKind.GONE,
                    f"the stream log of {message_id} has expired; GET /v1/messages/{message_id} has the message",
                )
        if log_.closed and after is not None and after == log_.next_seq - 1:
            raise StreamEnded(message_id)
        match where := log_.position(after):
            case Position.HELD:
                return log_, after
            case Position.NEVER_SENT:
                raise RingserveError(ErrorKind.INVALID_REQUEST, "Last-Event-ID names an event that was never sent",
                                     param="Last-Event-ID")
            case Position.LEFT_RING:
                raise RingserveError(
                    ErrorKind.GONE,
                    f"{'the start of the stream' if after is None else f'the events after {last_event_id}'} has left"
                    f" the ring; GET /v1/messages/{message_id} has the text",
                )
            case _:
                assert_never(where)

    def stream(
        self, log_: MessageLog, after: int | None, on_heartbeat: Callable[[], None] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The SSE bytes of ``log_`` after ``after``: replay, then live, with heartbeats.

        A connection that reaches ``server.max_stream_seconds`` ends with a
        reconnect hint (``core/sse.py`` ``encode_reconnect``); the generation
        is then held for ``retry_ms + heartbeat_interval`` (:meth:`_hold`), so
        the disconnect policy does not abort it while the client reconnects.
        """
        server = self.server
        return tail(log_, after, heartbeat_interval=server.heartbeat_interval, on_heartbeat=on_heartbeat,
                    max_seconds=server.max_stream_seconds, on_reconnect=lambda: self._hold(log_))

    def _hold(self, log_: MessageLog) -> None:
        """Count one more reader of ``log_`` for ``retry_ms + heartbeat_interval`` seconds.

        Entered synchronously, before the reader that sent a reconnect hint
        leaves, so ``on_idle`` (the disconnect policy) does not fire in between.
        """
        if log_.closed:
            return
        hold = contextlib.ExitStack()
        hold.enter_context(log_.reader())

        async def release_later() -> None:
            with hold:
                await trio.sleep(self.server.retry_ms / 1000 + self.server.heartbeat_interval)

        self.nursery.start_soon(release_later)
