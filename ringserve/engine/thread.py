"""One thread at a time for every blocking engine call of a runner.

Why not ``trio.to_thread.run_sync``: it hands each call to whichever cached
worker thread is idle, so a decode step can land on the thread that just
tokenized a prompt. llama.cpp's CPU backend as llama-cpp-python builds it uses
OpenMP (``libggml-cpu.so`` links ``libgomp``): each thread that runs a graph
gets its own OpenMP team, and every barrier between graph nodes is an
``#pragma omp barrier`` (``ggml_barrier`` in ``ggml-cpu.c``). libgomp spins
in a barrier for long only while the threads it manages, over all teams,
fit the CPUs (``do_spin`` in ``libgomp/config/linux/wait.h`` switches to a
short throttled count beyond that), then sleeps in the kernel; a second team,
alive for as long as its cached worker idles, is enough to put sleeps and
wake-ups into the hundreds of barriers of every decode. Measured on 2 cores, 8
streams (issue 19): decode steps 1.2-1.8x slower than the same calls made from
one thread. With one thread there is one team, as in llama.cpp's own server
(one loop thread).

The team's threads spin while they wait for the next decode
(``ringserve.engine._native`` sets libgomp's spin count for that), so an
``EngineThread`` with ``idle_seconds`` ends its thread after that long
without a call: libgomp frees a thread's team when the thread exits, and the
spinning stops. The next call starts a new thread (and team). There is never
more than one.

The thread runs the calls one at a time in submission order, so it also
serializes the engine like the ``CapacityLimiter(1)`` it replaces.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")

_STOP = None
"""The queue entry that ends the thread."""

HANDOVER_SECONDS = 0.001
"""The longest :meth:`EngineThread.run` blocks the Trio thread for the engine thread to take a call
before it runs its ``meanwhile`` work (the thread is woken and needs the GIL to start the call)."""


class EngineThread:
    """A daemon thread that runs submitted calls in order; :meth:`run` awaits one from Trio.

    Args:
        name: the thread's name (``threading.Thread.name``; shown by py-spy).
        idle_seconds: after this long without a call the thread ends, and
            the next call starts a new one; None keeps it until :meth:`stop`.

    The thread starts at :meth:`start` and ends after the calls queued
    before :meth:`stop`. A call in progress is never abandoned: as with
    ``trio.to_thread.run_sync(..., abandon_on_cancel=False)``, a
    cancellation takes effect when it returns.
    """

    def __init__(self, name: str, *, idle_seconds: float | None = None) -> None:
        self.name = name
        self._idle = idle_seconds
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a retiring thread against a call that arrives meanwhile
        self._thread: threading.Thread | None = None
        self._started = False
        self._stopped = False

    @property
    def ident(self) -> int | None:
        """The running thread's ``threading.get_ident()``; None before start and while retired."""
        thread = self._thread
        return None if thread is None else thread.ident

    def start(self) -> None:
        """Start the thread.

        Raises:
            RuntimeError: it was started before.
        """
        if self._started:
            raise RuntimeError(f"{self.name} was started before")
        self._started = True
        with self._lock:
            self._spawn()

    def stop(self) -> None:
        """Let the thread end once the calls queued so far are done; returns at once. Idempotent."""
        self._stopped = True
        self._jobs.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        """Wait (blocking) until the running thread has ended, for at most ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _spawn(self) -> None:
        """Start a thread (the caller holds the lock, and no thread runs)."""
        self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():  # retire; a call from now on starts the next thread
                        self._thread = None
                        return
                continue
            if job is _STOP:
                return
            job()

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.put(job)
            if self._thread is None:
                self._spawn()

    async def run(
        self, fn: Callable[..., T], *args: object, meanwhile: Callable[[], None] | None = None
    ) -> T:
        """``fn(*args)`` on the thread, after the calls queued before it; its result or exception.

        Checks for cancellation first (a cancelled caller submits nothing),
        then waits for the call without abandoning it. ``meanwhile()``, when
        given, runs on the Trio thread once the call is submitted, before the
        wait: work that overlaps the call (its result is delivered only to a
        waiting task, and nothing yields between the submission and the wait).
        It starts once the thread has taken the call, or after
        :data:`HANDOVER_SECONDS`: the Trio thread blocks meanwhile, without
        the GIL, which the engine thread needs to start the call (and would
        otherwise wait for up to the switch interval while ``meanwhile`` runs).

        Raises:
            RuntimeError: the thread is not running (not started, or stopped).
            trio.Cancelled: the caller was cancelled before the call was submitted.
            Exception: whatever ``fn`` raised (or ``meanwhile``, after the call returned).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._started or self._stopped:
            raise RuntimeError(f"{self.name} is not running")
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        taken = threading.Event()

        def job() -> None:
            taken.set()
            result = outcome.capture(fn, *args)
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._submit(job)
        failed = None
        if meanwhile is not None:
            taken.wait(HANDOVER_SECONDS)
            failed = outcome.capture(meanwhile)
        result: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        if failed is not None:
            failed.unwrap()
        return result
