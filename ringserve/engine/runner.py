"""The Trio owner of the engine: one task decodes for every request.

Like llama.cpp's ``server_context`` (``tools/server``), one owner holds the
model and all slots and fills one shared batch per step. Here the owner is the
task running :meth:`Runner.run`; the engine's blocking calls run on a worker
thread the runner owns for as long as :meth:`Runner.run` runs
(:class:`~ringserve.engine.thread.EngineThread`: one thread at a time, so
llama.cpp keeps one OpenMP team; one call at a time; the thread ends after
:data:`ENGINE_IDLE_SECONDS` without a call, and the team's spinning with it): a thread inside
``decode`` is never abandoned, cancellation takes effect between steps.

One step of the loop:

1. Slots of requests that ended (finished, failed or cancelled) are released
   on the worker thread (``engine.release``: sampler freed, KV cells removed
   except those the prompt-prefix cache keeps), and only then become free
   for admission.
2. :meth:`Scheduler.plan <ringserve.core.scheduler.Scheduler.plan>` admits
   queued requests, each into the slot whose cached cells share the longest
   prefix with its prompt (``[engine] prefix_cache``), and builds one batch:
   one token per decoding slot plus prompt chunks (after the reused prefix)
   for prefilling slots.
3. On the worker thread: ``engine.begin`` for the admitted slots (keeping or
   copying the reused cells), then one ``engine.decode`` for the batch.
4. Back on the Trio thread, each sampled token is counted, detokenized (one
   :class:`~ringserve.core.detokenizer.Detokenizer` per request), run through
   the request's :class:`~ringserve.core.reply.ReplyStage` (tool-call parser,
   stop strings, block numbering), and the block events it gives are
   pushed with ``send_nowait`` to that request's channel: generation never
   waits for a consumer. Each channel's buffer holds ``4 * max_tokens + 4``
   events, more than a generation can produce (per token at most a delta, a
   block stop, a block start and a delta, as when a token ends a tool call's
   arguments and starts the next text; a token holds fewer characters than
   a call's wrapper, so it never closes one call and opens another), then the
   closing events, so it never fills. A generation with a consumer
   (:meth:`Generation.consume`: the producer of a live message) gets them
   instead in one synchronous pass over the step's generations, run as soon
   as the next step is handed to the engine thread, so that work overlaps
   the next decode without a task switch per token.

5. Unless the runner overlaps steps (``overlap``, from ``[engine] overlap``
   by :func:`~ringserve.config.overlap_steps`), the loop then delivers the
   step's events to the consumers and lets the other tasks run before the
   next decode: it waits until every other task is
   blocked (``trio.testing.wait_all_tasks_blocked``), for at most as long as
   the step took, so rendering, logging and HTTP writes of step N's tokens
   do not run beside step N+1's decode. Where llama.cpp's threads take every
   core, a decode thread preempted by that Python work stalls the whole step
   (issue 19). A consumer whose flush deadline passes during a decode waits
   for its end (:meth:`Runner.between_steps`) in that mode.

With nothing to do the loop parks on a ``trio.Event`` that ``submit`` and
cancellation set; it never polls. Woken, it first lets the requests that
are being tokenized at that moment enqueue (``Runner._gather_arrivals``), so
requests that arrive together are prefilled in one batch.

Consumers call :meth:`Runner.prepare` (tokenize, check that the prompt fits
(case C4) and set the budget: ``max_tokens``, at most what the context leaves) and then ``async with runner.submit(prepared) as gen``: iterating
``gen`` gives block events (:class:`BlockStart`, :class:`BlockDelta`,
:class:`BlockStop`, in the order ``core/events.py`` guarantees) and one
terminal :class:`Finish` or :class:`Failure`. Leaving the block early cancels (cases C1/C2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from ringserve.config import EngineConfig
from ringserve.core.batch import Sampled, SlotFeed
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    Failure,
    Finish,
    GenerationEvent,
    GenerationRequest,
)
from ringserve.core.scheduler import Entry, Plan, Scheduler, SlotState
from ringserve.core.view import Waiting, WaitReason
from ringserve.engine.generation import Count, Generation, Prepared
from ringserve.engine.loader import context_window
from ringserve.engine.prompter import Prompter
from ringserve.engine.protocol import ChatPrompt, Engine, EngineError, KVCacheFull
from ringserve.engine.thread import EngineThread
from ringserve.formats.base import ChatFormat

__all__ = ["ModelStatistics", "ModelsStatistics", "Runner", "RunnerStatistics"]


#: Seconds without an engine call after which the engine thread ends (and with it llama.cpp's
#: OpenMP team, whose threads spin while they wait: ``ringserve.engine._native``); the next call starts one.
ENGINE_IDLE_SECONDS = 1.0

log = logging.getLogger("ringserve.runner")


@attrs.frozen
class RunnerStatistics:
    """A snapshot of the runner (for ``metrics.py`` and tests).

    Attributes:
        slots_total: slots decoded together.
        slots_busy: slots holding a request or still being released.
        queue_depth: requests waiting for a slot, per priority.
        kv_cells_used: KV cells in use by requests over all slots, as of the
            last engine call (tokens); the cells that free slots keep for the
            prefix cache are not counted (``prefix_cache_cells``).
        kv_cells_total: the KV pool the slots share (``engine.n_ctx``, tokens).
        prefix_cache: the prompt-prefix cache is on (the config asks for it
            and the engine supports it).
        prefix_cache_cells: KV cells (tokens) that free slots keep as cache
            entries.
        prefix_cache_lookup_tokens_total: prompt tokens of requests admitted
            with the cache on.
        prefix_cache_hit_tokens_total: of those, tokens whose cells were
            reused instead of prefilled.
        prompt_tokens_prefilled_total: prompt tokens fed to the engine in
            decoded batches (what was not reused).
        steps: decode calls that succeeded.
        failed_steps: decode calls that raised.
        last_step_seconds: wall time of the last decode call (seconds).
        decode_seconds_total: wall time of all decode calls (seconds).
        engine_idle_seconds_total: wall time from the end of one decode call
            to the start of the next while the loop had work (seconds): what
            the engine waited for the Python side between steps (the hops
            to and from its thread, the step's tokens, the plan, releases and
            begins). Over this plus ``decode_seconds_total``: the share of
            a busy engine's time that a GPU would sit idle.
        loop_lag_seconds_total: of that, the wall time from the end of each decode
            call to the owner loop taking its result (seconds): the engine waiting
            for the event loop to get round to it (the hop back, and whatever
            the loop ran first: the last step's producers, the readers' writes).
        last_step_tokens: tokens in the last decoded batch.
        step_tokens_total: tokens in all decoded batches (prompt chunks and
            fed-back samples).
        prompt_tokens_total: prompt tokens of admitted requests.
        generated_tokens_total: tokens sampled for live requests (EOG counted).
        cancels: requests cancelled by their consumer.
        preemptions: requests that gave their cells up so an older one could grow
            (``core/scheduler.py``), and waited to go on.
        tokens_after_cancel_total: tokens decoded for requests after their
            cancel (0, or 1 per cancel that raced an in-flight step).
        last_cancel_to_free_seconds: time from the last cancel of a request
            holding a slot to its KV cells being removed (seconds, on the
            Trio clock); None before the first.
        max_cancel_to_free_seconds: the largest such time so far, or None.
        running: the owner loop is running.
    """

    slots_total: int
    slots_busy: int
    queue_depth: dict[int, int]
    kv_cells_used: int
    kv_cells_total: int
    prefix_cache: bool
    prefix_cache_cells: int
    prefix_cache_lookup_tokens_total: int
    prefix_cache_hit_tokens_total: int
    prompt_tokens_prefilled_total: int
    steps: int
    failed_steps: int
    last_step_seconds: float
    decode_seconds_total: float
    engine_idle_seconds_total: float
    loop_lag_seconds_total: float
    last_step_tokens: int
    step_tokens_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    cancels: int
    preemptions: int
    tokens_after_cancel_total: int
    last_cancel_to_free_seconds: float | None
    max_cancel_to_free_seconds: float | None
    running: bool


@attrs.frozen
class ModelStatistics:
    """One model of the catalog at a scrape: its name, its status (``core/router.py``'s
    ``ModelStatus`` value) and its runner's snapshot while it is loaded."""

    name: str
    status: str
    runner: RunnerStatistics | None = None


