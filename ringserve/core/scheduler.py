"""Slot lifecycle and batching decisions of the decode loop (sans-I/O, synchronous).

The runner (``engine/runner.py``) owns one :class:`Scheduler` and asks it,
once per decode step, what to do; the scheduler never calls the engine, never
awaits and never reads a clock. Tests drive it by calling its methods and
reading plain values back.

Rules of this file (in the manner of h11's ``_state.py``):

* Every legal move of a request is in :data:`TRANSITIONS`, and nowhere else.
  A move the table lacks raises :class:`IllegalTransition`, which names the
  request, its state and the move::

      QUEUED  --admit-------> PREFILL --prompt_done--> DECODE --finish--> FINISHED
         |                       |  \\--finish (failed while prefilling)--> FINISHED
         \\--cancel--> CANCELLED <-+--------------------------+ cancel

* A slot is *free*, *occupied* by one request in PREFILL or DECODE, or
  *draining*: its request ended (FINISHED or CANCELLED) but the engine has
  not yet removed its KV cells. A draining slot is handed out by
  :meth:`Scheduler.take_releases` and becomes free only at
  :meth:`Scheduler.released`, so a new request is never admitted into a
  slot whose cells are still there.
* Admission is by priority (smaller int first), FIFO within a priority.
* One step's batch (:meth:`Scheduler.plan`) holds one token for every DECODE
  slot, then at most one prompt chunk (<= ``prefill_chunk`` tokens) per
  PREFILL slot, oldest admission first, while the batch has room
  (<= ``n_batch`` tokens in all). So a long prompt delays the decoding
  slots by at most one chunk's worth of compute per step, never by its whole
  prefill. A slot's last prompt chunk has ``sample=True``: the token sampled
  from it is the generation's first token.
* :meth:`plan` changes nothing but admissions; positions move only in
  :meth:`commit` (the batch was decoded) and :meth:`on_sampled`. If a decode
  fails, the same feeds come out of the next :meth:`plan` again for every
  request still live.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import attrs

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.engine.protocol import SlotFeed

__all__ = [
    "TRANSITIONS",
    "Entry",
    "IllegalTransition",
    "Move",
    "Plan",
    "QueueFull",
    "Scheduler",
    "SchedulerStatistics",
    "SlotState",
]


class SlotState(enum.Enum):
    """Where a request is in its life."""

    QUEUED = "queued"
    """Waiting in the admission queue for a free slot."""
    PREFILL = "prefill"
    """Holds a slot; its prompt is being fed in chunks."""
    DECODE = "decode"
    """Holds a slot; one sampled token is fed back per step."""
    FINISHED = "finished"
    """Ended normally or by a failure; its slot (if any) drains."""
    CANCELLED = "cancelled"
    """Ended by its consumer; its slot (if any) drains."""


class Move(enum.Enum):
    """The events that change a request's state."""

    ADMIT = "admit"
    PROMPT_DONE = "prompt_done"
    FINISH = "finish"
    CANCEL = "cancel"


_Q, _P, _D, _F, _C = (
    SlotState.QUEUED,
    SlotState.PREFILL,
    SlotState.DECODE,
    SlotState.FINISHED,
    SlotState.CANCELLED,
)

TRANSITIONS: Mapping[tuple[SlotState, Move], SlotState] = MappingProxyType(
    {
        (_Q, Move.ADMIT): _P,
        (_Q, Move.CANCEL): _C,
        (_P, Move.PROMPT_DONE): _D,
        (_P, Move.FINISH): _F,  # a failure while the prompt is being fed
        (_P, Move.CANCEL): _C,
        (_D, Move.FINISH): _F,
        (_D, Move.CANCEL): _C,
    }
)
"""Every legal ``(state, move) -> new state``. FINISHED and CANCELLED are final."""

LIVE_STATES = frozenset({SlotState.PREFILL, SlotState.DECODE})
"""States in which a request holds a slot and is fed to the engine."""


class IllegalTransition(RuntimeError):
    """A move that :data:`TRANSITIONS` does not allow (a bug in the caller)."""

    def __init__(self, entry: Entry, move: Move) -> None:
        super().__init__(
            f"request {entry.id}: cannot {move.value} in state {entry.state.name}"
            f" (slot {entry.slot})"
        )
        self.state = entry.state
        self.move = move


