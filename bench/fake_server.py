"""A ringserve server process on the fake engine, with a start gate, for the gateway benchmarks.

``python bench/fake_server.py --config FILE [--fake JSON] [--reply-bytes N] [--gate-after K]``
runs :func:`ringserve.server.run_process` exactly as ``ringserve serve`` does
(listener, hub, signals, drain, the ``ready: ... at URL`` log line) with a
:class:`~ringserve.engine.fake.FakeEngine` built from the ``--fake`` JSON
keyword arguments (``n_slots`` and ``n_ctx`` default to the config's, ``record`` to false: no
test can read this process's engine log, which would grow with every decode call).

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
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringserve.config import Config  # noqa: E402
from ringserve.core.batch import Sampled, SlotFeed  # noqa: E402
from ringserve.core.sampling import ResolvedSampling  # noqa: E402
from ringserve.engine.fake import FakeEngine  # noqa: E402
from ringserve.engine.gbnf import Constraint, LazyCalls  # noqa: E402
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/fake_server.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--fake", default="{}", help="FakeEngine keyword arguments as a JSON object")
    ap.add_argument("--reply-bytes", type=int, help=f"reply with this many bytes of {REPLY_UNIT!r} repeated")
    ap.add_argument("--gate-after", type=int, help="hold decoding after this many sequences until SIGUSR1")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    config = Config.from_toml(args.config)
    kwargs = json.loads(args.fake)
    kwargs.setdefault("record", False)  # no test reads this process's engine log: it would only grow
    kwargs.setdefault("n_slots", config.engine.slots)
    if config.model.ctx_size:
        kwargs.setdefault("n_ctx", config.model.ctx_size)
    if args.reply_bytes is not None:
        kwargs["reply"] = REPLY_UNIT * (args.reply_bytes // len(REPLY_UNIT))
    if args.gate_after is None:
        return run_process(config, lambda _config: FakeEngine(**kwargs))
    gate = threading.Event()
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: gate.set())
    return run_process(config, lambda _config: GatedFakeEngine(gate=gate, gate_after=args.gate_after, **kwargs))


if __name__ == "__main__":
    sys.exit(main())
