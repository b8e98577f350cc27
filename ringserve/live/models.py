"""The models this server serves: each loaded one an engine with its own runner thread, slots, KV
pool and prefix cache, under the one hub (issue 41; docs/models.md).

:class:`ModelPool` is the Trio shell around ``core/router.py``'s :class:`~ringserve.core.router.Router`,
which decides; the pool performs. A request names a model (``Catalog.resolve``: a name, an alias,
a pattern, else the default model; none: a 404 that lists the names) and takes a :class:`Lease` on
it (:meth:`ModelPool.lease`): from then until its generation ends the model is not unloaded. The
lease's :attr:`~Lease.prompter` prepares the request at once, from the model's front (its
vocabulary and sizing: ``engine/loader.py``), whether the model is loaded or not; the request's
stream then waits for :meth:`Lease.runner` with keepalives while the model loads. A model loads on
a worker thread (so the other models' streams keep their pace), once the router says it fits
(``max_loaded``, the free memory: the least recently used idle model is unloaded first, or the load
waits for one to become idle). An idle model is unloaded after its ``keep_alive``. A model that
fails to load gives every request waiting for it the error, and is tried again on the next.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from typing import assert_never

import attrs
import trio

from ringserve.config import ModelSettings, decode_threads, overlap_steps
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.router import Evict, Load, ModelMove, ModelStatus, NoRoom, Resident, Router, Wait
from ringserve.core.sizing import format_bytes
from ringserve.core.view import Waiting, WaitReason
from ringserve.engine.catalog import Catalog, CatalogEntry
from ringserve.engine.loader import Front, ModelLoader
from ringserve.engine.modelfile import ModelFileError
from ringserve.engine.prompter import Prompter
from ringserve.engine.protocol import Engine, EngineError
from ringserve.engine.runner import ModelsStatistics, ModelStatistics, Runner

__all__ = ["Lease", "ModelPool", "ModelState"]

log = logging.getLogger("ringserve.models")

#: A model's ``keep_alive`` when its settings give none: loaded on demand, unloaded after 5 minutes
#: idle (Ollama's default); loaded at start, kept.
DEFAULT_KEEP_ALIVE = 300.0


def keep_alive(settings: ModelSettings) -> float:
    """The seconds ``settings``' model stays loaded idle: its ``keep_alive``, else
    :data:`DEFAULT_KEEP_ALIVE`, or 0 (kept) for a model loaded at start."""
    model = settings.model
    if model.keep_alive is not None:
        return model.keep_alive
    return 0.0 if model.load_on_startup else DEFAULT_KEEP_ALIVE


class UnloadReason(enum.Enum):
    """Why a model was unloaded (its log line says the value)."""

    ASKED = "asked: POST /models/unload"
    EVICTED = "the least recently used idle model, to make room for another"
    EXPIRED = "idle for its keep_alive"


@attrs.define(eq=False)
class ModelState:
    """One model of the catalog at run time (the pool's; read-only for others).

    Attributes:
        entry: its catalog entry.
        resident: what the router knows of it (status, holds, memory).
        front: its front, once made (until it is unloaded).
        prompter: what prepares its requests, from its front.
        runner: its runner while it is loaded.
        engine: its engine while it is loaded.
        error: why its last load failed (the error its waiting requests got).
        progress: the share of its weights loaded (0..1) during a load.
    """

    entry: CatalogEntry
    resident: Resident
    front: Front | None = None
    prompter: Prompter | None = None
    runner: Runner | None = None
    engine: Engine | None = None
    error: RingserveError | None = None
    progress: float = 0.0
    _fronting: trio.Event | None = None  # set when a front being made is done (made or failed)
    _front_error: RingserveError | None = None
    _loading: bool = False  # a load task runs (waiting for room, or loading)
    _scope: trio.CancelScope | None = None  # the runner task's
    _stopped: trio.Event | None = None  # set when the runner task has ended

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def status(self) -> ModelStatus:
        return self.resident.status

    def waiting(self) -> Waiting:
        """What a request for it waits for before its runner exists: the load, this far."""
        return Waiting(WaitReason.MODEL_LOADING, progress=self.progress)


@attrs.define(eq=False)
class Lease:
    """A request's hold on a model: the model is not unloaded until it is released.

    Attributes:
        model: the model.
        prompter: what prepares the request (the model's, from its front).
    """

    pool: ModelPool
    model: ModelState
    prompter: Prompter
    released: bool = False

    @property
    def name(self) -> str:
        """The model's name (what messages report as their ``model``)."""
        return self.model.name

    async def runner(self) -> Runner:
        """The model's runner, once it is loaded (at once when it is).

        Raises:
            RingserveError: ``UNAVAILABLE``: its load failed (the message says why).
        """
        return await self.pool.runner(self.model)

    def release(self) -> None:
        """The request is done with the model (idempotent)."""
        if not self.released:
            self.released = True
            self.pool.release(self.model)


class ModelPool:
    """Loads, routes to and unloads the models of a catalog (module docstring).

    Args:
        catalog: the models.
        loader: makes a model's front and engine (on worker threads).
        nursery: where the runners, the loads and the expiry watch run (the server's).
        max_loaded: ``[router] max_loaded``.
        free_memory: bytes free where models load, now (None: not known; then only
            ``max_loaded`` limits the loaded models).
        on_cancel_freed: each runner's hook for the seconds from a cancel to its KV cells' removal.
    """

    def __init__(self, catalog: Catalog, loader: ModelLoader, nursery: trio.Nursery, *, max_loaded: int,
                 free_memory: Callable[[], int | None] = lambda: None,
                 on_cancel_freed: Callable[[float], None] | None = None) -> None:
        self.catalog = catalog
        self._loader = loader
        self._nursery = nursery
        self._free_memory = free_memory
        self._on_cancel_freed = on_cancel_freed
        self._router = Router(max_loaded)
        self._models: dict[str, ModelState] = {}
        for entry in catalog.entries:
            resident = self._router.add(entry.name, keep_alive(entry.settings))
            self._models[entry.name] = ModelState(entry, resident)
        self._changed = trio.Event()  # set (and replaced) when a model is released, loaded or unloaded

    # -- looking models up ---------------------------------------------------------------------

    def models(self) -> tuple[ModelState, ...]:
        """Every model of the catalog, in its order."""
        return tuple(self._models.values())

    def find(self, requested: str, *, fallback: bool = True) -> ModelState:
        """The model ``requested`` names (``Catalog.resolve``; without ``fallback``,
        ``Catalog.find``: a name, an alias or a pattern, never the default model).

        Raises:
            RingserveError: ``NOT_FOUND``, listing the names served.
        """
        entry = self.catalog.resolve(requested) if fallback else self.catalog.find(requested)
        if entry is None:
            names = ", ".join(sorted(self._models))
            said = f"no model {requested[:100]!r} here" if requested else "the request names no model"
            raise RingserveError(ErrorKind.NOT_FOUND, f"{said}; the models are: {names}", param="model")
        return self._models[entry.name]

    # -- leases --------------------------------------------------------------------------------

    async def lease(self, requested: str, *, load: bool = True) -> Lease:
        """Hold the model ``requested`` names, with its front made (and, with ``load``, its load
        started when it is not loaded: a count or a render needs the front alone).

        Raises:
            RingserveError: ``NOT_FOUND`` (no such model, listing the names); ``UNAVAILABLE``
                (its front cannot be made: a missing or broken file, a template that does not
                load, a context that cannot fit; the message says which).
        """
        model = self.find(requested)
        self._router.hold(model.name)
        try:
            while model.status is ModelStatus.UNLOADING:  # its front goes with it: made again after
                await self._changed.wait()
            await self._front(model)
        except BaseException:
            self.release(model)
            raise
        assert model.prompter is not None
        if load and model.status in (ModelStatus.UNLOADED, ModelStatus.FAILED) and not model._loading:
            self._start_load(model)
        return Lease(self, model, model.prompter)

    def release(self, model: ModelState) -> None:
        """A lease on ``model`` ended: its idle time starts (``Lease.release`` calls it)."""
        self._router.release(model.name, trio.current_time())
        self._notify()

    async def runner(self, model: ModelState) -> Runner:
        """``model``'s runner once it is loaded (``Lease.runner``).

        Raises:
            RingserveError: ``UNAVAILABLE``: its load failed.
        """
        while model.runner is None:
            if model.status is ModelStatus.FAILED and not model._loading:
                assert model.error is not None
                raise model.error
            if model.status is ModelStatus.UNLOADED and not model._loading:
                self._start_load(model)  # leased while it was being unloaded
            await self._changed.wait()
        return model.runner

    # -- loading -------------------------------------------------------------------------------

    async def _front(self, model: ModelState) -> None:
        """Make ``model``'s front (its prompter) unless it has one; requests that ask at once share
        one making.

        Raises:
            RingserveError: ``UNAVAILABLE``: it cannot be made (the message says why).
        """
        while model.prompter is None:
            if model._fronting is not None:
                await model._fronting.wait()
                if model._front_error is not None:
                    raise model._front_error
                continue
            done = model._fronting = trio.Event()
            try:
                model.entry.model_file()  # an hf model not pulled yet: the pull to run
                front = await trio.to_thread.run_sync(self._loader.front, model.entry.settings)
            except (ModelFileError, EngineError, ValueError) as exc:
                model._front_error = self._load_error(model, exc)
                self._failed(model, model._front_error)
                raise model._front_error from None
            else:
                model._front_error = None
                model.front = front
                model.prompter = Prompter(front.tokenizer, front.context_window, front.sampling_defaults)
            finally:
                model._fronting = None
                done.set()

    def _load_error(self, model: ModelState, exc: BaseException) -> RingserveError:
        log.warning("model %s cannot be loaded: %s", model.name, exc)
        return RingserveError(ErrorKind.UNAVAILABLE, f"the model {model.name!r} cannot be loaded: {exc}")

    def _start_load(self, model: ModelState) -> None:
        model._loading = True
        self._nursery.start_soon(self._load, model)

    async def _load(self, model: ModelState) -> None:
        """Load ``model`` once the router lets it (unloading idle models for it, or waiting), and
        start its runner; a failure is kept for its waiting requests (``runner``)."""
        try:
            await self._front(model)
            assert model.front is not None
            front = model.front
            while True:
                free = await trio.to_thread.run_sync(self._free_memory)  # (driver and /proc reads)
                decision = self._router.plan_load(model.name, front.memory, free)
                match decision:
                    case Load():
                        break
                    case Evict(name=name):
                        await self.unload(name, UnloadReason.EVICTED)
                    case Wait(reason=reason):
                        log.info("model %s waits to load: %s", model.name, reason)
                        await self._changed.wait()
                    case NoRoom(need=need, free=free):
                        raise EngineError(f"it needs {format_bytes(need)}, and {format_bytes(free)} are free"
                                          " with every other model unloaded (lower ctx_size, or [router]"
                                          " memory_margin)")
                    case _:
                        assert_never(decision)
            self._router.loading(model.name, front.memory)
            model.progress = 0.0
            self._notify()
            log.info("loading model %s", model.name)
            settings = model.entry.settings
            progress = self._progress(model)
            engine = await trio.to_thread.run_sync(self._loader.engine, settings, front, progress)
            runner = self._runner(model, engine)
            await self._nursery.start(self._run, model, runner)
            model.engine, model.runner, model.error = engine, runner, None
            self._router.loaded(model.name, trio.current_time(), front.memory)
            log.info("loaded %s", self.summary(model))
        except RingserveError as exc:
            self._failed(model, exc)
        except (ModelFileError, EngineError, ValueError) as exc:
            self._failed(model, self._load_error(model, exc))
        finally:
            model._loading = False
            self._notify()

    def cannot_load(self, name: str, exc: ModelFileError) -> None:
        """The model ``name``'s file cannot be loaded (found before any request for it: a file gone,
        a model not pulled): it is ``failed``, saying why, in ``GET /v1/models`` and ``ringserve
        ls``; a request for it tries again."""
        model = self._models[name]
        self._failed(model, self._load_error(model, exc))

    def _failed(self, model: ModelState, error: RingserveError) -> None:
        model.error = error
        self._router.failed(model.name)
        model.front = model.prompter = None

    @staticmethod
    def _progress(model: ModelState) -> Callable[[float], None]:
        def progress(share: float) -> None:  # (on the loading thread: one float store)
            model.progress = share

        return progress

    def _runner(self, model: ModelState, engine: Engine) -> Runner:
        settings = model.entry.settings
        cores = os.cpu_count() or 1
        threads = decode_threads(settings.model.n_threads, cores)
        gpu = engine.offload.layers > 0
        overlap = overlap_steps(settings.engine.overlap, threads=threads, cores=cores, gpu=gpu)
        return Runner(engine, settings.engine, on_cancel_freed=self._on_cancel_freed, overlap=overlap,
                      prompter=model.prompter)

    async def _run(self, model: ModelState, runner: Runner, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """``runner``'s owner loop, until the model is unloaded (its scope cancelled)."""
        model._stopped = trio.Event()
        try:
            with trio.CancelScope() as model._scope:
                await runner.run(task_status=task_status)
        finally:
            model._stopped.set()

    # -- unloading -----------------------------------------------------------------------------

    async def unload(self, name: str, why: UnloadReason = UnloadReason.ASKED) -> bool:
        """Unload the model ``name`` when it is loaded and nobody holds it: its runner stops, its
        engine is closed (its memory freed) on a worker thread; the log line says ``why``.
        Whether it was unloaded."""
        model = self._models[name]
        if not model.resident.idle:
            return False
        model.resident.move(ModelMove.UNLOAD)
        assert model._scope is not None and model._stopped is not None
        model._scope.cancel()
        await model._stopped.wait()
        engine, model.engine, model.runner = model.engine, None, None
        front, model.front, model.prompter = model.front, None, None
        if engine is not None:
            await trio.to_thread.run_sync(engine.close)
        if front is not None and front.tokenizer is not engine:
            await trio.to_thread.run_sync(front.tokenizer.close)
        self._router.unloaded(name)
        log.info("unloaded model %s (%s)", name, why.value)
        self._notify()
        return True

    async def expire(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Unload each idle model once its ``keep_alive`` runs out, until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_at(self._router.next_expiry()):
                await self._changed.wait()
            for name in self._router.expired(trio.current_time()):
                await self.unload(name, UnloadReason.EXPIRED)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @staticmethod
    def summary(model: ModelState) -> str:
        """What a loaded model runs with, for the log: ``model NAME, chat format ..., N slots sharing
        ... tokens of KV cache (sized: ...), context ... tokens per request, decode threads T of C
        cores, overlapped steps on|off, GPU offload ...`` (the sizing where it was sized:
        ``Sizing.describe``)."""
        assert model.front is not None and model.engine is not None and model.runner is not None
        engine, settings = model.engine, model.entry.settings
        cores = os.cpu_count() or 1
        sized = "" if model.front.sizing is None else f" (sized: {model.front.sizing.describe()})"
        return (f"model {model.name}, chat format {model.front.tokenizer.chat_format.name},"
                f" {settings.engine.slots} slots sharing {engine.n_ctx} tokens of KV cache{sized},"
                f" context {model.runner.context_window} tokens per request,"
                f" decode threads {decode_threads(settings.model.n_threads, cores)} of {cores} cores,"
                f" overlapped steps {'on' if model.runner.overlap else 'off'},"
                f" GPU offload {engine.offload.describe()}")

    def statistics(self) -> ModelsStatistics:
        """Each model's status and, while it is loaded, its runner's snapshot (for ``metrics.py``)."""
        return ModelsStatistics(tuple(
            ModelStatistics(m.name, m.status.value, None if m.runner is None else m.runner.statistics())
            for m in self._models.values()))

    # -- by hand -------------------------------------------------------------------------------

    async def load(self, requested: str) -> ModelState:
        """Load the model ``requested`` names and wait until it is loaded (``POST /models/load``,
        ``load_on_startup``).

        Raises:
            RingserveError: ``NOT_FOUND``; ``UNAVAILABLE`` when it cannot be loaded.
        """
        lease = await self.lease(requested)
        try:
            await lease.runner()
        finally:
            lease.release()
        return lease.model