class QueueFull(RingserveError):
    """The admission queue is full: an ``OVERLOADED`` error, retryable later.

    Args:
        depth: requests waiting for a slot.
        capacity: the most requests that may wait (``queue_size`` plus the
            slots free right now).
        retry_after: seconds to suggest in ``Retry-After``.
    """

    def __init__(self, depth: int, capacity: int, retry_after: float = 1.0) -> None:
        super().__init__(
            ErrorKind.OVERLOADED,
            "the server is overloaded: every slot is busy and the admission queue is full; retry later",
            retry_after=retry_after,
            retryable=True,
        )
        self.depth = depth
        self.capacity = capacity


@attrs.define(eq=False)
class Entry:
    """One request as the scheduler sees it (identity, not value).

    Read-only for callers; the scheduler changes it.

    Attributes:
        id: admission ticket, increasing in enqueue order.
        prompt: the prompt's token ids.
        max_tokens: most tokens to sample.
        priority: smaller is admitted first.
        tag: the caller's object for this request (the runner's Generation).
        state: see :class:`SlotState`.
        slot: the slot it holds or held; None while queued.
        pos: tokens of this request in the slot's KV cells (prompt fed so far,
            then prompt plus fed-back samples).
        generated: tokens sampled for it so far (an EOG token counts).
        next_token: the last sampled token, fed at the next step (DECODE).
    """

    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    tag: object = None
    state: SlotState = SlotState.QUEUED
    slot: int | None = None
    pos: int = 0
    generated: int = 0
    next_token: int | None = None

    @property
    def live(self) -> bool:
        """True in PREFILL or DECODE."""
        return self.state in LIVE_STATES

    @property
    def done(self) -> bool:
        """True in FINISHED or CANCELLED."""
        return self.state in (SlotState.FINISHED, SlotState.CANCELLED)

    @property
    def budget_left(self) -> int:
        """Tokens it may still sample (``max_tokens - generated``)."""
        return self.max_tokens - self.generated

    def _move(self, move: Move) -> None:
        new = TRANSITIONS.get((self.state, move))
        if new is None:
            raise IllegalTransition(self, move)
        self.state = new


