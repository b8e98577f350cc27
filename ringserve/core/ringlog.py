"""One message's bounded, replayable log of already-rendered SSE bytes.

Sans-I/O, in the manner of h11: no trio, no sockets, no clock. A producer
calls :meth:`RingLog.append` with the bytes of one SSE event and gets back its
sequence number; any number of readers call :meth:`RingLog.read_from` with the
last sequence number they delivered and get back a plain value:

* a list of :class:`Entry` (possibly empty: ``[]`` is "not yet", never a wait);
* a :class:`Gap` when the entry they need has already left the ring.

The Trio shell (``logs/memory.py``, ``logs/reader.py``) decides whether to
park on "not yet" and what to do about a gap.

Rules of this file:

* Sequence numbers start at 0 and go up by exactly 1 per append, for the whole
  life of the log. The event id on the wire is ``<message_id>:<seq>``
  (:func:`format_event_id` / :func:`parse_event_id`), so ``Last-Event-ID``
  maps straight back to a sequence number.
* The ring is bounded by entry count *and* bytes. The oldest entries leave
  first; the entry just appended never leaves in the same call, so a single
  entry larger than ``max_bytes`` is held alone (``nbytes`` may then exceed
  ``max_bytes`` until the next append).
* The lifecycle is one table, :data:`TRANSITIONS`: OPEN → FINISHED and
  OPEN → FAILED. Everything else raises :class:`LogStateError`. Only an OPEN
  log takes appends; a closed log can still be read to the end.
"""

from __future__ import annotations

import enum
import re

import attrs

__all__ = [
    "TRANSITIONS",
    "Entry",
    "Gap",
    "LogState",
    "LogStateError",
    "RingLog",
    "format_event_id",
    "parse_event_id",
]


@attrs.frozen
class Entry:
    """One appended event: its sequence number and its rendered SSE bytes."""

    seq: int
    data: bytes


@attrs.frozen
class Gap:
    """The reader asked for an entry that has already left the ring.

    Attributes:
        after: the sequence number the reader had delivered (``-1`` when it
            asked from the start); entry ``after + 1`` is gone.
        first_available: the oldest sequence number the ring still holds.
            ``first_available - after - 1`` entries are lost to this reader.
    """

    after: int
    first_available: int

    @property
    def missing(self) -> int:
        """How many entries the reader can no longer get."""
        return self.first_available - self.after - 1


class LogState(enum.Enum):
    """Lifecycle of a message log."""

    OPEN = "open"
    FINISHED = "finished"
    FAILED = "failed"


#: Every legal lifecycle move, in one place. A move not listed here raises
#: :class:`LogStateError`.
TRANSITIONS: dict[LogState, frozenset[LogState]] = {
    LogState.OPEN: frozenset({LogState.FINISHED, LogState.FAILED}),
    LogState.FINISHED: frozenset(),
    LogState.FAILED: frozenset(),
}


class LogStateError(Exception):
    """An operation the log's lifecycle does not allow.

    Attributes:
        state: the state the log was in.
        target: the state that was asked for, or ``None`` for an append.
    """

    def __init__(self, state: LogState, target: LogState | None) -> None:
        if target is None:
            message = f"cannot append to a log in state {state.name}; only OPEN logs take appends"
        else:
            message = f"illegal log transition {state.name} -> {target.name}"
        super().__init__(message)
        self.state = state
        self.target = target


