"""How a model of the catalog is made ready: its front first (what its requests are prepared with),
then its engine (issue 41).

A :class:`ModelLoader`'s :meth:`~ModelLoader.front` is quick (llama.cpp loads the vocabulary and
the chat template alone, and the context is sized from the GGUF's metadata and the free memory):
with it a request for a model that is not loaded yet is tokenized and checked against its context
window, so a prompt that does not fit is still a 400 before any byte of the stream (case C4),
and the stream then waits for the engine with keepalives. :meth:`~ModelLoader.engine` loads the
weights and makes the context, the minutes of a large model on a GPU. Both block, and the model
pool (``live/models.py``) calls them on worker threads. ``engine/llama.py``'s ``LlamaLoader``
loads GGUF files; :class:`FactoryLoader` makes the whole engine in its front, from a function
(the fake engine of the tests, a test's own engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs

from ringserve.config import EngineConfig, ModelSettings
from ringserve.core.events import SamplingParams
from ringserve.core.sizing import Sizing
from ringserve.engine.protocol import Engine, Tokenizer

__all__ = ["FactoryLoader", "Front", "ModelLoader"]


@attrs.frozen
class Front:
    """A model made ready to prepare requests, before (or without) its weights.

    Attributes:
        tokenizer: its vocabulary and chat template.
        n_ctx: the KV pool its engine will have (tokens).
        context_window: the most tokens one request may hold (tokens; at most ``n_ctx``).
        sampling_defaults: its sampling layers between a request's and llama-server's defaults
            (the config's ``[model.sampling]``, then the GGUF's ``general.sampling.*``).
        memory: the bytes its engine will take where it loads (the estimate it was sized with;
            0: not known).
        sizing: what was chosen for it and why, for ``GET /v1/models`` and the ready line
            (None where nothing was sized).
        engine: the engine itself, when the front made it whole (:class:`FactoryLoader`).
    """

    tokenizer: Tokenizer
    n_ctx: int
    context_window: int
    sampling_defaults: tuple[SamplingParams, ...] = ()
    memory: int = 0
    sizing: Sizing | None = None
    engine: Engine | None = None


class ModelLoader(Protocol):
    """What the model pool needs to make a model ready. Every method blocks."""

    def front(self, settings: ModelSettings) -> Front:
        """The model's front (its vocabulary, chat template and sizing).

        Raises:
            ModelFileError: the file is missing or not GGUF, its template does not load (one line).
            EngineError: it cannot be sized to fit (one line saying why).
        """

    def engine(self, settings: ModelSettings, front: Front, progress: Callable[[float], None]) -> Engine:
        """The model's engine, as its front planned it; ``progress`` is told the share loaded
        (0..1) as the load goes.

        Raises:
            ModelFileError, EngineError: llama.cpp could not load it or make its context (one line).
        """

    def free_memory(self) -> int | None:
        """Bytes free where models load now (the GPUs', else the host's), less the margin the
        sizing keeps; None: not known (only ``max_loaded`` limits the loaded models)."""


def context_window(engine: EngineConfig, n_ctx_seq: int) -> int:
    """The most tokens one request may hold: what one sequence may hold of the pool, at most
    ``[engine] ctx_per_slot`` when that is set."""
    cap = engine.ctx_per_slot
    return min(n_ctx_seq, cap) if cap else n_ctx_seq


@attrs.frozen
class FactoryLoader:
    """A :class:`ModelLoader` whose front makes the whole engine with ``factory`` (so a model is
    loaded before its first request is prepared): the fake engine's, or a test's own."""

    factory: Callable[[ModelSettings], Engine]

    def front(self, settings: ModelSettings) -> Front:
        engine = self.factory(settings)
        window = context_window(settings.engine, engine.n_ctx_seq)
        return Front(engine, engine.n_ctx, window, (settings.model.sampling,), engine=engine)

    def engine(self, settings: ModelSettings, front: Front, progress: Callable[[float], None]) -> Engine:
        assert front.engine is not None, "a FactoryLoader's front holds its engine"
        progress(1.0)
        return front.engine

    def free_memory(self) -> int | None:
        return None