@attrs.frozen
class ModelsStatistics:
    """Every model's :class:`ModelStatistics` (``live/models.py``'s ``ModelPool.statistics``)."""

    models: tuple[ModelStatistics, ...]


@attrs.define
class _Counters:
    """The runner's running totals: the fields of :class:`RunnerStatistics` of the same names,
    copied into each snapshot."""

    prompt_tokens_prefilled_total: int = 0
    steps: int = 0
    failed_steps: int = 0
    last_step_seconds: float = 0.0
    decode_seconds_total: float = 0.0
    engine_idle_seconds_total: float = 0.0
    loop_lag_seconds_total: float = 0.0
    last_step_tokens: int = 0
    step_tokens_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    cancels: int = 0
    tokens_after_cancel_total: int = 0
    last_cancel_to_free_seconds: float | None = None
    max_cancel_to_free_seconds: float | None = None

    def decoded(self, seconds: float, plan: Plan) -> None:
        """A decode step of ``plan`` took ``seconds``."""
        self.steps += 1
        self.last_step_seconds = seconds
        self.decode_seconds_total += seconds
        self.last_step_tokens = plan.n_tokens
        self.step_tokens_total += plan.n_tokens
        self.prompt_tokens_prefilled_total += plan.prompt_tokens

    def failed(self, seconds: float) -> None:
        """A decode step failed after ``seconds``."""
        self.failed_steps += 1
        self.last_step_seconds = seconds
        self.decode_seconds_total += seconds

    def freed(self, seconds: float) -> None:
        """A cancelled request's KV cells were removed ``seconds`` after its cancel."""
        self.last_cancel_to_free_seconds = seconds
        if self.max_cancel_to_free_seconds is None or seconds > self.max_cancel_to_free_seconds:
            self.max_cancel_to_free_seconds = seconds


