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
        ^  |                     |  |  \\--refilled------^  |
        |  |                     |  \\--finish (failed while prefilling)--> FINISHED
        |  \\--cancel--> CANCELLED <-+--------------------------+ cancel
        +------------------------preempt (PREFILL or DECODE)--+

* A slot is *free*, *occupied* by one request in PREFILL or DECODE, or
  *draining*: its request ended (FINISHED or CANCELLED) but the engine has
  not yet removed its KV cells. A draining slot is handed out by
  :meth:`Scheduler.take_releases` and becomes free only at
  :meth:`Scheduler.released`, so a new request is never admitted into a
  slot whose cells are still there.
* Admission is by priority (smaller int first), FIFO within a priority.
* One KV pool (llama.cpp's unified KV cache) of ``n_cells`` cells is shared by
  every slot: a request may use all of it while the others are idle. The
  scheduler keeps the books: each live request *claims* the cells it will
  hold after the step being planned (its whole prompt from its admission
  on; its committed cells plus the next token while it decodes), a free
  slot's cache entry holds its tokens' cells, a draining slot its cells until
  released. A copy of another slot's prefix counts in full (llama.cpp shares
  the cells of a copy in one pool, so the books never hold less than the
  engine does). What is reserved, and what happens at the edge:

  - admission (FIFO within a priority: a request that does not fit waits at
    the head of the queue, and those behind it wait too) needs room for the
    whole prompt plus :data:`ADMIT_HEADROOM` tokens of reply (or its whole
    budget when smaller); cache entries are evicted for it, least recently
    used first;
  - when the requests already decoding would claim more than the pool at
    the next step, cache entries are evicted first, then the youngest live
    request of the lowest priority is *preempted*: its cells are freed and
    it goes back to the head of its queue with what it sampled (nothing is
    lost or sent again: its stream waits, with keepalives); once readmitted
    it refills its cells (prompt and samples, no sample drawn) and decodes on
    from its last sample. The oldest request is preempted only when it is
    alone, which cannot happen: it never claims more than ``n_cells``
    (``max_tokens`` leaves room, see the runner), so a running request never
    fails because another arrived.
* Prompt-prefix cache (``prefix_cache=True``): a slot whose request ended
  keeps its KV cells and the list of tokens they hold (:class:`SlotCache`) while
  it is free. A request is admitted into the slot that :func:`choose_slot`
  picks (the free slot whose cached tokens share the longest prefix with its
  prompt, ties and misses the least recently used), possibly copying a longer
  prefix from another slot; its ``pos`` then starts after the reused prefix,
  so only the rest of the prompt is fed. A slot's cached tokens are exactly the
  tokens whose cells were decoded for it and committed (:meth:`commit`): the
  prompt fed so far, then the fed-back samples, never the last sample (it is
  not in the KV cells yet) and never a batch that was in flight when its
  request ended. A failed request leaves no cache (its cells are unknown).
  With ``cache_output=False`` only the prompt's cells are kept: the cells of
  sampled tokens were computed one token per step, which llama.cpp's kernels
  may sum in another order than a batched prefill of the same tokens, so
  keeping them can change a later greedy reply by a rounding.
  Without the cache a slot's cells are all removed when it drains and
  admission takes the lowest free slot.
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

from ringserve.core.batch import SlotFeed
from ringserve.core.errors import ErrorKind, RingserveError

__all__ = [
    "TRANSITIONS",
    "CacheChoice",
    "Entry",
    "IllegalTransition",
    "Move",
    "Plan",
    "QueueFull",
    "Scheduler",
    "SchedulerStatistics",
    "SlotCache",
    "SlotState",
    "choose_slot",
    "common_prefix",
]


class SlotState(enum.Enum):
    """Where a request is in its life."""

    QUEUED = "queued"
    """Waiting in the admission queue for a free slot and room in the KV pool (or preempted)."""
    PREFILL = "prefill"
    """Holds a slot; its prompt (or, preempted before, its prompt and samples) is being fed in chunks."""
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
    REFILLED = "refilled"
    PREEMPT = "preempt"
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
        (_P, Move.REFILLED): _D,  # a preempted request's cells are back: it decodes on from its last sample
        (_P, Move.PREEMPT): _Q,
        (_P, Move.FINISH): _F,  # a failure while the prompt is being fed
        (_P, Move.CANCEL): _C,
        (_D, Move.PREEMPT): _Q,
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


