"""Which models are loaded, and which to load or unload next (sans-I/O, synchronous).

The model pool (``live/models.py``) owns one :class:`Router` and asks it what to do; the router
never loads anything, never awaits and never reads a clock: the pool passes ``now`` and the free
memory in, and performs the decisions that come out. Ollama's scheduler (``server/sched.go``: a
reference count and an expiry timer per loaded runner, which one to unload) and llama-server's
router (``tools/server/server-models.cpp``: ``--models-max``, least recently used first) are the
models.

Rules of this file (as ``core/scheduler.py``'s):

* A model's :class:`ModelStatus` changes only by :data:`TRANSITIONS`::

      UNLOADED --load--> LOADING --loaded--> LOADED --unload--> UNLOADING --unloaded--> UNLOADED
         |                  \\--failed--> FAILED --load--> LOADING
         \\--failed (it could not even be sized)--^

* A model is *held* while a request holds a lease on it (:meth:`Router.hold`): from the moment a
  request names it until its generation ends. A held model is never unloaded.
* To load a model (:meth:`Router.plan_load`), at most ``max_loaded`` models may be loaded or
  loading, and its memory must fit what is free: the least recently used idle (loaded and not
  held) models are unloaded first, one at a time, until both hold; when no idle model is left
  and they still do not, the load waits until one is released, unless it would not fit even with
  every other model unloaded: then it fails at once.
* A loaded model that nobody holds is unloaded ``keep_alive`` seconds after it was last released
  (:meth:`Router.expired`); a ``keep_alive`` of 0 keeps it until its place is needed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType

import attrs

__all__ = ["TRANSITIONS", "Evict", "IllegalModelMove", "Load", "ModelMove", "ModelStatus", "NoRoom",
           "Resident", "Router", "Wait"]


class ModelStatus(enum.StrEnum):
    """Where a model of the catalog is (llama-server's router spells the same values)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


class ModelMove(enum.Enum):
    """What changes a model's status."""

    LOAD = "load"
    LOADED = "loaded"
    FAILED = "failed"
    UNLOAD = "unload"
    UNLOADED = "unloaded"


_U, _L, _D, _X, _F = (ModelStatus.UNLOADED, ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.UNLOADING,
                      ModelStatus.FAILED)

TRANSITIONS: Mapping[tuple[ModelStatus, ModelMove], ModelStatus] = MappingProxyType({
    (_U, ModelMove.LOAD): _L,
    (_F, ModelMove.LOAD): _L,  # tried again on the next request
    (_L, ModelMove.LOADED): _D,
    (_L, ModelMove.FAILED): _F,
    (_U, ModelMove.FAILED): _F,  # its load never began: its file or its sizing failed first
    (_F, ModelMove.FAILED): _F,
    (_D, ModelMove.UNLOAD): _X,
    (_X, ModelMove.UNLOADED): _U,
})
"""Every legal ``(status, move) -> new status``."""


class IllegalModelMove(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow (a bug in the caller)."""

    def __init__(self, resident: Resident, move: ModelMove) -> None:
        super().__init__(f"model {resident.name!r}: cannot {move.value} when {resident.status.value}")


@attrs.define(eq=False)
class Resident:
    """One model of the catalog as the router sees it (read-only for callers).

    Attributes:
        name: its name in the catalog.
        status: see :class:`ModelStatus`.
        holds: leases held on it (requests that named it and have not ended).
        released_at: when its last lease was released, or it loaded (the pool's clock); its
            least-recently-used age and its expiry count from here.
        keep_alive: seconds it stays loaded with nobody holding it (0: until its place is needed).
        memory: bytes it takes when loaded (the estimate its load was sized with; 0 before).
    """

    name: str
    keep_alive: float = 0.0
    status: ModelStatus = ModelStatus.UNLOADED
    holds: int = 0
    released_at: float = -math.inf
    memory: int = 0

    @property
    def idle(self) -> bool:
        """Loaded, and nobody holds it: it may be unloaded."""
        return self.status is ModelStatus.LOADED and self.holds == 0

    @property
    def occupies(self) -> bool:
        """It counts against ``max_loaded``: loading, loaded or unloading."""
        return self.status in (ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.UNLOADING)

    def move(self, move: ModelMove) -> None:
        new = TRANSITIONS.get((self.status, move))
        if new is None:
            raise IllegalModelMove(self, move)
        self.status = new


@attrs.frozen
class Load:
    """Load it now."""


@attrs.frozen
class Evict:
    """Unload ``name`` first (the least recently used idle model), then ask again."""

    name: str


@attrs.frozen
class NoRoom:
    """It cannot fit even with every other model unloaded: its load fails.

    Attributes:
        need, free: bytes its load takes, and bytes free now plus what the other models hold.
    """

    need: int
    free: int


@attrs.frozen
class Wait:
    """Nothing can make room now: ask again once a model is released or unloaded.

    Attributes:
        reason: why, for a log line (``max_loaded`` reached, or the memory).
    """

    reason: str


@attrs.define(eq=False)
class Router:
    """The loaded models and the rules of :mod:`ringserve.core.router`.

    Args:
        max_loaded: most models loading, loaded or unloading at once (>= 1).
    """

    max_loaded: int = attrs.field(validator=attrs.validators.ge(1))
    _residents: dict[str, Resident] = attrs.field(init=False, factory=dict)

    def add(self, name: str, keep_alive: float) -> Resident:
        """Know the model ``name`` (unloaded), or return it if known (its ``keep_alive`` updated)."""
        resident = self._residents.get(name)
        if resident is None:
            resident = self._residents[name] = Resident(name, keep_alive)
        resident.keep_alive = keep_alive
        return resident

    def __getitem__(self, name: str) -> Resident:
        return self._residents[name]

    def residents(self) -> tuple[Resident, ...]:
        """Every known model, in the order they were added."""
        return tuple(self._residents.values())

    # -- leases ---------------------------------------------------------------------------------

    def hold(self, name: str) -> Resident:
        """A request holds ``name`` from now on: it is not unloaded until released."""
        resident = self._residents[name]
        resident.holds += 1
        return resident

    def release(self, name: str, now: float) -> None:
        """A request's hold on ``name`` ended at ``now``."""
        resident = self._residents[name]
        if resident.holds <= 0:
            raise RuntimeError(f"model {name!r} released more often than held")
        resident.holds -= 1
        resident.released_at = now

    # -- loading and unloading ------------------------------------------------------------------

    def plan_load(self, name: str, need: int, free: int | None) -> Load | Evict | Wait | NoRoom:
        """What loading ``name`` takes now.

        Args:
            name: the model to load (unloaded or failed).
            need: bytes its load takes (its estimate; 0: not known).
            free: bytes free where it loads (None: not known: only ``max_loaded`` counts), less
                here what the models loading now will take (:meth:`loading`: not allocated yet).

        Returns:
            :class:`Load` when at most ``max_loaded - 1`` others occupy a place and ``need``
            fits ``free``; :class:`NoRoom` when ``need`` exceeds ``free`` and all the memory the
            others hold (it would wait forever); else :class:`Evict` of the least recently used
            idle model (one at a time, so the caller measures the memory again after each); else
            :class:`Wait`.
        """
        others = [r for r in self._residents.values() if r.name != name and r.occupies]
        if free is not None:
            free -= sum(r.memory for r in others if r.status is ModelStatus.LOADING)
        full = len(others) >= self.max_loaded
        short = free is not None and need > free
        if not full and not short:
            return Load()
        if free is not None and need > free + sum(r.memory for r in others):
            return NoRoom(need, free + sum(r.memory for r in others))
        idle = [r for r in others if r.idle]
        if idle:
            return Evict(min(idle, key=lambda r: r.released_at).name)
        if full:
            loaded = "1 model is" if len(others) == 1 else f"{len(others)} models are"
            return Wait(f"{loaded} loaded (max_loaded = {self.max_loaded}), each in use")
        return Wait(f"its {need} bytes do not fit the {free} free, and every loaded model is in use")

    def loading(self, name: str, memory: int) -> None:
        """``name`` starts loading, to take ``memory`` bytes (counted against the free memory of
        the loads planned before it ends)."""
        resident = self._residents[name]
        resident.move(ModelMove.LOAD)
        resident.memory = memory

    def failed(self, name: str) -> None:
        """``name`` could not be loaded (or sized): it holds no memory."""
        resident = self._residents[name]
        resident.move(ModelMove.FAILED)
        resident.memory = 0

    def loaded(self, name: str, now: float, memory: int) -> None:
        """``name`` finished loading at ``now``, taking ``memory`` bytes (its LRU age starts)."""
        resident = self._residents[name]
        resident.move(ModelMove.LOADED)
        resident.released_at = now
        resident.memory = memory

    def unloaded(self, name: str) -> None:
        """``name``'s memory is free again."""
        resident = self._residents[name]
        resident.move(ModelMove.UNLOADED)
        resident.memory = 0

    def expired(self, now: float) -> tuple[str, ...]:
        """The idle models whose ``keep_alive`` has run out at ``now``."""
        return tuple(r.name for r in self._residents.values()
                     if r.idle and r.keep_alive > 0 and now >= r.released_at + r.keep_alive)

    def next_expiry(self) -> float:
        """When the next idle model's ``keep_alive`` runs out (``inf`` when none will)."""
        idle = [r for r in self._residents.values() if r.idle and r.keep_alive > 0]
        return min((r.released_at + r.keep_alive for r in idle), default=math.inf)
