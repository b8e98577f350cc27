"""Tail one message log as SSE bytes: replay, then live, with heartbeats.

The heartbeat is ``encode_comment("ping")``, one comment line with no blank
line after it (``core/sse.py`` says why: the official SDKs' decoders would
dispatch the blank line as an empty event). :func:`tail` yields it only
between whole entries, so it always joins the block of the next entry (or the
reconnect hint), and every byte of silence is still traffic for a proxy.

Every HTTP connection, the first one included, is a reader: the route finds
the log (``LogStore.get``), registers as a reader, and writes what
:func:`tail` yields. Typical use in a route::

    after = parse_event_id(last_event_id, message_id) if last_event_id else None
    where = log.position(after)             # NEVER_SENT: future id -> 400;
                                            # LEFT_RING: lagged already -> 410/fallback
    with log.reader():                      # counts the reader; on_idle on exit
        async with contextlib.aclosing(
            tail(log, after, heartbeat_interval=cfg.heartbeat_interval,
                 on_heartbeat=metrics.heartbeat)
        ) as chunks:
            async for chunk in chunks:
                await send(chunk)

Registration is the caller's job, not :func:`tail`'s: a ``with`` block exits
at a known moment, so ``on_idle`` (the disconnect policy) fires as soon as the
connection ends, instead of whenever an un-closed generator is finalized.

Cancellation. :func:`tail` only reads the log, so there is nothing to undo:

* Cancelled while parked (waiting for entries or a heartbeat), ``Cancelled``
  propagates out of the generator and the log is unchanged.
* When the consumer stops early (the client went away and a write failed),
  ``aclosing`` calls ``aclose()``, which raises ``GeneratorExit`` at the
  paused ``yield``; the generator holds no resources, so it ends at once.
* It never yields inside a cancel scope or a nursery (the heartbeat timeout
  wraps only the wait), so it is safe to iterate from any task.

Always iterate under ``aclosing`` (``contextlib.aclosing``): an async
generator that is dropped unfinished is otherwise only finalized by the GC.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable

import trio

from ringserve.core.ringlog import Gap, format_event_id
from ringserve.core.sse import encode_comment, encode_reconnect
from ringserve.logs.memory import MessageLog

__all__ = ["DEFAULT_BATCH", "ReaderLagged", "tail"]

#: The most entries taken from the log per read (bounds one replay step).
DEFAULT_BATCH = 256


class ReaderLagged(Exception):
    """The reader needs an entry that has already left the ring.

    Raised by :func:`tail`; the caller ends the stream (a client that resumes
    with an even older id would lag again) or sends an in-band error and
    points the client at the durable message.

    Attributes:
        gap: the :class:`~ringserve.core.ringlog.Gap` that ``read_from`` gave.
    """

    def __init__(self, gap: Gap) -> None:
        super().__init__(
            f"reader lagged: entry {gap.after + 1} has left the ring "
            f"(oldest held is {gap.first_available}; {gap.missing} missing)"
        )
        self.gap = gap


async def tail(
    log: MessageLog,
    after: int | None,
    *,
    heartbeat_interval: float,
    on_heartbeat: Callable[[], None] | None = None,
    max_seconds: float = 0.0,
    on_reconnect: Callable[[], None] | None = None,
    batch: int = DEFAULT_BATCH,
) -> AsyncGenerator[bytes, None]:
    """Yield a log's SSE bytes after ``after``: replay, then live, then end.

    Yields, in order, the entries' bytes exactly as appended, every entry read
    at once (up to ``batch``) in one chunk, so that a reader writes once for
    all it has to catch up on:

    1. the held entries after ``after`` (the replay);
    2. the new entries as the producer appends them, and
       ``encode_comment("ping")`` (``b": ping\\n"``) whenever
       ``heartbeat_interval`` seconds pass with nothing to send
       (``on_heartbeat()`` is called before each ping, for metrics).

    Returns once the log is closed and every entry has been yielded. The
    terminal ``done``/``error`` event is the producer's last entry; ``tail``
    adds none. With ``max_seconds``, once that long has passed and the end is
    not yet reached, it calls ``on_reconnect()``, yields
    ``encode_reconnect(<id of the last entry yielded>)`` (a comment line that
    no parser dispatches) and returns: the client resumes on a fresh
    connection.

    Args:
        log: the message log (a :class:`~ringserve.logs.memory.MessageLog`).
        after: the last sequence number the client has (from
            ``Last-Event-ID``); ``None`` starts from entry 0.
        heartbeat_interval: seconds of silence before a ping (> 0).
        on_heartbeat: called synchronously once per ping.
        max_seconds: seconds this connection may stream (0: no limit).
        on_reconnect: called synchronously just before the reconnect hint.
        batch: the most entries read from the log per step.

    Raises:
        ReaderLagged: an entry the reader still needs was evicted, at the
            start (``after`` too old) or later (the reader fell behind by
            more than the ring holds).
        ValueError: ``after`` is from the future (``>= log.next_seq``).

    Cancellation: see the module docstring; safe, and the log is untouched.
    """
    if heartbeat_interval <= 0:
        raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
    ends_at = trio.current_time() + max_seconds if max_seconds > 0 else math.inf
    cursor = after
    while True:
        got = log.read_from(cursor, batch)
        if isinstance(got, Gap):
            raise ReaderLagged(got)
        if not got and log.closed:  # caught up, and nothing more will come
            return
        if trio.current_time() >= ends_at:
            if on_reconnect is not None:
                on_reconnect()
            yield encode_reconnect(None if cursor is None else format_event_id(log.message_id, cursor))
            return
        if got:
            # Advance before yielding: if the consumer stops here, the
            # entries count as handed over, like the bytes it got.
            cursor = got[-1].seq
            yield got[0].data if len(got) == 1 else b"".join(entry.data for entry in got)
            continue
        with trio.move_on_at(min(trio.current_time() + heartbeat_interval, ends_at)) as scope:
            await log.wait_for_entries(cursor)
        if scope.cancelled_caught and trio.current_time() < ends_at:
            if on_heartbeat is not None:
                on_heartbeat()
            yield encode_comment("ping")
