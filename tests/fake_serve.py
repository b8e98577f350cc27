"""Test-only launcher: a real ringserve server process on the fake engine.

``python -m tests.fake_serve --config FILE [--fake JSON] [--reply-bytes N]`` runs
:func:`ringserve.server.serve` exactly as ``ringserve serve`` does (signal
handling, drain, exit code), except that the engine is a
:class:`~ringserve.engine.fake.FakeEngine` built from the JSON object of
keyword arguments given with ``--fake``. ``n_slots`` and ``n_ctx_slot``
default to the config's ``[engine]`` values. Not part of the product CLI:
the fake engine exists for tests only.

The process logs like the real CLI, including the ``ready: ... at URL``
line that :class:`tests.conftest.ServerProcess` waits for.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import trio

from ringserve.config import Config
from ringserve.engine.fake import FakeEngine
from ringserve.server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.fake_serve")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--fake", default="{}", help="FakeEngine keyword arguments as a JSON object")
    parser.add_argument("--reply-bytes", type=int, help="reply with this many bytes of text (too long for argv)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    config = Config.from_toml(args.config)
    kwargs = json.loads(args.fake)
    kwargs.setdefault("n_slots", config.engine.slots)
    kwargs.setdefault("n_ctx_slot", config.engine.ctx_per_slot)
    if args.reply_bytes is not None:
        kwargs["reply"] = "0123456789abcdef" * (args.reply_bytes // 16)
    return trio.run(serve, config, lambda _config: FakeEngine(**kwargs))


if __name__ == "__main__":
    sys.exit(main())
