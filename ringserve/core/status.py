"""A message's lifecycle, why it was cancelled, and what a disconnect does to it.

Rules of this file: every legal move of a message's status is in
:data:`TRANSITIONS`, and :func:`advance` is the only way the hub changes one.
The values are the stable spellings the store (and the Redis status hash)
keep; they are ``str`` enums so a row written by an older version reads back
as the same member. Surfaces and ringserve's own JSON spell them on the wire.

::

    queued ──► generating ──► complete | cancelled | failed | interrupted
       └──────────────────────► complete | cancelled | failed | interrupted

``interrupted`` is a drain, or a crash found at the next start-up
(``MessageStore.mark_interrupted``); the final statuses have no way out.
"""

from __future__ import annotations

import enum


class MessageStatus(enum.StrEnum):
    """Where a message is in its lifecycle (stored spelling = value)."""

    QUEUED = "queued"
    GENERATING = "generating"
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    @property
    def final(self) -> bool:
        """No status follows this one."""
        return not TRANSITIONS[self]


_ENDS = frozenset({MessageStatus.COMPLETE, MessageStatus.CANCELLED, MessageStatus.FAILED, MessageStatus.INTERRUPTED})

#: The statuses each status may move to; a message ends without text (a refusal, ``max_tokens``
#: reached by the first token's bytes) straight from ``queued``.
TRANSITIONS: dict[MessageStatus, frozenset[MessageStatus]] = {
    MessageStatus.QUEUED: frozenset({MessageStatus.GENERATING}) | _ENDS,
    MessageStatus.GENERATING: _ENDS,
    **{status: frozenset() for status in _ENDS},
}

#: The error of a message found ``interrupted`` without one (a crash: the next start marked it),
#: as its Response object and its rebuilt stream say.
INTERRUPTED_MESSAGE = "the server stopped (a restart or a crash) while generating; the output is the text so far"

#: The error of a message whose owning replica died mid-generation (in-band and in its status:
#: ``live/resume.py`` ``owner_lost_entries``, ``logs/redis.py``).
OWNER_LOST_MESSAGE = "the replica generating this message stopped; retry the request"

#: Statuses after which the message never changes again (retention may delete it).
FINAL_STATUSES = frozenset(status for status in MessageStatus if status.final)


class IllegalTransition(Exception):
    """A status move that :data:`TRANSITIONS` does not allow (a bug in the caller)."""


def advance(old: MessageStatus, new: MessageStatus) -> MessageStatus:
    """``new``, once checked against :data:`TRANSITIONS`.

    Raises:
        IllegalTransition: ``old`` may not move to ``new``.
    """
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"a {old.value} message cannot become {new.value}")
    return new


class CancelReason(enum.StrEnum):
    """Why a producer's cancel scope was cancelled."""

    CLIENT_GONE = "client_gone"
    REQUESTED = "requested"
    DRAIN = "drain"


class Policy(enum.StrEnum):
    """What a message does when its last reader leaves (``[policy]``, ``Ringserve-Disconnect-Policy``)."""

    ABORT = "abort"
    CONTINUE = "continue"