def _at_least_one(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


@attrs.define(eq=False)
class RingLog:
    """A bounded log of one message's SSE events, addressed by sequence number.

    Storage is a circular list with ``max_entries`` slots: entry ``seq``
    lives in slot ``seq % max_entries``. Because the held sequence numbers are
    always the contiguous range ``[first_seq, next_seq)`` and that range is
    never longer than ``max_entries``, no two held entries share a slot. So
    append is O(1) and reading k entries is O(k) (at most two list slices),
    wherever in the window the reader starts. (A ``deque`` would make the
    middle of the window O(n) to reach.) The list grows lazily, so a short
    message costs only the slots it used.

    Args:
        max_entries: the most entries held at once (>= 1).
        max_bytes: the most bytes of entry data held at once (>= 1); see the
            module docstring for the one-oversized-entry exception.

    Not thread-safe; in ringserve every call happens on the Trio thread.
    Deliberately has no ``__len__`` (an empty log must stay truthy); use
    :attr:`entry_count`.
    """

    max_entries: int = attrs.field(validator=_at_least_one)
    max_bytes: int = attrs.field(validator=_at_least_one)
    _slots: list[Entry | None] = attrs.field(factory=list, init=False, repr=False)
    _first_seq: int = attrs.field(default=0, init=False)
    _next_seq: int = attrs.field(default=0, init=False)
    _nbytes: int = attrs.field(default=0, init=False)
    _state: LogState = attrs.field(default=LogState.OPEN, init=False)
    _evicted_total: int = attrs.field(default=0, init=False)

    # -- properties ---------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence number the next append will get (= entries ever appended)."""
        return self._next_seq

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still held; equals :attr:`next_seq` when empty."""
        return self._first_seq

    @property
    def entry_count(self) -> int:
        """How many entries the ring holds now."""
        return self._next_seq - self._first_seq

    @property
    def nbytes(self) -> int:
        """Bytes of entry data held now (payloads only, no bookkeeping)."""
        return self._nbytes

    @property
    def evicted_total(self) -> int:
        """Entries that have left the ring over its lifetime."""
        return self._evicted_total

    @property
    def state(self) -> LogState:
        return self._state

    @property
    def closed(self) -> bool:
        """True once FINISHED or FAILED: no more appends will come."""
        return self._state is not LogState.OPEN

    # -- producer -----------------------------------------------------------

    def append(self, data: bytes) -> int:
        """Add one event's bytes at the end.

        Evicts the oldest entries while the ring holds more than
        ``max_entries`` entries or more than ``max_bytes`` bytes, but never
        the entry just appended.

        Args:
            data: one complete, already-encoded SSE event (``core/sse.py``).

        Returns:
            The entry's sequence number: 0, 1, 2, ... (the :attr:`next_seq`
            seen just before the call, so a single producer can render the
            event id from ``next_seq`` first).

        Raises:
            LogStateError: the log is not OPEN.
            TypeError: ``data`` is not bytes.
        """
        if self._state is not LogState.OPEN:
            raise LogStateError(self._state, None)
        if not isinstance(data, bytes):
            raise TypeError(f"RingLog.append takes bytes, got {type(data).__name__}")
        if self.entry_count >= self.max_entries:
            self._evict_oldest()  # frees exactly the slot the new entry takes
        seq = self._next_seq
        entry = Entry(seq, data)
        slot = seq % self.max_entries
        if slot >= len(self._slots):  # still growing (after skip_to, past a hole of unused slots)
            self._slots.extend([None] * (slot - len(self._slots)))
            self._slots.append(entry)
        else:
            self._slots[slot] = entry
        self._next_seq = seq + 1
        self._nbytes += len(data)
        while self._nbytes > self.max_bytes and self._first_seq < seq:
            self._evict_oldest()
        return seq

    def close(self, state: LogState) -> None:
        """Move to a final state (FINISHED or FAILED); see :data:`TRANSITIONS`.

        Entries stay readable after close.

        Raises:
            LogStateError: the move is not in the table (e.g. closing twice).
        """
        if state not in TRANSITIONS[self._state]:
            raise LogStateError(self._state, state)
        self._state = state

    def skip_to(self, seq: int) -> None:
        """Drop every held entry and go on at ``seq``: the next append gets ``seq``.

        For a copy of a log whose older entries are gone (a replica tailing a
        Redis stream that was trimmed, ``logs/redis.py``): a reader
        behind ``seq`` then gets a :class:`Gap`, as after an eviction.

        Raises:
            ValueError: ``seq < next_seq`` (sequence numbers never go back).
            LogStateError: the log is not OPEN.
        """
        if self._state is not LogState.OPEN:
            raise LogStateError(self._state, None)
        if seq < self._next_seq:
            raise ValueError(f"cannot skip back from {self._next_seq} to {seq}")
        self._evicted_total += self.entry_count
        self._slots = []
        self._nbytes = 0
        self._first_seq = self._next_seq = seq

    def _evict_oldest(self) -> None:
        slot = self._first_seq % self.max_entries
        entry = self._slots[slot]
        assert entry is not None and entry.seq == self._first_seq
        self._slots[slot] = None
        self._nbytes -= len(entry.data)
        self._first_seq += 1
        self._evicted_total += 1

    # -- readers ------------------------------------------------------------

    def read_from(self, after: int | None, limit: int | None = None) -> list[Entry] | Gap:
        """The entries after sequence number ``after``, oldest first.

        Args:
            after: the last sequence number the reader delivered; ``None`` (or
                ``-1``) reads from the very start.
            limit: the most entries to return (``None``: all held). ``0`` is a
                cheap probe: it returns ``[]``, a :class:`Gap` or raises,
                exactly as a real read from ``after`` would.

        Returns:
            ``list[Entry]`` with sequence numbers ``after+1, after+2, ...``
            (``[]`` means nothing new yet: the reader is caught up), or a
            :class:`Gap` when entry ``after + 1`` has already been evicted
            (from the start: when entry 0 is gone).

        Raises:
            ValueError: ``after >= next_seq`` (an id from the future: no such
                entry was ever appended), ``after < -1``, or ``limit < 0``.
        """
        if after is None:
            after = -1
        if after < -1:
            raise ValueError(f"after must be >= -1 or None, got {after}")
        if after >= self._next_seq:
            raise ValueError(
                f"sequence number {after} is from the future: the log has only "
                f"reached {self._next_seq - 1}"
            )
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        start = after + 1
        if start < self._first_seq:
            return Gap(after=after, first_available=self._first_seq)
        stop = self._next_seq if limit is None else min(self._next_seq, start + limit)
        if start >= stop:
            return []
        cap = self.max_entries
        lo, hi = start % cap, (stop - 1) % cap + 1
        if lo < hi:
            out = self._slots[lo:hi]
        else:  # wraps around the end of the list
            out = self._slots[lo:] + self._slots[:hi]
        return out  # type: ignore[return-value]  # held slots are never None


# -- event ids ------------------------------------------------------------------

_SEQ = re.compile(r"0|[1-9][0-9]{0,18}")


def format_event_id(message_id: str, seq: int) -> str:
    """The SSE ``id:`` of entry ``seq`` of a message: ``<message_id>:<seq>``."""
    return f"{message_id}:{seq}"


def parse_event_id(value: str, message_id: str) -> int:
    """The sequence number in a ``Last-Event-ID`` for ``message_id``.

    The id is ``<message_id>:<seq>`` (split at the last colon, so message ids
    may contain colons); ``seq`` is spelled as :func:`format_event_id` writes
    it: ASCII decimal digits, no leading zero, sign or space, so that each seq
    has one id (``msg_1:01`` is malformed, not seq 1).

    Returns:
        The sequence number, to pass as ``after`` to ``read_from``/``tail``.

    Raises:
        ValueError: malformed, or the id belongs to another message.
    """
    prefix, sep, seq = value.strip().rpartition(":")
    if not sep or not _SEQ.fullmatch(seq):
        raise ValueError(f"malformed event id {value!r}; expected '<message_id>:<seq>'")
    if prefix != message_id:
        raise ValueError(f"event id {value!r} does not belong to message {message_id!r}")
    return int(seq)
