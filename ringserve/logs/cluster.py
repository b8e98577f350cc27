"""What the replicas of one deployment share beyond the logs: a message's state, cancels, deletes, keys.

One replica (the memory backend) shares nothing: :class:`LocalCluster`. With
``[stream] backend = "redis"`` every replica reads the state the owner of a
message writes, asks the owner to cancel or delete it, and claims ``Idempotency-Key``\\ s
so that a key names one message on every replica (``logs/redis.py``
``RedisCluster``). The owner's lease, and the end of a stream whose owner
died, ride on the Redis log store's pump (``RedisLogStore``'s ``on_cancel``,
``on_delete`` and ``on_owner_lost``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import trio

from ringserve.store.sqlite import StoredMessage

__all__ = ["Cluster", "KeyHolder", "LocalCluster"]


@attrs.frozen
class KeyHolder:
    """The message an ``Idempotency-Key`` names on every replica, and its request body's fingerprint.

    Attributes:
        message_id: the message.
        request_hash: ``decide.request_hash`` of the request body (hex SHA-256).
    """

    message_id: str
    request_hash: str


@runtime_checkable
class Cluster(Protocol):
    """The replicas' shared state (every method raises ``RingserveError`` ``UNAVAILABLE`` while
    it cannot be reached, but :meth:`release_key`, which never raises)."""

    async def find_message(self, message_id: str, *, request: bool = False) -> StoredMessage | None:
        """The state another replica last wrote of ``message_id``, or None; its ``request`` is empty
        unless asked for (and kept only for a message a later request may continue)."""
        ...

    async def request_cancel(self, message_id: str) -> None:
        """Ask the replica generating ``message_id`` to cancel it."""
        ...

    async def delete_message(self, message_id: str, *, here: bool) -> None:
        """Return once ``message_id`` is gone from every replica, having had the replica that holds
        it delete it unless this one did (``here``); else ``UNAVAILABLE``: it was not deleted."""
        ...

    async def claim_key(self, key: str, holder: KeyHolder, *, replaces: str | None = None) -> KeyHolder | None:
        """Make ``key`` name ``holder`` on every replica unless it names another message (other than
        ``replaces``, the one ``holder`` takes it over from): None once it does, else the holder it names."""
        ...

    async def release_key(self, key: str, holder: KeyHolder) -> None:
        """Let ``key`` go if it still names ``holder`` (its attempt failed to start)."""
        ...


class LocalCluster:
    """One replica: nothing is shared (the hub keeps its own keys, and cancels its own messages)."""

    async def find_message(self, message_id: str, *, request: bool = False) -> None:
        """Always ``None``: no other replica writes message state."""
        await trio.lowlevel.checkpoint()

    async def request_cancel(self, message_id: str) -> None:
        """Nothing to do: every message is this replica's (``LiveMessage.cancel`` stops it)."""
        await trio.lowlevel.checkpoint()

    async def delete_message(self, message_id: str, *, here: bool) -> None:
        """Nothing to do: every message is this replica's (``Hub.delete`` deleted it)."""
        await trio.lowlevel.checkpoint()

    async def claim_key(self, key: str, holder: KeyHolder, *, replaces: str | None = None) -> None:
        """Always ``None`` (the key is ``holder``'s): no other replica takes keys."""
        await trio.lowlevel.checkpoint()

    async def release_key(self, key: str, holder: KeyHolder) -> None:
        """Nothing to do (see :meth:`claim_key`)."""
        await trio.lowlevel.checkpoint()
