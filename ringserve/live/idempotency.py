"""``Idempotency-Key``: a retry finds the message its key names, on this replica or any other.

A key names one request body on one surface. :class:`Keys` holds the keys of
this replica's attempts while they start (a retry that comes meanwhile waits
for the attempt, and gets its error if it failed to start), and makes a key
name one message on every replica (``Cluster.claim_key``): two first attempts
on two replicas make one generation. What a retry gets of the message its key
names is :func:`retry_answer`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView
from ringserve.live.message import LiveMessage
from ringserve.logs.cluster import Cluster, KeyHolder
from ringserve.store.sqlite import MessageStore

#: Stored statuses that an idempotent retry generates again instead of returning.
REGENERATED_STATUSES = frozenset({MessageStatus.FAILED, MessageStatus.INTERRUPTED})

#: Seconds between looks for the message another replica's attempt claimed an ``Idempotency-Key``
#: for, until that replica's first flush (``[stream] flush_ms``) has written it to the shared store.
KEY_POLL_SECONDS = 0.05
#: Seconds after which a claimed ``Idempotency-Key`` whose message no replica has written is taken
#: over (its attempt's replica died before its first flush; an attempt that stops before its
#: message exists for any other reason lets its claim go at once: ``Hub.create``).
KEY_WAIT_SECONDS = 5.0
#: Seconds an attempt that failed to start spends at most letting its ``Idempotency-Key`` claim go
#: (``Cluster.release_key``), even when its request was cancelled.
RELEASE_SECONDS = 2.0


def surface_key(surface: str, key: str) -> str:
    """The key as the hub spells it: a key names a request on one surface.

    Raises:
        RingserveError: ``INVALID_REQUEST``: not 1-255 printable characters.
    """
    if not (0 < len(key) <= 255 and key.isprintable()):
        raise RingserveError(ErrorKind.INVALID_REQUEST, "Idempotency-Key must be 1-255 printable characters")
    return f"{surface}:{key}"


def key_reused() -> RingserveError:
    return RingserveError(
        ErrorKind.UNPROCESSABLE, "Idempotency-Key was already used with a different request body", param="Idempotency-Key"
    )


def retry_answer(existing: MessageView, body_hash: str) -> MessageView | None:
    """What an idempotent retry with ``body_hash`` returns of the message its key names: that
    message, or ``None`` when it ended ``failed``/``interrupted`` (not live here) and is generated
    again.

    Raises:
        RingserveError: ``UNPROCESSABLE``: the key was used with another body.
    """
    if existing.request_hash != body_hash:
        raise key_reused()
    if not existing.live and existing.status in REGENERATED_STATUSES:
        return None
    return existing


@attrs.define(eq=False)
class Keys:
    """The keys of this replica's messages, and their claims on every replica.

    Args:
        cluster: what the replicas share (their claims of keys).
        store: the durable store (a key of a message that ended here).
        find: the view of a message on any replica (``Hub.find``).
    """

    cluster: Cluster
    store: MessageStore
    find: Callable[[str], Awaitable[MessageView]]
    pending: dict[str, LiveMessage] = attrs.field(factory=dict, init=False)
    """Key → the live message that holds it (from its attempt's start to its end)."""

    async def existing(self, key: str) -> MessageView | None:
        """The message ``key`` names once no attempt under it is still starting: live, stored or None.

        Raises:
            RingserveError: the error of the attempt this call waited for,
            when that attempt failed to start (the same answer for every
            concurrent retry).
        """
        while (attempt := self.pending.get(key)) is not None and not attempt.started.is_set():
            await attempt.started.wait()
            if attempt.start_error is not None:
                raise attempt.start_error
            # else it started, or was cancelled before it did: look again
        if (live := self.pending.get(key)) is not None:
            return live.view()
        stored = self.store.by_idempotency_key(key)
        return None if stored is None else stored.view()

    async def claim(self, key: str, msg: LiveMessage) -> MessageView | None:
        """Make ``key`` name ``msg`` on every replica (``Cluster.claim_key``), or find what it names.

        Another replica's attempt under ``key`` is followed: to its message,
        which a retry returns (live or ended), unless it ended ``failed`` or
        ``interrupted`` (then ``msg`` takes the key over). A message the key
        names that no replica has written yet (its owner's first flush is on
        its way) is looked for every :data:`KEY_POLL_SECONDS`; one that has not
        appeared after :data:`KEY_WAIT_SECONDS` (its attempt never started) is
        taken over.

        Returns:
            ``None`` once ``key`` names ``msg``, else the message to return.

        Raises:
            RingserveError: ``UNPROCESSABLE`` (the key names a request with
            another body), ``UNAVAILABLE`` (the shared store is unreachable).
        """
        replaces = msg.replaces
        deadline = trio.current_time() + KEY_WAIT_SECONDS
        while (holder := await self.cluster.claim_key(key, KeyHolder(msg.id, msg.request_hash),
                                                      replaces=replaces)) is not None:
            if holder.request_hash != msg.request_hash:
                raise key_reused()
            try:
                existing: MessageView | None = await self.find(holder.message_id)
            except RingserveError as exc:
                if exc.kind is not ErrorKind.NOT_FOUND:
                    raise
                existing = None
            if existing is not None:
                if (answer := retry_answer(existing, msg.request_hash)) is not None:
                    return answer
                replaces = existing.id
            elif trio.current_time() >= deadline:
                replaces = holder.message_id
            else:
                await trio.sleep(KEY_POLL_SECONDS)
        return None

    async def release(self, key: str, msg: LiveMessage) -> None:
        """Let ``key`` go on every replica if it still names ``msg`` (its attempt failed to start:
        a retry through another replica would else wait :data:`KEY_WAIT_SECONDS` for a message
        that never appears), taking at most :data:`RELEASE_SECONDS`, even when cancelled."""
        with trio.move_on_after(RELEASE_SECONDS, shield=True):
            await self.cluster.release_key(key, KeyHolder(msg.id, msg.request_hash))