@attrs.frozen
class _StepOutcome:
    """What one worker-thread step came back with."""

    begin_errors: dict[int, Exception] = attrs.Factory(dict)
    sampled: list[Sampled] | None = None
    error: Exception | None = None
    started: float | None = None  # time.perf_counter() when the decode call began (None: not called)
    seconds: float = 0.0
    kv_cells_used: int | None = None


class Runner:
    """The one owner of an engine: admits, batches, decodes and streams results.

    Slots, batch size and chunking: ``min(config.slots, engine.n_slots)``
    slots, batches of at most ``min(config.n_batch, engine.n_batch)`` tokens,
    prompt chunks of at most ``config.prefill_chunk`` tokens per slot and
    step, and up to ``config.queue_size`` requests waiting beyond the free
    slots. The slots share the engine's KV pool of ``engine.n_ctx`` cells
    (``core/scheduler.py`` keeps its books); one request may hold
    :attr:`context_window` of them. The prompt-prefix cache is on when
    ``config.prefix_cache`` and ``engine.prefix_cache`` are.

    Args:
        engine: the backend; the runner calls it only from its worker thread.
        config: the ``[engine]`` table.
        on_cancel_freed: called with the seconds from a cancel to the
            removal of that generation's KV cells, each time one is freed
            (for the metrics' histogram).
        overlap: start decode step N+1 while the consumers still handle step
            N's events (True), or let them finish first (False; step 5 of the
            module docstring).

    Raises:
        ValueError: the batch is smaller than the number of slots.
    """

    def __init__(
        self,
        engine: Engine,
        config: EngineConfig | None = None,
        *,
        on_cancel_freed: Callable[[float], None] | None = None,
        overlap: bool = True,
        prompter: Prompter | None = None,
    ) -> None:
        config = config or EngineConfig()
        #: what prepares its requests: the given one, or one over the engine's own vocabulary
        self.prompter = prompter or Prompter(engine, context_window(config, engine.n_ctx_seq))
        self._overlap = overlap
        self._step_done: trio.Event | None = None  # set when the decode in flight returns
        self._on_cancel_freed = on_cancel_freed
        self._engine = engine
        self._config = config
        n_slots = min(config.slots, engine.n_slots)
        n_batch = min(config.n_batch, engine.n_batch)
        self._scheduler = Scheduler(
            n_slots=n_slots,
            n_batch=n_batch,
            prefill_chunk=min(config.prefill_chunk, n_batch),
            queue_size=config.queue_size,
            prefix_cache=config.prefix_cache and engine.prefix_cache,
            cache_output=config.prefix_cache_output,
            n_cells=engine.n_ctx,
        )
        # decode, begin, release: one call at a time; the thread (and llama.cpp's spinning OpenMP
        # team) ends once the runner has been idle for ENGINE_IDLE_SECONDS
        self._engine_thread = EngineThread("ringserve engine", idle_seconds=ENGINE_IDLE_SECONDS)
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._started = False
        self._running = False
        self._closed = False
        # each queued or live request's generation, until its slot is released or it leaves the queue
        self._generations: dict[Entry, Generation] = {}
        self._kv_used = 0  # KV cells in use as of the last engine call
        self._counters = _Counters()
        self._ready: dict[Generation, None] = {}  # generations with a consumer and events to deliver
        self._late: list[tuple[Generation, Sampled]] = []  # tokens to turn into events after the next submit
        self._last_decode_end: float | None = None  # time.perf_counter() at the end of the last decode call
        self._loop_lag = 0.0  # seconds from the end of the last decode call to the loop taking its result
        self._loop_busy = 0.0  # the share of the last step's time the loop's thread was on a CPU
        self._resumed: tuple[float, float] | None = None  # (perf_counter, thread_time) as the loop took the last step

    # -- pass-through ------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The engine's model name."""
        return self._engine.model_id

    @property
    def chat_format(self) -> ChatFormat:
        """The model's output format (its family)."""
        return self._engine.chat_format

    @property
    def context_window(self) -> int:
        """The most tokens one request may hold, prompt plus generated (its prompter's)."""
        return self.prompter.context_window

    @property
    def last_step_seconds(self) -> float:
        """Wall time of the last decode call (seconds; 0 before the first)."""
        return self._counters.last_step_seconds

    @property
    def loop_lag(self) -> float:
        """Seconds from the end of the last decode call to the owner loop taking its result (0
        before the first): how long the engine waited for the event loop after it. Small (the
        hop back) unless other work held the loop then (``loop_lag_seconds_total``)."""
        return self._loop_lag

    @property
    def loop_busy(self) -> float:
        """The share (0 to 1) of the wall time from one decode call's result to the next that the
        event loop's thread (this one) was running: near 1, everything it does waits its turn."""
        return self._loop_busy

    @property
    def overlap(self) -> bool:
        """Whether decode step N+1 starts while step N's events are still being handled."""
        return self._overlap

    async def between_steps(self) -> None:
        """Return when no decode step is in flight: at once when none is or the runner overlaps steps.

        A consumer calls it before work that is not the answer to an event
        (a flush deadline passed), so that work too stays out of the decode's
        way when the runner does not overlap.
        """
        if not self._overlap and self._step_done is not None:
            await self._step_done.wait()

    @property
    def running(self) -> bool:
        """Whether the owner loop is running (requests can be submitted)."""
        return self._running

    @property
    def engine_thread_alive(self) -> bool:
        """Whether the engine thread, and llama.cpp's OpenMP team that spins beside it, is alive.

        False before :meth:`run` and after :data:`ENGINE_IDLE_SECONDS` without a
        call (the next call starts a new one). A benchmark that puts another
        decode loop on the same cores waits for False first.
        """
        return self._engine_thread.ident is not None

    # -- consumer side -----------------------------------------------------

    async def prepare(self, request: GenerationRequest) -> Prepared:
        """:meth:`Prompter.prepare <ringserve.engine.prompter.Prompter.prepare>` of this runner's prompter."""
        return await self.prompter.prepare(request)

    async def count(self, request: GenerationRequest) -> Count:
        """:meth:`Prompter.count <ringserve.engine.prompter.Prompter.count>` of this runner's prompter."""
        return await self.prompter.count(request)

    async def render(self, request: GenerationRequest) -> ChatPrompt:
        """:meth:`Prompter.render <ringserve.engine.prompter.Prompter.render>` of this runner's prompter."""
        return await self.prompter.render(request)

    @asynccontextmanager
    async def submit(self, prepared: Prepared) -> AsyncIterator[Generation]:
        """Enqueue a prepared request; yield its :class:`Generation`.

        Entering enqueues at once or raises. Leaving the block before the
        generation produced its terminal event cancels it, synchronously, so
        this holds when the block is left by an exception or by Trio
        cancellation of the consumer: the request leaves the queue, or its
        slot is marked for release, which the runner does (KV cells removed,
        sampler freed) before its next decode step. At most one token that
        was already being decoded is counted as decoded after the cancel.
        ``gen.usage`` stays valid.

        Raises:
            RingserveError: ``OVERLOADED`` (retryable, with ``retry_after``)
                when the queue is full; ``UNAVAILABLE`` when the runner loop is
                not running.
        """
        gen = self._enqueue(prepared)
        try:
            yield gen
        finally:
            if gen.outcome is None and not gen.cancelled:
                self._cancel(gen)
            gen.close()

    def _enqueue(self, prepared: Prepared) -> Generation:
        if not self._running:
            raise RingserveError(
                ErrorKind.UNAVAILABLE,
                "the generation loop is not running",
                retry_after=1.0,
                retryable=True,
            )
        request = prepared.request
        entry = self._scheduler.enqueue(
            prepared.prompt_tokens, prepared.max_tokens, priority=request.priority, cache_key=request.cache_key
        )
        send, receive = trio.open_memory_channel[GenerationEvent](4 * prepared.max_tokens + 4)
        gen = Generation(prepared, entry, send, receive)
        self._generations[entry] = gen
        if gen.reasoning_spent():  # a budget of 0 in a block the prompt opened
            self._scheduler.force(entry, self._engine.reasoning_close)
        self._poke()
        return gen

    def _cancel(self, gen: Generation) -> None:
        """Mark ``gen`` cancelled and free its queue place or slot (sync; Trio thread)."""
        gen.cancel(trio.current_time())
        self._counters.cancels += 1
        entry = gen.entry
        if not entry.done:
            self._leave(entry)
        self._poke()

    def waiting(self, gen: Generation) -> Waiting:
        """What ``gen``, before its first token, waits for: its place in the admission queue, or
        its prefill once admitted (Trio thread)."""
        ahead = self._scheduler.ahead(gen.entry)
        return Waiting(WaitReason.PREFILL) if ahead is None else Waiting(WaitReason.QUEUED, ahead=ahead)

    def _leave(self, entry: Entry) -> None:
        """Cancel ``entry`` in the scheduler: a queued one leaves the queue (and the runner's
        books), a live one's slot drains."""
        self._scheduler.cancel(entry)
        if entry.slot is None:
            del self._generations[entry]

    def _poke(self) -> None:
        """Wake the owner loop; the runner is no longer idle."""
        self._wake.set()
        if self._idle.is_set():
            self._idle = trio.Event()

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or decoding and every ended slot is released.

        Returns at once when the loop is not running. Handy for a graceful
        drain and for tests (a fact to wait on instead of a sleep).
        """
        while self._running and not self._idle.is_set():
            await self._idle.wait()

    # -- statistics ----------------------------------------------------------

    def statistics(self) -> RunnerStatistics:
        """A frozen snapshot of slots, queue, KV cells, steps and cancels."""
        s = self._scheduler.statistics()
        return RunnerStatistics(
            **attrs.asdict(self._counters, recurse=False),
            slots_total=s.slots_total,
            slots_busy=s.slots_busy,
            queue_depth=dict(s.queue_depth),
            kv_cells_used=max(0, self._kv_used - s.cached_cells),
            kv_cells_total=self._engine.n_ctx,
            preemptions=s.preemptions,
            prefix_cache=self._scheduler.prefix_cache,
            prefix_cache_cells=s.cached_cells,
            prefix_cache_lookup_tokens_total=s.prefix_lookup_tokens,
            prefix_cache_hit_tokens_total=s.prefix_hit_tokens,
            running=self._running,
        )

    # -- the owner loop ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the owner loop until cancelled; start it in the server's nursery.

        First empties every slot's KV cells (cells an earlier runner left
        there are no cache entry of this one). Calls ``task_status.started()``
        once requests can be submitted. A
        crash inside ``engine.decode`` fails the generations it affects
        (:class:`Failure` ``api_error``, retryable) and the loop goes on. If
        the loop itself ends, by cancellation (``unavailable``) or by a bug
        (``api_error``), every queued and active generation gets a
        :class:`Failure` first, so no consumer hangs; the exception then
        propagates.

        Raises:
            RuntimeError: ``run`` was already called on this runner.
        """
        if self._started:
            raise RuntimeError("Runner.run() may be called only once")
        self._started = True
        self._engine_thread.start()
        try:
            await self._own(task_status)
        finally:
            self._engine_thread.stop()

    async def _own(self, task_status: trio.TaskStatus[None]) -> None:
        """The loop of :meth:`run`, on the started engine thread."""
        # The scheduler knows of no cache entry yet: empty every slot the engine may still hold.
        everything = [(slot, 0) for slot in range(self._scheduler.n_slots)]
        kv, _ = await self._engine_thread.run(self._release_sync, everything)
        self._kv_used = kv or 0
        self._running = True
        try:
            task_status.started()
            while True:
                await self._release_ended()
                plan = self._scheduler.plan()
                if not plan.feeds:
                    self._after_submit()
                    if self._scheduler.releases_pending:
                        continue  # a request ended during the release hop
                    if self._scheduler.active():
                        raise RuntimeError("live requests but nothing to feed")
                    self._idle.set()
                    self._last_decode_end = None  # nothing to decode: the engine is not waiting for us
                    await self._wake.wait()
                    self._wake = trio.Event()
                    await self._gather_arrivals()
                    continue
                await self._step(plan)
                if not self._overlap:
                    self._after_submit()
                    with trio.move_on_after(self._counters.last_step_seconds):
                        await trio.testing.wait_all_tasks_blocked()
        except BaseException as exc:
            self._running = False
            self._closed = True
            if isinstance(exc, trio.Cancelled):
                kind, message = ErrorKind.UNAVAILABLE, "the server is shutting down"
            else:
                log.exception("the generation loop crashed")
                kind, message = ErrorKind.API_ERROR, f"internal error in the generation loop ({type(exc).__name__})"
            self._fail_everything(kind, message)
            self._idle.set()
            raise

    async def _gather_arrivals(self) -> None:
        """Woken from idle: let the requests being tokenized at this moment join the first batch.

        Requests that arrive together are tokenized one at a time; the first
        one enqueued wakes the loop. Nothing decodes yet, so nobody waits on
        the loop but those requests: it waits for as many tokenizations to end
        as were in flight when it woke (later arrivals do not extend the
        wait), then, for at most as long as the last step took (10 ms before
        the first), until the tasks they belong to are blocked, i.e. have
        enqueued. Then one plan admits them all and prefills them in one
        batch, where the loop would otherwise prefill the first request alone
        and the others one step later (issue 19).
        """
        if not self.prompter.tokenizing:
            return
        await self.prompter.wait_tokenized()
        with trio.move_on_after(self._counters.last_step_seconds or 0.01):
            await trio.testing.wait_all_tasks_blocked()

    async def _release_ended(self) -> None:
        """Release the slots of ended requests on the worker thread, then free them."""
        ended = self._scheduler.take_releases()
        if not ended:
            return
        slots = [(e.slot, len(e.kept)) for e in ended if e.slot is not None]
        kv, lost = await self._engine_thread.run(self._release_sync, slots, meanwhile=self._after_submit)
        now = trio.current_time()
        if kv is not None:
            self._kv_used = kv
        self._scheduler.released(ended, lost)
        for entry in ended:
            cancelled = self._generations.pop(entry).cancel_time
            if cancelled is not None:
                took = now - cancelled
                self._counters.freed(took)
                if self._on_cancel_freed is not None:
                    self._on_cancel_freed(took)

    def _release_sync(self, slots: Sequence[tuple[int, int]]) -> tuple[int | None, list[int]]:
        """Worker thread: ``engine.release`` each (slot, cells to keep); return KV cells in use
        and the slots whose release failed (their cells are not reused)."""
        lost = self._release_each(slots)
        return self._kv_cells_sync(), lost

    def _release_each(self, slots: Sequence[tuple[int, int]]) -> list[int]:
        """Worker thread: ``engine.release`` each (slot, cells to keep); the slots whose release failed."""
        lost = []
        for slot, keep in slots:
            try:
                self._engine.release(slot, keep)
            except Exception:
                # begin() with nothing kept empties the slot again before its next use.
                log.exception("engine.release(%d) failed", slot)
                lost.append(slot)
        return lost

    def _kv_cells_sync(self) -> int | None:
        try:
            return self._engine.kv_cells_used()
        except Exception:
            return None

    def _step_sync(
        self,
        clear: Sequence[int],
        begins: Sequence[tuple[int, Prepared, int, int | None, tuple[int, ...]]],
        feeds: Sequence[SlotFeed],
    ) -> _StepOutcome:
        """Worker thread: empty the slots the plan clears (evicted cache entries, preempted
        requests), begin the admitted slots (slot, request, cells kept, copied from, tokens to
        replay), then decode the batch once.

        Exceptions come back in the outcome instead of being raised, so the
        owner loop sees which call failed.
        """
        self._release_each([(slot, 0) for slot in clear])
        begin_errors: dict[int, Exception] = {}
        for slot, prepared, keep, source, replay in begins:
            try:
                self._engine.begin(slot, prepared.sampling, keep, source, prepared.constraint,
                                   prompt=prepared.prompt_tokens, logprobs=prepared.request.logprobs, replay=replay)
            except Exception as exc:
                begin_errors[slot] = exc
        if begin_errors:
            return _StepOutcome(begin_errors=begin_errors, kv_cells_used=self._kv_cells_sync())
        t0 = time.perf_counter()
        try:
            sampled = self._engine.decode(feeds)
        except Exception as exc:
            return _StepOutcome(
                error=exc,
                started=t0,
                seconds=time.perf_counter() - t0,
                kv_cells_used=self._kv_cells_sync(),
            )
        seconds = time.perf_counter() - t0
        return _StepOutcome(sampled=sampled, started=t0, seconds=seconds, kv_cells_used=self._kv_cells_sync())

    async def _step(self, plan: Plan) -> None:
        """One decode step for ``plan`` and the handling of what it gave."""
        begins = []
        for entry in plan.admitted:
            assert entry.slot is not None
            begins.append((entry.slot, self._generations[entry].prepared, entry.reuse, entry.source,
                           tuple(entry.sampled)))
            if not entry.preemptions:
                self._counters.prompt_tokens_total += len(entry.prompt)
        for entry in plan.preempted:
            log.info("request %d gave its %d cells up for an older one (preempted %d time(s)); it waits to go on",
                     entry.id, len(entry.refill or entry.prompt), entry.preemptions)
        self._step_done = trio.Event()
        try:
            # overlapping: the last step's tokens become events and reach their consumers while this one decodes
            outcome = await self._engine_thread.run(
                self._step_sync, plan.clear, begins, plan.feeds, meanwhile=self._after_submit if self._overlap else None
            )
        finally:
            self._step_done.set()
            self._step_done = None
        resumed, busy = time.perf_counter(), time.thread_time()
        if self._resumed is not None and resumed > self._resumed[0]:
            self._loop_busy = min(1.0, (busy - self._resumed[1]) / (resumed - self._resumed[0]))
        self._resumed = (resumed, busy)
        if outcome.kv_cells_used is not None:
            self._kv_used = outcome.kv_cells_used
        if outcome.started is not None:
            if self._last_decode_end is not None:
                self._counters.engine_idle_seconds_total += outcome.started - self._last_decode_end
            self._last_decode_end = outcome.started + outcome.seconds
            self._loop_lag = max(0.0, resumed - self._last_decode_end)
            self._counters.loop_lag_seconds_total += self._loop_lag

        if outcome.begin_errors:
            admitted = {e.slot: e for e in plan.admitted}
            for slot, exc in outcome.begin_errors.items():
                entry = admitted[slot]
                log.error("engine.begin(%d) failed: %r", slot, exc)
                self._fail(entry, ErrorKind.API_ERROR, f"the engine could not start: {exc}", retryable=True)
            return

        if outcome.error is not None:
            self._counters.failed(outcome.seconds)
            self._on_decode_error(plan, outcome.error)
            return

        assert outcome.sampled is not None
        self._counters.decoded(outcome.seconds, plan)
        self._scheduler.commit(plan)
        for sampled in outcome.sampled:
            entry = plan.owner(sampled.slot)
            gen = self._generations[entry]
            if gen.cancelled:
                gen.tokens_after_cancel += 1
                self._counters.tokens_after_cancel_total += 1
                continue
            if not entry.live:
                continue
            self._scheduler.on_sampled(sampled.slot, sampled.token)
            self._counters.generated_tokens_total += 1
            if gen.consumed:  # it sees this step, events or not
                self._ready[gen] = None
            if gen.text_decides:
                self._on_token(gen, sampled)
                continue
            # Only the sample decides what the next step feeds it: its end (if any) is taken now,
            # its text once the next step is handed to the engine (_after_submit).
            if sampled.eog or entry.budget_left <= 0:
                self._scheduler.finish(entry)
            self._late.append((gen, sampled))

    def _on_decode_error(self, plan: Plan, error: Exception) -> None:
        """Fail the generations a failed decode affects; the rest retry next step."""
        fed = {f.slot for f in plan.feeds}
        if isinstance(error, EngineError):
            affected = set(error.slots) & fed or fed
            if isinstance(error, KVCacheFull):
                kind = ErrorKind.OVERLOADED
                message = f"no room left in the KV cache: {error}"
            else:
                kind = ErrorKind.API_ERROR
                message = f"the engine failed: {error}"
            log.warning("decode failed for slots %s: %s", sorted(affected), error)
            for slot in sorted(affected):
                self._fail(plan.owner(slot), kind, message, retryable=True)
            return
        # Not an EngineError: a bug or a crash (C12). The engine's state for
        # every active slot is unknown, so all of them fail and are released.
        log.error("engine.decode crashed", exc_info=error)
        message = f"internal error while generating ({type(error).__name__})"
        self._scheduler.forget_cache()
        for entry in self._scheduler.active():
            self._fail(entry, ErrorKind.API_ERROR, message, retryable=True)

    # -- turning tokens into events ----------------------------------------

    def _on_token(self, gen: Generation, sampled: Sampled) -> None:
        """Run one sampled token through its generation (:meth:`Generation.feed`); emit what it
        releases; end it, or force the end of its thinking block when its budget is spent."""
        fed = gen.feed(sampled)
        for event in fed.events:
            gen.emit(event)
        if fed.end is not None:
            self._end(gen, fed.end)
        elif fed.close_reasoning:
            self._scheduler.force(gen.entry, self._engine.reasoning_close)

    def _fail(self, entry: Entry, kind: ErrorKind, message: str, *, retryable: bool) -> None:
        if entry.done:
            return
        gen = self._generations[entry]
        self._end(gen, Failure(kind, message, gen.usage, retryable))

    def _end(self, gen: Generation, event: Finish | Failure) -> None:
        """Emit the terminal event, close the channel and let the slot drain."""
        entry = gen.entry
        if entry.live:
            # A failed request's cells are not reused: what the engine holds for it is unknown.
            self._scheduler.finish(entry, keep_cells=isinstance(event, Finish))
        elif entry.state is SlotState.QUEUED:
            self._leave(entry)  # only on shutdown
        if gen.consumed:
            self._ready[gen] = None
        gen.end(event)

    def _after_submit(self) -> None:
        """The work that waits for the next engine call to be submitted: the tokens whose text
        cannot change that call (:attr:`Generation.text_decides`) into events, then the
        events to their consumers."""
        for gen, sampled in self._late:  # (if one raises, the loop ends: _fail_everything reads the list)
            self._on_token(gen, sampled)
        self._late.clear()
        self._deliver()

    def _deliver(self) -> None:
        """Hand each generation with a consumer its events since the last delivery (one pass)."""
        ready, self._ready = self._ready, {}
        for gen in ready:
            gen.deliver()

    def _fail_everything(self, kind: ErrorKind, message: str) -> None:
        """The loop is ending: every queued or active generation, and every one whose end was
        taken from its last sample but not yet turned into events, gets a Failure."""
        ending = [gen for gen, _ in self._late]
        self._late.clear()
        ending += [self._generations[entry] for entry in (*self._scheduler.active(), *self._scheduler.queued())]
        for gen in ending:
            if gen.outcome is None and not gen.cancelled:
                failure = Failure(kind, message, gen.usage, retryable=True)
                try:
                    self._end(gen, failure)
                except Exception:  # pragma: no cover - keep failing the others
                    gen.end(failure)
        self._deliver()

