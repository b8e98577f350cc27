"""Command line: ``ringserve serve [--config FILE] [--host H] [--port P] [--model PATH] [--slots N]``.

Also ``ringserve chat "PROMPT"`` and ``ringserve tail MESSAGE_ID`` (clients; see ``ringserve/client/cli.py``),
and ``ringserve launch claude|codex`` (an agent on the server; see ``ringserve/launch.py``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from ringserve.client.cli import add_commands
from ringserve.config import Config
from ringserve.core.signals import ECHO_SECONDS, EchoFilter
from ringserve.launch import add_command as add_launch
from ringserve.launch import split_argv


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="Self-hosted LLM server streaming over SSE.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--config", type=Path, help="TOML config file (see configs/default.toml)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="bind port (default 8080)")
    serve.add_argument("--model", help="path to a GGUF model (default: the bundled SmolLM2-135M-Instruct)")
    serve.add_argument("--slots", type=int, help="concurrent sequences decoded together (default 4)")
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_commands(sub)
    add_launch(sub)
    return parser


def load_config(args: argparse.Namespace) -> Config:
    """The config file (or defaults) with the command line's overrides applied."""
    config = Config.from_toml(args.config) if args.config else Config()
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if server:
        config = config.replace("server", **server)
    if args.model is not None:
        config = config.replace("model", path=args.model)
    if args.slots is not None:
        config = config.replace("engine", slots=args.slots)
    return config


#: The names ``--log-level`` takes (any case), most verbose first.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def start_logging(level: str) -> None:
    """The server's log on stderr, from ``level`` (a name of :data:`LOG_LEVELS`, any case) up.

    Raises:
        ValueError: ``level`` names no level (one line).
    """
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"--log-level {level}: not a level ({', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]})")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _interrupt_once(window: float) -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` once, not again for its echo (:mod:`ringserve.core.signals`)."""
    echoes = EchoFilter(window)

    def on_sigint(_signum: int, _frame: FrameType | None) -> None:
        if not echoes.is_echo(time.monotonic()):
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str] | None = None) -> int:
    argv, agent_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if agent_args:
        args.agent_args = agent_args
    if getattr(args, "client_command", None) is not None:
        if ECHO_SECONDS:  # the one-file executable
            _interrupt_once(ECHO_SECONDS)
        return args.client_command(args)
    from ringserve.engine.modelfile import ModelFileError, check_model_file, default_model_path
    from ringserve.engine.protocol import EngineError
    from ringserve.http.auth import AuthSetupError
    from ringserve.http.transport import BindError
    from ringserve.live.safety import SafetySetupError
    from ringserve.server import run_process
    from ringserve.store.sqlite import StoreError
    from ringserve.surfaces.registry import SURFACES

    try:
        start_logging(args.log_level)
        config = load_config(args)
        SURFACES.check_policies(config.policy)  # a [policy] key that names no surface
        check_model_file(config.model.path or default_model_path())
    except (OSError, ValueError, ModelFileError) as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    try:
        return run_process(config)  # 0 after a drain, 1 if a second signal cut it short
    except (AuthSetupError, SafetySetupError, StoreError, BindError, EngineError, ModelFileError) as exc:
        # a non-loopback host with no keys, a malformed key, a safety checker that does not load, a bad store
        # file, a port taken, a model or context that did not load
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
