"""A least-recently-used cache bounded by the bytes of what it holds, not by its entries.

The schema checks (``core/schema.py``) and the grammars (``engine/gbnf.py``) keep their
results keyed by the schema texts of a request, which a client chooses: a cache of N entries
holds N times the largest entry a request can make, so its bound is in bytes. Thread-safe:
grammars are built on the runner's threads while the event loop checks schemas.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import attrs

__all__ = ["ByteLRU", "CacheStatistics"]

V = TypeVar("V")


@attrs.frozen
class CacheStatistics:
    """A snapshot of a :class:`ByteLRU`: ``entries``; ``held`` and ``max_bytes`` in bytes;
    ``hits`` and ``misses`` since it was made or cleared."""

    entries: int
    held: int
    max_bytes: int
    hits: int
    misses: int


class ByteLRU(Generic[V]):
    """Values by key, least recently used dropped first once they hold more than ``max_bytes``.

    Args:
        max_bytes: the most the entries may hold, as ``size`` counts them.
        size: the bytes of one entry (its key and value; an estimate that grows with both, such
            as the length of the texts they hold). An entry larger than ``max_bytes`` is not kept.
    """

    def __init__(self, max_bytes: int, size: Callable[[Hashable, V], int]) -> None:
        self.max_bytes = max_bytes
        self._size = size
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._held = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value kept for ``key``, or ``make()`` (outside the lock; raising keeps nothing),
        kept if it fits. Two threads that miss the same key at once both make it."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return found[0]
            self._misses += 1
        value = make()
        size = self._size(key, value)
        if size > self.max_bytes:
            return value
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._held -= old[1]
            self._entries[key] = (value, size)
            self._held += size
            while self._held > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._held -= dropped
        return value

    def clear(self) -> None:
        """Drop every entry and zero the counts."""
        with self._lock:
            self._entries.clear()
            self._held = self._hits = self._misses = 0

    def statistics(self) -> CacheStatistics:
        with self._lock:
            return CacheStatistics(len(self._entries), self._held, self.max_bytes, self._hits, self._misses)