@attrs.frozen
class Plan:
    """One decode step: who was admitted and what the batch holds.

    Attributes:
        admitted: requests moved QUEUED -> PREFILL by this plan, in admission
            order; the engine must ``begin`` their slots before the decode.
        feeds: the batch, DECODE slots first; at most one feed per slot.
        owners: the request of each feed (same order as ``feeds``).
    """

    admitted: tuple[Entry, ...] = ()
    feeds: tuple[SlotFeed, ...] = ()
    owners: tuple[Entry, ...] = ()

    @property
    def n_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(len(f.tokens) for f in self.feeds)

    def owner(self, slot: int) -> Entry:
        """The request fed for ``slot`` in this plan.

        Raises:
            KeyError: the slot is not in the batch.
        """
        for feed, entry in zip(self.feeds, self.owners, strict=True):
            if feed.slot == slot:
                return entry
        raise KeyError(slot)


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of the scheduler.

    Attributes:
        slots_total: slots the scheduler may use.
        slots_busy: slots not free (occupied or draining).
        slots_draining: slots whose request ended but whose KV cells are not yet freed.
        queue_depth: requests waiting, per priority (only priorities with any).
        queued: requests waiting, all priorities.
        prefilling: requests in PREFILL.
        decoding: requests in DECODE.
    """

    slots_total: int
    slots_busy: int
    slots_draining: int
    queue_depth: dict[int, int]
    queued: int
    prefilling: int
    decoding: int


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


@attrs.define(eq=False)
class Scheduler:
    """Admission queue, slot table and batch planning for one engine.

    Args:
        n_slots: slots (sequences) decoded together.
        n_batch: most tokens in one batch, over all slots; at least ``n_slots``
            so every decoding slot gets its token each step.
        prefill_chunk: most prompt tokens fed for one slot in one step.
        queue_size: most requests waiting for a slot beyond those that a free
            slot will take at the next plan (0: only as many as free slots).

    Raises:
        ValueError: a size is out of range, or ``n_batch < n_slots``.
    """

    n_slots: int = attrs.field(validator=_positive)
    n_batch: int = attrs.field(validator=_positive)
    prefill_chunk: int = attrs.field(validator=_positive)
    queue_size: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    _queues: dict[int, deque[Entry]] = attrs.field(init=False, factory=dict)
    _n_queued: int = attrs.field(init=False, default=0)
    _slots: list[Entry | None] = attrs.field(init=False)
    _free: set[int] = attrs.field(init=False)
    _draining: list[Entry] = attrs.field(init=False, factory=list)
    _handed_out: set[int] = attrs.field(init=False, factory=set)
    _admit_order: list[Entry] = attrs.field(init=False, factory=list)
    _ids: itertools.count[int] = attrs.field(init=False, factory=itertools.count)

    def __attrs_post_init__(self) -> None:
        if self.n_batch < self.n_slots:
            raise ValueError(
                f"n_batch ({self.n_batch}) must be >= n_slots ({self.n_slots}):"
                " every decoding slot needs one token per batch"
            )
        self._slots = [None] * self.n_slots
        self._free = set(range(self.n_slots))

    # -- admission -----------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """Slots neither occupied nor draining."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """How many requests may wait right now (``queue_size`` + free slots)."""
        return self.queue_size + len(self._free)

    def enqueue(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        priority: int = 0,
        tag: object = None,
    ) -> Entry:
        """Add a request to the admission queue (FIFO within its priority).

        Args:
            prompt: the prompt's token ids (at least one).
            max_tokens: most tokens to sample (>= 1).
            priority: smaller is admitted first.
            tag: any object the caller wants back on the entry.

        Returns:
            The new QUEUED entry.

        Raises:
            QueueFull: ``capacity`` requests are already waiting.
            ValueError: empty prompt or ``max_tokens < 1``.
        """
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if self._n_queued >= self.capacity:
            raise QueueFull(self._n_queued, self.capacity)
        entry = Entry(next(self._ids), tuple(prompt), max_tokens, priority, tag)
        self._queues.setdefault(priority, deque()).append(entry)
        self._n_queued += 1
        return entry

    def _pop_next(self) -> Entry | None:
        if not self._queues:
            return None
        priority = min(self._queues)
        queue = self._queues[priority]
        entry = queue.popleft()
        if not queue:
            del self._queues[priority]
        self._n_queued -= 1
        return entry

    # -- planning ------------------------------------------------------------

    def plan(self) -> Plan:
        """Admit queued requests into free slots, then build one batch.

        Admission takes the lowest free slot for each request, in priority
        then FIFO order, while slots are free. The batch is one token for
        every DECODE request (its last sample at its next position), then
        for each PREFILL request, oldest admission first, the next
        ``min(prefill_chunk, prompt left, room left)`` prompt tokens, until
        ``n_batch`` tokens are used. A chunk that ends the prompt has
        ``sample=True``.

        Returns:
            The plan; ``feeds`` is empty when there is nothing to decode.
        """
        admitted = []
        while self._free and self._queues:
            entry = self._pop_next()
            assert entry is not None
            slot = min(self._free)
            self._free.remove(slot)
            entry._move(Move.ADMIT)
            entry.slot = slot
            entry.pos = 0
            self._slots[slot] = entry
            self._admit_order.append(entry)
            admitted.append(entry)

        feeds: list[SlotFeed] = []
        owners: list[Entry] = []
        room = self.n_batch
        for entry in self._admit_order:
            if entry.state is SlotState.DECODE:
                assert entry.next_token is not None and entry.slot is not None
                feeds.append(SlotFeed(entry.slot, (entry.next_token,), entry.pos, True))
                owners.append(entry)
                room -= 1
        for entry in self._admit_order:
            if room <= 0:
                break
            if entry.state is SlotState.PREFILL and entry.pos < len(entry.prompt):
                assert entry.slot is not None
                n = min(self.prefill_chunk, len(entry.prompt) - entry.pos, room)
                end = entry.pos + n
                chunk = entry.prompt[entry.pos : end]
                feeds.append(SlotFeed(entry.slot, chunk, entry.pos, end == len(entry.prompt)))
                owners.append(entry)
                room -= n
        return Plan(tuple(admitted), tuple(feeds), tuple(owners))

    def commit(self, plan: Plan) -> None:
        """Record that ``plan``'s batch was decoded: advance each fed request's position.

        Requests that ended while the batch was in flight are skipped (their
        slot drains anyway). Call it before :meth:`on_sampled` for the
        batch's samples.
        """
        for feed, entry in zip(plan.feeds, plan.owners, strict=True):
            if entry.live:
                if entry.pos != feed.pos:
                    raise RuntimeError(
                        f"request {entry.id}: plan fed position {feed.pos},"
                        f" request is at {entry.pos} (plan committed twice?)"
                    )
                entry.pos += len(feed.tokens)

    def on_sampled(self, slot: int, token: int) -> Entry:
        """Record a token sampled for ``slot``: it is fed back at the next step.

        The first sample of a request (its prompt fully fed) moves it
        PREFILL -> DECODE. Counts the token in ``generated``.

        Returns:
            The slot's request.

        Raises:
            IllegalTransition: the slot holds no live request, or a PREFILL
                request whose prompt is not fully fed.
        """
        entry = self._slots[slot]
        if entry is None:
            raise RuntimeError(f"token sampled for slot {slot}, which holds no request")
        if entry.state is SlotState.PREFILL:
            if entry.pos != len(entry.prompt):
                raise IllegalTransition(entry, Move.PROMPT_DONE)
            entry._move(Move.PROMPT_DONE)
        elif entry.state is not SlotState.DECODE:
            raise IllegalTransition(entry, Move.PROMPT_DONE)
        entry.generated += 1
        entry.next_token = token
        return entry

    # -- ending --------------------------------------------------------------

    def finish(self, entry: Entry) -> None:
        """End a live request normally or by failure; its slot starts draining.

        Raises:
            IllegalTransition: the request is not in PREFILL or DECODE.
        """
        entry._move(Move.FINISH)
        self._vacate(entry)

    def cancel(self, entry: Entry) -> None:
        """Cancel a request: a queued one leaves the queue, a live one's slot drains.

        Raises:
            IllegalTransition: the request already ended.
        """
        was_queued = entry.state is SlotState.QUEUED
        entry._move(Move.CANCEL)
        if was_queued:
            queue = self._queues[entry.priority]
            queue.remove(entry)
            if not queue:
                del self._queues[entry.priority]
            self._n_queued -= 1
        else:
            self._vacate(entry)

    def _vacate(self, entry: Entry) -> None:
        assert entry.slot is not None and self._slots[entry.slot] is entry
        self._slots[entry.slot] = None
        self._admit_order.remove(entry)
        self._draining.append(entry)

    def take_releases(self) -> tuple[Entry, ...]:
        """Requests whose slots must have their KV cells removed now.

        Each is returned once; its slot stays unavailable until
        :meth:`released`.
        """
        out = tuple(self._draining)
        self._handed_out.update(e.slot for e in out if e.slot is not None)
        self._draining.clear()
        return out

    def released(self, entries: Iterable[Entry]) -> None:
        """The engine removed these requests' KV cells: their slots are free again.

        Raises:
            RuntimeError: a slot was not handed out by :meth:`take_releases`.
        """
        for entry in entries:
            slot = entry.slot
            if slot not in self._handed_out:
                raise RuntimeError(f"slot {slot} released without take_releases()")
            self._handed_out.remove(slot)
            self._free.add(slot)

    # -- queries -------------------------------------------------------------

    def entry_at(self, slot: int) -> Entry | None:
        """The live request holding ``slot``, if any."""
        return self._slots[slot]

    def active(self) -> tuple[Entry, ...]:
        """Live requests (PREFILL or DECODE), oldest admission first."""
        return tuple(self._admit_order)

    def queued(self) -> tuple[Entry, ...]:
        """Waiting requests in admission order."""
        return tuple(e for p in sorted(self._queues) for e in self._queues[p])

    @property
    def releases_pending(self) -> bool:
        """Whether some ended request's slot waits for :meth:`take_releases`."""
        return bool(self._draining)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`plan` would admit or feed anything, or a slot must drain."""
        return bool(self._admit_order or self._draining or (self._queues and self._free))

    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of queue and slots."""
        states = [e.state for e in self._admit_order]
        return SchedulerStatistics(
            slots_total=self.n_slots,
            slots_busy=self.n_slots - len(self._free),
            slots_draining=len(self._draining) + len(self._handed_out),
            queue_depth={p: len(q) for p, q in sorted(self._queues.items())},
            queued=self._n_queued,
            prefilling=states.count(SlotState.PREFILL),
            decoding=states.count(SlotState.DECODE),
        )