MIN_HIT = 16
"""Fewest reused prompt tokens that count as a cache hit (tokens).

A shorter shared prefix is usually only the chat template's first tokens
(``<|im_start|>system``), which every conversation shares: such a request is
a miss and goes to the least recently used free slot instead of evicting
another conversation's cache for a handful of tokens.
"""

MIN_COPY = 32
"""Fewest prompt tokens a copy of cells from another slot must save (tokens).

A copy between two slots' sequences (``llama_memory_seq_cp``) moves the whole
source buffer, whatever the prefix length, so it pays only for a prefix worth
more than a short prefill.
"""


ADMIT_HEADROOM = 256
"""Cells of reply a request needs room for at admission beyond its prompt (tokens; its budget when smaller).

Room for a reply's first steps, so that a request admitted into a nearly full
pool is not preempted at once; past it, requests grow into what is free and
the youngest gives way at the edge (module docstring).
"""


UNBOUNDED = 2**62
"""A KV pool no request reaches (:class:`Scheduler`'s default ``n_cells``)."""


@attrs.frozen
class SlotCache:
    """What a free slot's KV cells hold: a cache entry.

    Attributes:
        slot: the slot.
        tokens: the token ids whose cells the slot holds, at positions
            ``0 .. len(tokens)-1``.
        last_used: the scheduler's tick when the slot was last released
            (greater is more recent; -1: never used).
        prompt_tokens: how many of ``tokens`` were its last request's prompt
            (the rest were sampled); None: all of them.
        cache_key: its last request's cache hint (``GenerationRequest.cache_key``; "": none).
    """

    slot: int
    tokens: tuple[int, ...] = ()
    last_used: int = -1
    prompt_tokens: int | None = None
    cache_key: str = ""


