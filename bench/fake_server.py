"""A ringserve server process on the fake engine, with a start gate, for the gateway benchmarks.

``python bench/fake_server.py [MODEL] --config FILE [--fake JSON] [--reply-bytes N] [--gate-after K]
[--real NAME ...]``
runs :func:`ringserve.server.run_process` exactly as ``ringserve serve`` does
(listener, hub, signals, drain, the ``ready: ... at URL`` log line; ``MODEL``, a file, names the
model after its stem as ``ringserve serve MODEL`` does, its contents unread) with a
:class:`~ringserve.engine.fake.FakeEngine` built from the ``--fake`` JSON
keyword arguments (``n_slots`` and ``n_ctx`` default to each model's settings, ``record`` to false: no
test can read this process's engine log, which would grow with every decode call).

With ``--real NAME``, the model of the catalog named NAME is llama.cpp's, loaded from its file
by the server's own loader (``engine/llama.py`` ``LlamaLoader``), beside the fake ones
(:class:`MixedLoader`): a real load while fake streams run (``bench/load_beside.py``).

With ``--gate-after K``, once ``K`` sequences have been begun every decode
call waits until the process receives ``SIGUSR1``: the benchmark creates its
messages, connects all its streams while nothing is generated, then sends
the signal so every stream sees the same live load from the same moment.
(The wait holds the runner's decode limiter; requests created after the gate
closed are still tokenized at once, under the tokenizer's own limiter.)
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs  # noqa: E402

from ringserve.config import Config, ModelSettings  # noqa: E402
from ringserve.core.batch import Sampled, SlotFeed  # noqa: E402
from ringserve.core.sampling import ResolvedSampling  # noqa: E402
from ringserve.engine.fake import FakeEngine  # noqa: E402
from ringserve.engine.gbnf import Constraint, LazyCalls  # noqa: E402
from ringserve.engine.loader import FactoryLoader, Front, ModelLoader  # noqa: E402
from ringserve.engine.protocol import Engine  # noqa: E402
from ringserve.server import run_process  # noqa: E402

REPLY_UNIT = "0123456789abcdef"
"""The reply text is this, repeated (no SSE field names in it, 16 bytes)."""


class GatedFakeEngine(FakeEngine):
    """A :class:`FakeEngine` whose decode calls wait for ``gate`` once ``gate_after`` sequences began.

    Args:
        gate: set (from any thread) to let decoding go on.
        gate_after: sequences begun before the gate closes.
        **kwargs: :class:`FakeEngine` arguments.
    """

    def __init__(self, *, gate: threading.Event, gate_after: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._gate = gate
        self._gate_after = gate_after
        self._begun = 0

    def begin(
        self,
        slot: int,
        sampling: ResolvedSampling,
        keep: int = 0,
        source: int | None = None,
        constraint: Constraint | LazyCalls | None = None,
        *,
        prompt: Sequence[int] = (),
        logprobs: int | None = None,
        replay: Sequence[int] = (),
    ) -> None:
        super().begin(slot, sampling, keep, source, constraint, prompt=prompt, logprobs=logprobs, replay=replay)
        self._begun += 1

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        if self._begun >= self._gate_after:
            self._gate.wait()
        return super().decode(feeds)


@attrs.frozen
class MixedLoader:
    """A :class:`~ringserve.engine.loader.ModelLoader` that loads the models named in ``names`` with
    ``real`` (llama.cpp's) and every other one with ``fake``; the free memory is ``real``'s."""

    fake: ModelLoader
    real: ModelLoader
    names: frozenset[str]

    def _loader(self, settings: ModelSettings) -> ModelLoader:
        return self.real if settings.model.name in self.names else self.fake

    def front(self, settings: ModelSettings) -> Front:
        return self._loader(settings).front(settings)

    def engine(self, settings: ModelSettings, front: Front, progress: Callable[[float], None]) -> Engine:
        return self._loader(settings).engine(settings, front, progress)

    def free_memory(self) -> int | None:
        return self.real.free_memory()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/fake_server.py", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="a model file: the model's name is its stem")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--fake", default="{}", help="FakeEngine keyword arguments as a JSON object")
    ap.add_argument("--reply-bytes", type=int, help=f"reply with this many bytes of {REPLY_UNIT!r} repeated")
    ap.add_argument("--gate-after", type=int, help="hold decoding after this many sequences until SIGUSR1")
    ap.add_argument("--real", action="append", default=[], metavar="NAME",
                    help="the model NAME is llama.cpp's, loaded from its file (repeatable)")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    config = Config.from_toml(args.config)
    if args.model is not None:  # as `ringserve serve MODEL`: the file's stem
        config = config.replace("model", path=str(args.model), hf="", name="")
    elif not (config.model.path or config.model.hf or config.model.name):
        config = config.replace("model", name="fake")  # the fake engine's name for itself, for the bundled model
    given = json.loads(args.fake)
    given.setdefault("record", False)  # no test reads this process's engine log: it would only grow
    if args.reply_bytes is not None:
        given["reply"] = REPLY_UNIT * (args.reply_bytes // len(REPLY_UNIT))

    def arguments(settings: ModelSettings) -> dict[str, Any]:
        """The engine's keyword arguments for one model: its slots and KV pool unless ``--fake`` sets them."""
        sized = {"n_slots": settings.engine.slots} | ({"n_ctx": settings.model.ctx_size} if settings.model.ctx_size else {})
        return sized | given

    gate: threading.Event | None = None
    if args.gate_after is not None:
        opened = gate = threading.Event()
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: opened.set())

    def factory(settings: ModelSettings) -> FakeEngine:
        if gate is None:
            return FakeEngine(**arguments(settings))
        return GatedFakeEngine(gate=gate, gate_after=args.gate_after, **arguments(settings))

    if not args.real:
        return run_process(config, factory)
    from ringserve.engine.llama import LlamaLoader

    real = LlamaLoader(config.router.memory_margin)
    return run_process(config, MixedLoader(FactoryLoader(factory), real, frozenset(args.real)))


if __name__ == "__main__":
    sys.exit(main())
