"""Retries find their message: ``Idempotency-Key``, and identical requests of one client session.

A key names one request body on one surface. :class:`Keys` holds the keys of
this replica's attempts while they start (a retry that comes meanwhile waits
for the attempt, and gets its error if it failed to start), and makes a key
name one message on every replica (``Cluster.claim_key``): two first attempts
on two replicas make one generation. What a retry gets of the message its key
names is :func:`retry_answer`'s.

A request without a key that names its client's session (Claude Code's and Codex's session
headers, ``http/decide.py`` ``SESSION_HEADERS``) has an implicit one: the session and the
body's hash, whatever the order of its keys (``decide.turn_hash``; :func:`session_key`). The coding agents send the whole conversation with every
turn and retry a turn whose stream failed, timed out or was cut by re-sending the same body;
:class:`SessionTurns` makes that retry attach to the first attempt's message (a replay from its
first event, then live) instead of a second generation of the same turn, as long as that
message runs or ended whole with its log still held (``[stream]``'s TTL). A retry of a turn
that failed, was interrupted or cancelled, or whose log expired, is a new generation: the client
never got that answer whole, or it asked again long after. Implicit keys stay in this replica's
memory (at most :data:`MAX_SESSION_TURNS`): a retry that reaches another replica generates again.
A key whose message is past attaching (its log gone: its TTL, the log store's memory cap) goes
at the next add, with the message it kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

import attrs
import trio

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.status import MessageStatus
from ringserve.core.view import MessageView
from ringserve.live.message import LiveMessage
from ringserve.logs.cluster import Cluster, KeyHolder
from ringserve.logs.memory import LogStore
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

#: The most implicit keys :class:`SessionTurns` holds (the oldest go first; those whose message
#: can no longer be attached to go as soon as they are the oldest).
MAX_SESSION_TURNS = 1024
#: Statuses whose message an identical retry of the same session does not attach to.
UNATTACHABLE_STATUSES = frozenset({MessageStatus.FAILED, MessageStatus.INTERRUPTED, MessageStatus.CANCELLED})
#: Seconds at least that a message with an implicit key waits, under the ``abort`` policy, for a
#: reader after its last one left: the agents re-send a turn 0.2 s (Codex) to 2 s (Claude Code,
#: after a 429) after its stream broke (docs/agents.md), and the retry then attaches to it.
SESSION_GRACE_SECONDS = 5.0


def surface_key(surface: str, key: str) -> str:
    """The key as the hub spells it: a key names a request on one surface.

    Raises:
        RingserveError: ``INVALID_REQUEST``: not 1-255 printable characters.
    """
    if not (0 < len(key) <= 255 and key.isprintable()):
        raise RingserveError(ErrorKind.INVALID_REQUEST, "Idempotency-Key must be 1-255 printable characters")
    return f"{surface}:{key}"


def session_key(surface: str, turn: str) -> str:
    """The implicit key of a request under a client session: one turn (the session and the body's
    hash, ``http/decide.py`` ``Start.turn``) on one surface."""
    return f"{surface}:{turn}"


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


@attrs.define(eq=False)
class SessionTurns:
    """Implicit keys (:func:`session_key`) → the message of their first attempt, while an identical
    retry may attach to it (see the module doc).

    Args:
        logs: the log store (an ended message can be attached to while its log is held).
        limit: the most keys held.
    """

    logs: LogStore
    limit: int = MAX_SESSION_TURNS
    _turns: OrderedDict[str, LiveMessage] = attrs.field(factory=OrderedDict, init=False)

    def __len__(self) -> int:
        return len(self._turns)

    async def find(self, key: str) -> LiveMessage | None:
        """The message an identical retry under ``key`` attaches to, once its attempt started;
        None when there is none (or no longer one).

        Raises:
            RingserveError: the error of the attempt this call waited for, when that attempt
            failed to start (the same answer as a new attempt would get).
        """
        msg = self._turns.get(key)
        if msg is None:
            return None
        await msg.started.wait()
        if msg.start_error is not None:
            raise msg.start_error
        if self._attachable(msg):
            return msg
        self.drop(key, msg)
        return None

    def add(self, key: str, msg: LiveMessage) -> None:
        """``msg`` is the first attempt under ``key`` (from before its prompt is tokenized); every
        key whose message is past attaching goes, and the oldest keys past :attr:`limit`."""
        for old_key, old in list(self._turns.items()):
            if old.started.is_set() and not self._attachable(old):
                del self._turns[old_key]
        self._turns[key] = msg
        self._turns.move_to_end(key)
        while len(self._turns) > self.limit:
            self._turns.popitem(last=False)

    def drop(self, key: str, msg: LiveMessage) -> None:
        """Forget ``key`` if it still names ``msg``."""
        if self._turns.get(key) is msg:
            del self._turns[key]

    def _attachable(self, msg: LiveMessage) -> bool:
        """Whether a started message may be attached to: its log exists and is still held (not
        expired nor forgotten), and it did not end failed, interrupted or cancelled."""
        return msg.log is not None and msg.status not in UNATTACHABLE_STATUSES and self.logs.get(msg.id) is msg.log