@attrs.frozen
class CacheChoice:
    """Where a request is admitted and what of its prompt it does not feed again.

    Attributes:
        slot: the free slot it takes.
        reuse: leading prompt tokens whose KV cells are reused instead of
            prefilled; always less than the prompt's length, so at least one
            prompt token is fed and gives the logits of the first sample.
        source: the slot whose first ``reuse`` cells are copied into ``slot``
            (``llama_memory_seq_cp``); None when ``slot`` keeps its own.
    """

    slot: int
    reuse: int = 0
    source: int | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def choose_slot(
    prompt: Sequence[int],
    free: Sequence[SlotCache],
    sources: Mapping[int, Sequence[int]] | None = None,
    *,
    min_hit: int = MIN_HIT,
    min_copy: int = MIN_COPY,
    cache_key: str = "",
) -> CacheChoice:
    """The prefix-cache decision: which free slot a prompt goes to, and what it reuses.

    For every free slot, what it could reuse is the longest prefix its own
    cached tokens share with the prompt, or, when some other slot (free, or
    one of ``sources``) shares a prefix at least ``min_copy`` tokens longer,
    that prefix copied from there (the best such source). Reuse is capped at
    ``len(prompt) - 1``: at least one prompt token is fed, since the first
    sample needs the logits of the last prompt token.

    The slot is the one that reuses most; a reuse under ``min_hit`` tokens is
    a miss and counts as 0, unless it is all the prompt may reuse (a short
    prompt sent again). Among equal hits, a slot whose last request had the same
    ``cache_key`` wins where the hit is its own cells (a client's hint that its requests
    share a prefix, the Responses API's ``prompt_cache_key``: its own cells, stale past the
    hit, go before another conversation's), then the one that destroys fewest
    cached prompt tokens wins (the cells of the slot's last prompt beyond
    what it reuses: another conversation's history after a shared system
    prompt; a conversation's next turn extends its last prompt and destroys
    none, only the reply's tail that it re-renders), then one that needs no
    copy, then the least recently used; on a miss,
    the least recently used (a never-used slot first); the lowest slot number
    breaks a last tie.

    Args:
        prompt: the request's prompt tokens (at least one).
        free: the free slots and what their cells hold.
        sources: other slots whose cells may be copied from, by slot: the
            tokens whose cells they hold now (live requests).
        min_hit: see :data:`MIN_HIT` (tokens).
        min_copy: see :data:`MIN_COPY` (tokens).
        cache_key: the request's cache hint ("": none).

    Returns:
        The choice.

    Raises:
        ValueError: no free slot, or an empty prompt.
    """
    if not free:
        raise ValueError("no free slot to choose from")
    limit = len(prompt) - 1
    if limit < 0:
        raise ValueError("the prompt must hold at least one token")
    candidates: dict[int, Sequence[int]] = {c.slot: c.tokens for c in free}
    candidates.update(sources or {})
    best_source, best_copy = None, 0
    for slot, tokens in sorted(candidates.items()):
        n = min(common_prefix(prompt, tokens), limit)
        if n > best_copy:
            best_source, best_copy = slot, n

    best: tuple[tuple[int, bool, int, bool, int, int], CacheChoice] | None = None
    for cache in free:
        own = min(common_prefix(prompt, cache.tokens), limit)
        prompt_cells = len(cache.tokens) if cache.prompt_tokens is None else cache.prompt_tokens
        choice, lost = CacheChoice(cache.slot, own), max(0, prompt_cells - own)
        if best_source is not None and best_source != cache.slot and best_copy - own >= min_copy:
            choice, lost = CacheChoice(cache.slot, best_copy, best_source), prompt_cells
        hit = choice.reuse >= min_hit or 0 < choice.reuse == limit  # or all the prompt it may reuse
        mine = hit and choice.source is None and cache_key != "" and cache.cache_key == cache_key
        key = (choice.reuse if hit else 0, mine, -lost if hit else 0, choice.source is None, -cache.last_used,
               -cache.slot)
        if best is None or key > best[0]:
            best = (key, choice)
    assert best is not None
    return best[1]


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
        state: see :class:`SlotState`.
        slot: the slot it holds or held; None while queued.
        pos: tokens of this request in the slot's KV cells (prompt fed so far,
            then prompt plus fed-back samples).
        generated: tokens sampled for it so far (an EOG token counts).
        next_token: the last sampled token, fed at the next step (DECODE).
        cached: leading prompt tokens whose KV cells were reused from the
            prefix cache at admission (not prefilled); 0 before admission.
        source: the slot its reused cells were copied from at admission;
            None when they were its own slot's (or nothing was reused).
        sampled: the tokens sampled for it so far, in order.
        kept: the tokens whose cells its slot keeps as a cache entry once it
            drains (set when it ends; empty without the cache or after a
            failure).
        forced: the tokens its next samples must be, in order (:meth:`Scheduler.force`):
            each sampling feed carries the first as :attr:`SlotFeed.forced`, and
            :meth:`Scheduler.on_sampled` takes it off.
        cache_key: the request's cache hint (:func:`choose_slot`).
        reuse: the cells its last admission reused (its slot's own, or copied from
            ``source``): the cells the engine's ``begin`` keeps; ``cached`` is the first
            admission's.
        refill: after a preemption that came once it had sampled, the tokens whose cells it
            feeds again on readmission (its prompt and samples but the last), with no sample
            drawn at their end; None: it feeds its prompt.
        preemptions: times it gave its cells up for an older request (:meth:`Scheduler.plan`).
    """

    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    state: SlotState = SlotState.QUEUED
    slot: int | None = None
    pos: int = 0
    generated: int = 0
    next_token: int | None = None
    cached: int = 0
    source: int | None = None
    sampled: list[int] = attrs.Factory(list)
    kept: tuple[int, ...] = ()
    forced: list[int] = attrs.Factory(list)
    cache_key: str = ""
    reuse: int = 0
    refill: tuple[int, ...] | None = None
    preemptions: int = 0

    @property
    def target(self) -> tuple[int, ...]:
        """The tokens its PREFILL feeds: its prompt, or its :attr:`refill`."""
        return self.prompt if self.refill is None else self.refill

    @property
    def claim(self) -> int:
        """KV cells it holds once the step being planned is decoded: all of :attr:`target` in
        PREFILL (claimed from admission on), its committed cells and the next token in DECODE."""
        return len(self.target) if self.state is SlotState.PREFILL else self.pos + 1

    @property
    def cells(self) -> tuple[int, ...]:
        """The tokens whose KV cells were decoded for it and committed, at positions ``0 .. pos-1``.

        The prompt fed so far, then the fed-back samples; the last sample is
        not among them until it is fed.
        """
        if self.pos <= len(self.prompt):
            return self.prompt[: self.pos]
        return self.prompt + tuple(self.sampled[: self.pos - len(self.prompt)])

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
        clear: slots whose KV cells the engine must remove before the batch (a cache
            entry evicted, or a preempted request's), each ``release(slot, 0)``.
        preempted: requests moved back to the queue by this plan (their slots are in
            ``clear``).
    """

    admitted: tuple[Entry, ...] = ()
    feeds: tuple[SlotFeed, ...] = ()
    owners: tuple[Entry, ...] = ()
    clear: tuple[int, ...] = ()
    preempted: tuple[Entry, ...] = ()
    _by_slot: dict[int, Entry] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # owner() is asked once per sampled token: a dict, not a scan of the batch (256 slots)
        object.__setattr__(self, "_by_slot", {f.slot: e for f, e in zip(self.feeds, self.owners, strict=True)})

    @property
    def n_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(len(f.tokens) for f in self.feeds)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens in the batch (prefilled, as opposed to fed-back samples)."""
        return sum(len(f.tokens) for f, e in zip(self.feeds, self.owners, strict=True) if f.pos < len(e.prompt))

    def owner(self, slot: int) -> Entry:
        """The request fed for ``slot`` in this plan.

        Raises:
            KeyError: the slot is not in the batch.
        """
        return self._by_slot[slot]


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
        cached_cells: KV cells (tokens) that free slots hold as cache entries.
        prefix_lookup_tokens: prompt tokens of requests admitted with the
            prefix cache on (looked up in it).
        prefix_hit_tokens: of those, the tokens whose cells were reused.
        pool_cells: the KV pool's cells (``n_cells``).
        claimed_cells: cells the books hold (:meth:`Scheduler.plan`: the live requests'
            claims, draining slots, cache entries).
        preemptions: requests preempted so far to let older ones grow.
    """

    slots_total: int
    slots_busy: int
    slots_draining: int
    queue_depth: dict[int, int]
    queued: int
    prefilling: int
    decoding: int
    cached_cells: int = 0
    prefix_lookup_tokens: int = 0
    prefix_hit_tokens: int = 0
    pool_cells: int = UNBOUNDED
    claimed_cells: int = 0
    preemptions: int = 0


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
        prefix_cache: keep ended requests' cells as cache entries and admit by
            :func:`choose_slot`; False: admission takes the lowest free slot
            and a drained slot keeps nothing.
        cache_output: also keep the cells of the fed-back samples (a
            conversation's next turn then prefills only its new messages);
            False: only the prompt's (see the module docstring).
        min_hit: see :data:`MIN_HIT` (tokens).
        min_copy: see :data:`MIN_COPY` (tokens).
        n_cells: the KV pool the slots share (tokens; the module docstring); the
            default, :data:`UNBOUNDED`, keeps no books (a test of other rules).

    Raises:
        ValueError: a size is out of range, or ``n_batch < n_slots``.
    """

    n_slots: int = attrs.field(validator=_positive)
    n_batch: int = attrs.field(validator=_positive)
    prefill_chunk: int = attrs.field(validator=_positive)
    queue_size: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    prefix_cache: bool = False
    cache_output: bool = True
    min_hit: int = attrs.field(default=MIN_HIT, validator=attrs.validators.ge(1))
    min_copy: int = attrs.field(default=MIN_COPY, validator=attrs.validators.ge(1))
    n_cells: int = attrs.field(default=UNBOUNDED, validator=_positive)
    _queues: dict[int, deque[Entry]] = attrs.field(init=False, factory=dict)
    _n_queued: int = attrs.field(init=False, default=0)
    _slots: list[Entry | None] = attrs.field(init=False)
    _free: set[int] = attrs.field(init=False)
    _draining: list[Entry] = attrs.field(init=False, factory=list)
    _handed_out: dict[int, Entry] = attrs.field(init=False, factory=dict)
    _admit_order: list[Entry] = attrs.field(init=False, factory=list)
    _ids: itertools.count[int] = attrs.field(init=False, factory=itertools.count)
    _cache: dict[int, SlotCache] = attrs.field(init=False, factory=dict)
    _ticks: itertools.count[int] = attrs.field(init=False, factory=itertools.count)
    _lookup_tokens: int = attrs.field(init=False, default=0)
    _hit_tokens: int = attrs.field(init=False, default=0)
    _preemptions: int = attrs.field(init=False, default=0)

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
    def capacity(self) -> int:
        """How many requests may wait right now (``queue_size`` + free slots)."""
        return self.queue_size + len(self._free)

    def enqueue(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        priority: int = 0,
        cache_key: str = "",
    ) -> Entry:
        """Add a request to the admission queue (FIFO within its priority).

        Args:
            prompt: the prompt's token ids (at least one).
            max_tokens: most tokens to sample (>= 1).
            priority: smaller is admitted first.
            cache_key: the request's cache hint (:func:`choose_slot`).

        Returns:
            The new QUEUED entry.

        Raises:
            QueueFull: ``capacity`` requests are already waiting.
            ValueError: empty prompt, ``max_tokens < 1``, or more cells than the pool
                holds (the runner bounds ``max_tokens`` by what the pool leaves).
        """
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) + max_tokens > self.n_cells:
            raise ValueError(f"{len(prompt)} prompt tokens and {max_tokens} to sample exceed the pool of {self.n_cells} cells")
        if self._n_queued >= self.capacity:
            raise QueueFull(self._n_queued, self.capacity)
        entry = Entry(next(self._ids), tuple(prompt), max_tokens, priority, cache_key=cache_key)
        self._queues.setdefault(priority, deque()).append(entry)
        self._n_queued += 1
        return entry

    def _next(self) -> Entry:
        """The request admission takes next (there is one)."""
        return self._queues[min(self._queues)][0]

    def _pop_next(self) -> None:
        priority = min(self._queues)
        queue = self._queues[priority]
        queue.popleft()
        if not queue:
            del self._queues[priority]
        self._n_queued -= 1

    # -- planning ------------------------------------------------------------

    def plan(self) -> Plan:
        """Make room in the KV pool, admit queued requests, then build one batch.

        First the pool: when the live requests would claim more cells than it
        holds at this step (:attr:`Entry.claim`), cache entries are evicted
        (least recently used first), then the youngest live requests of the
        lowest priority are preempted, back to the head of their queue, until
        they fit (module docstring). Then admission, in priority then FIFO
        order, while a slot is free and the pool has room for the next
        request's prompt plus :data:`ADMIT_HEADROOM` (its budget when smaller),
        evicting cache entries for it; a request that does not fit stops
        admission. With the prefix cache each request takes the slot
        :func:`choose_slot` picks (live requests, those admitted just before
        in this plan included, may be copied from) and its position starts
        after the reused prefix; without it, the lowest free slot and
        position 0. The batch is one token for every DECODE request (its last
        sample at its next position), then for each PREFILL request, oldest
        admission first, the next ``min(prefill_chunk, tokens left, room
        left)`` tokens of its :attr:`Entry.target`, until ``n_batch`` tokens
        are used. A chunk that ends a prompt has ``sample=True``; one that ends
        a refill has not.

        Returns:
            The plan; ``feeds`` is empty when there is nothing to decode.
        """
        clear: list[int] = []
        preempted = self._make_room(clear)
        admitted = []
        while self._free and self._queues:
            entry = self._next()
            choice = self._room_for(entry, clear)
            if choice is None:
                break
            self._pop_next()
            if self.prefix_cache:
                self._lookup_tokens += len(entry.target)
                self._hit_tokens += choice.reuse
            slot = choice.slot
            self._free.remove(slot)
            self._cache.pop(slot, None)
            entry._move(Move.ADMIT)
            entry.slot = slot
            entry.pos = entry.reuse = choice.reuse
            if entry.refill is None and not entry.preemptions:
                entry.cached = choice.reuse
            entry.source = choice.source
            self._slots[slot] = entry
            self._admit_order.append(entry)
            admitted.append(entry)

        feeds: list[SlotFeed] = []
        owners: list[Entry] = []
        room = self.n_batch
        for entry in self._admit_order:
            if entry.state is SlotState.DECODE:
                assert entry.next_token is not None and entry.slot is not None
                forced = entry.forced[0] if entry.forced else None
                feeds.append(SlotFeed(entry.slot, (entry.next_token,), entry.pos, True, forced))
                owners.append(entry)
                room -= 1
        for entry in self._admit_order:
            if room <= 0:
                break
            target = entry.target
            if entry.state is SlotState.PREFILL and entry.pos < len(target):
                assert entry.slot is not None
                n = min(self.prefill_chunk, len(target) - entry.pos, room)
                end = entry.pos + n
                sample = end == len(target) and entry.refill is None
                forced = entry.forced[0] if sample and entry.forced else None
                feeds.append(SlotFeed(entry.slot, target[entry.pos : end], entry.pos, sample, forced))
                owners.append(entry)
                room -= n
        return Plan(tuple(admitted), tuple(feeds), tuple(owners), tuple(clear), tuple(preempted))

    def _held(self, without: Iterable[int | None] = ()) -> int:
        """KV cells the books hold at the step being planned: the live requests' claims, the
        draining slots' cells and the free slots' cache entries (but those of ``without``)."""
        skip = set(without)
        held = sum(e.claim for e in self._admit_order)
        held += sum(e.pos for e in self._draining)
        held += sum(e.pos for e in self._handed_out.values())
        return held + sum(len(c.tokens) for slot, c in self._cache.items() if slot in self._free and slot not in skip)

    def _room_for(self, entry: Entry, clear: list[int]) -> CacheChoice | None:
        """Where ``entry`` is admitted, once the pool has room for its prompt and headroom (cache
        entries evicted for it, their slots put on ``clear``); None when it has not.

        :func:`choose_slot`'s choice first; when it copies from a free slot's cache entry (which
        must then stay) and does not fit, that slot itself (its cells are reused in place, and
        none is counted twice); then the chosen slot with nothing reused.
        """
        choice = self._choose(entry.target, entry.cache_key)
        need = len(entry.target) + min(ADMIT_HEADROOM, entry.budget_left)
        choices = [choice]
        if choice.source is not None and choice.source in self._free:
            choices.append(CacheChoice(choice.source, choice.reuse))
        choices.append(CacheChoice(choice.slot))
        for candidate in choices:
            keep = {candidate.slot, candidate.source}
            evictable = sum(len(c.tokens) for c in self._evictable(keep))
            if self._held([candidate.slot]) - evictable + need <= self.n_cells:
                while self._held([candidate.slot]) + need > self.n_cells:
                    self._evict_one(keep, clear)
                return candidate
        return None

    def _evictable(self, keep: set[int | None]) -> list[SlotCache]:
        """The free slots' cache entries that hold cells, but those of the slots in ``keep``."""
        return [c for slot, c in self._cache.items() if slot in self._free and slot not in keep and c.tokens]

    def _evict_one(self, keep: set[int | None], clear: list[int]) -> bool:
        """Drop the least recently used cache entry not in ``keep``; False when there is none."""
        cached = self._evictable(keep)
        if not cached:
            return False
        victim = min(cached, key=lambda c: c.last_used)
        self._cache[victim.slot] = SlotCache(victim.slot, (), victim.last_used, 0)
        clear.append(victim.slot)
        return True

    def _make_room(self, clear: list[int]) -> list[Entry]:
        """Evict cache entries, then preempt the youngest live requests of the lowest priority,
        until the live requests' claims fit the pool; the preempted, in the order they went."""
        preempted = []
        while self._held() > self.n_cells:
            if self._evict_one(set(), clear):
                continue
            if len(self._admit_order) < 2:
                break  # one request alone never claims more than the pool (enqueue's bound)
            victim = max(self._admit_order, key=lambda e: (e.priority, e.id))
            assert victim.slot is not None
            clear.append(victim.slot)
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _preempt(self, entry: Entry) -> None:
        """Give ``entry``'s slot and cells up; it waits at the head of its queue with what it sampled."""
        entry._move(Move.PREEMPT)
        slot = entry.slot
        assert slot is not None
        if entry.generated:
            entry.refill = entry.cells  # its prompt and samples but the last, which is fed next
        entry.pos = entry.reuse = 0
        entry.slot = entry.source = None
        entry.preemptions += 1
        self._preemptions += 1
        self._slots[slot] = None
        self._admit_order.remove(entry)
        self._free.add(slot)
        self._cache[slot] = SlotCache(slot, (), next(self._ticks), 0)
        self._queues.setdefault(entry.priority, deque()).appendleft(entry)
        self._n_queued += 1

    def _choose(self, prompt: tuple[int, ...], cache_key: str) -> CacheChoice:
        if not self.prefix_cache:
            return CacheChoice(min(self._free))
        free = [self._cache.get(slot) or SlotCache(slot) for slot in sorted(self._free)]
        live = {e.slot: e.cells for e in self._admit_order if e.slot is not None}
        return choose_slot(prompt, free, live, min_hit=self.min_hit, min_copy=self.min_copy, cache_key=cache_key)

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
                if entry.refill is not None and entry.state is SlotState.PREFILL and entry.pos == len(entry.refill):
                    entry._move(Move.REFILLED)  # its last sample is fed at the next step

    def on_sampled(self, slot: int, token: int) -> Entry:
        """Record a token sampled for ``slot``: it is fed back at the next step.

        The first sample of a request (its prompt fully fed) moves it
        PREFILL -> DECODE. Counts the token in ``generated``; a forced token
        (:attr:`Entry.forced`) is taken off.

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
        entry.sampled.append(token)
        if entry.forced:
            del entry.forced[0]
        return entry

    def force(self, entry: Entry, tokens: Sequence[int]) -> None:
        """Make the next samples of a queued or live request ``tokens``, in order (a reasoning
        budget's closing marker): the plans' sampling feeds carry them one at a time."""
        entry.forced = list(tokens)

    # -- ending --------------------------------------------------------------

    def finish(self, entry: Entry, *, keep_cells: bool = True) -> None:
        """End a live request normally or by failure; its slot starts draining.

        Args:
            entry: the request.
            keep_cells: with the prefix cache, its slot keeps the cells of
                :attr:`Entry.cells` as a cache entry; False (a failure: what
                the engine holds for it is unknown) keeps none.

        Raises:
            IllegalTransition: the request is not in PREFILL or DECODE.
        """
        entry._move(Move.FINISH)
        self._vacate(entry, keep_cells)

    def cancel(self, entry: Entry) -> None:
        """Cancel a request: a queued one leaves the queue, a live one's slot drains.

        A live one's committed cells (:attr:`Entry.cells`) stay as its slot's
        cache entry (with the prefix cache): a batch in flight at the cancel
        is not committed, so its cells are not counted and are cut off when
        the slot is released.

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
            self._vacate(entry, keep_cells=True)

    def _vacate(self, entry: Entry, keep_cells: bool) -> None:
        assert entry.slot is not None and self._slots[entry.slot] is entry
        cells = entry.cells if self.cache_output else entry.cells[: len(entry.prompt)]
        entry.kept = cells if self.prefix_cache and keep_cells else ()
        self._slots[entry.slot] = None
        self._admit_order.remove(entry)
        self._draining.append(entry)

    def take_releases(self) -> tuple[Entry, ...]:
        """Requests whose slots must have their KV cells removed now.

        Each is returned once; its slot stays unavailable until
        :meth:`released`. The engine removes every cell of the slot except
        the first ``len(entry.kept)``, which stay as its cache entry.
        """
        out = tuple(self._draining)
        self._handed_out.update((e.slot, e) for e in out if e.slot is not None)
        self._draining.clear()
        return out

    def released(self, entries: Iterable[Entry], lost: Iterable[int] = ()) -> None:
        """The engine removed these requests' KV cells: their slots are free again.

        Each slot's cache entry becomes its request's :attr:`Entry.kept`
        tokens, except for the slots in ``lost`` (the engine failed to
        release them, so what their cells hold is unknown): those keep none.

        Raises:
            RuntimeError: a slot was not handed out by :meth:`take_releases`.
        """
        lost = set(lost)
        for entry in entries:
            slot = entry.slot
            if slot not in self._handed_out:
                raise RuntimeError(f"slot {slot} released without take_releases()")
            del self._handed_out[slot]
            self._free.add(slot)
            kept = () if slot in lost else entry.kept
            self._cache[slot] = SlotCache(slot, kept, next(self._ticks), min(len(kept), len(entry.prompt)),
                                          entry.cache_key)

    def forget_cache(self) -> None:
        """Drop every free slot's cache entry (the engine's state is unknown, e.g. after a crash).

        The cells stay in the engine until the slot's next request begins
        with nothing reused, which removes them.
        """
        for slot, cache in self._cache.items():
            self._cache[slot] = SlotCache(slot, (), cache.last_used, 0)

    # -- queries -------------------------------------------------------------

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
            cached_cells=sum(len(self._cache[s].tokens) for s in self._free if s in self._cache),
            prefix_lookup_tokens=self._lookup_tokens,
            prefix_hit_tokens=self._hit_tokens,
            pool_cells=self.n_cells,
            claimed_cells=self._held(),
            preemptions=self._preemptions,
        )
