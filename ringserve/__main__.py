"""Command line: ``ringserve serve [MODEL.gguf] [options]``, ``ringserve --version``; bare ``ringserve`` prints the help.

``serve`` takes the flags llama-server users type (``-m``, ``-c``, ``-np``, ``-ngl``, ``-ctk``/``-ctv``,
``-fa``, ``--api-key``, ``--temp`` ...: :data:`OPTIONS`), each also a ``RINGSERVE_*`` environment
variable and a config key: the flag wins over the variable, which wins over the config file
(``--config``), which wins over the defaults. ``serve --print-config`` prints the result as TOML.
Also ``ringserve chat "PROMPT"`` and ``ringserve tail MESSAGE_ID`` (clients; see ``ringserve/client/cli.py``),
``ringserve launch claude|codex`` (an agent on the server; see ``ringserve/launch.py``), and the model
library: ``pull``, ``ls``, ``ps``, ``rm``, ``show``, ``run`` (``ringserve/library.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import tomli_w

from ringserve.client.cli import add_commands
from ringserve.config import CacheType, Config, Switch
from ringserve.core.signals import ECHO_SECONDS, EchoFilter
from ringserve.launch import add_command as add_launch
from ringserve.launch import split_argv
from ringserve.library import add_commands as add_library


@attrs.frozen
class Option:
    """A ``serve`` flag: its spellings, the config key it sets (``table.key``, or
    ``model.sampling.key``), its type and help; its environment variable is ``RINGSERVE_`` and
    its long name in capitals (``--ctx-size``: ``RINGSERVE_CTX_SIZE``)."""

    flags: tuple[str, ...]
    key: str
    kind: type = str
    help: str = ""
    choices: tuple[str, ...] | None = None

    @property
    def long(self) -> str:
        """The first ``--`` spelling."""
        return next(flag for flag in self.flags if flag.startswith("--"))

    @property
    def env(self) -> str:
        return "RINGSERVE_" + self.long[2:].upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.long[2:].replace("-", "_")


#: ``serve``'s flags, llama-server's spellings first (``tools/server/README.md``).
OPTIONS = (
    Option(("-m", "--model"), "model.path", help="GGUF file to serve (default: the bundled SmolLM2-135M-Instruct)"),
    Option(("-a", "--alias"), "model.name", help="the model's id for clients (default: the file's name)"),
    Option(("-c", "--ctx-size"), "model.ctx_size", int,
           "KV cache tokens the slots share (default 0: the model's trained context, lowered to fit the memory)"),
    Option(("-np", "--slots", "--parallel"), "engine.slots", int, "requests decoded together (default 4)"),
    Option(("-ngl", "--n-gpu-layers", "--gpu-layers"), "model.n_gpu_layers", int,
           "layers on the GPU (default -1: every one that fits)"),
    Option(("-ctk", "--cache-type-k"), "model.cache_type_k", help="K cache type (default f16)",
           choices=tuple(t.value for t in CacheType)),
    Option(("-ctv", "--cache-type-v"), "model.cache_type_v", help="V cache type (default f16; quantized needs flash attention)",
           choices=tuple(t.value for t in CacheType)),
    Option(("-fa", "--flash-attn"), "model.flash_attn", help="flash attention (default auto: on with a GPU, off on the CPU, on for a quantized V cache)",
           choices=tuple(s.value for s in Switch)),
    Option(("-t", "--threads"), "model.n_threads", int, "CPU threads for decoding (default 0: every core but one)"),
    Option(("--chat-template-file",), "model.chat_template_file", help="a Jinja chat template over the GGUF's"),
    Option(("--keep-alive",), "model.keep_alive", float, "seconds a model stays loaded with nothing to do (0: always)"),
    Option(("--temp", "--temperature"), "model.sampling.temperature", float,
           "sampling temperature when a request sends none (default: the GGUF's, else 0.8)"),
    Option(("--top-k",), "model.sampling.top_k", int, "top-k when a request sends none (default: the GGUF's, else 40)"),
    Option(("--top-p",), "model.sampling.top_p", float, "top-p when a request sends none (default: the GGUF's, else 0.95)"),
    Option(("--min-p",), "model.sampling.min_p", float, "min-p when a request sends none (default: the GGUF's, else 0.05)"),
    Option(("--repeat-penalty",), "model.sampling.repeat_penalty", float, "repeat penalty (default 1: off)"),
    Option(("--presence-penalty",), "model.sampling.presence_penalty", float, "presence penalty (default 0)"),
    Option(("--frequency-penalty",), "model.sampling.frequency_penalty", float, "frequency penalty (default 0)"),
    Option(("--seed",), "model.sampling.seed", int, "sampling seed when a request sends none (default: random)"),
    Option(("--models-dir",), "router.models_dir", help="a folder of GGUF models to serve by name (docs/models.md)"),
    Option(("--models-max",), "router.max_loaded", int, "most models loaded at once (default 4)"),
    Option(("--host",), "server.host", help="bind address (default 127.0.0.1)"),
    Option(("--port",), "server.port", int, "bind port (default 8080)"),
    Option(("--api-key",), "auth.api_keys", help="an API key clients must send (repeat it for several; "
           "also $RINGSERVE_API_KEYS, comma-separated)"),
)

_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="run the server",
        description="Run the server. Every flag is also an environment variable (RINGSERVE_ and its long name: "
                    "--ctx-size is RINGSERVE_CTX_SIZE) and a config key (configs/default.toml); the flag wins.")
    serve.add_argument("model_file", nargs="?", metavar="MODEL", help="GGUF file to serve (as -m)")
    serve.add_argument("--config", type=Path, help="TOML config file (see configs/default.toml)")
    for option in OPTIONS:
        extra: dict[str, Any] = {"action": "append"} if option.key == "auth.api_keys" else {"type": option.kind}
        serve.add_argument(*option.flags, dest=option.dest, help=option.help, choices=option.choices,
                           metavar=None if option.choices else option.dest.upper(), **extra)
    serve.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def _version() -> str:
    """``ringserve X (llama-cpp-python Y)`` from the installed distributions (no libllama loaded)."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"ringserve {version('ringserve')} (llama-cpp-python {version('llama-cpp-python')})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="Self-hosted LLM server streaming over SSE.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command")
    _serve_parser(sub)
    add_commands(sub)
    add_launch(sub, load_config)
    add_library(sub, load_config)
    return parser


def _settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The config keys the command line and the environment set, the flag winning: ``{"table.key": value}``.

    Raises:
        ValueError: an environment variable that is not of its flag's type or choices (one line).
    """
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if option.key != "auth.api_keys" and option.env in environ:
            raw = environ[option.env]
            try:
                value = option.kind(raw)
            except ValueError:
                raise ValueError(f"{option.env}={raw!r}: not {_KINDS[option.kind]}") from None
            if option.choices and value not in option.choices:
                raise ValueError(f"{option.env}={raw!r}: one of {', '.join(option.choices)}")
            values[option.key] = value
        flag = getattr(args, option.dest, None)
        if flag is not None:
            values[option.key] = flag
    if args.model_file is not None:
        if getattr(args, "model", None) is not None:
            raise ValueError(f"a model twice: {args.model_file} and -m {args.model}")
        values["model.path"] = args.model_file
    if "model.path" in values:  # a file named here is the model, named by its stem unless -a names it
        values["model.hf"] = ""
        values.setdefault("model.name", "")
    return values


def load_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Config:
    """The config file (or defaults) with the environment's and then the command line's settings applied.

    Raises:
        OSError, ValueError: the config file cannot be read or is invalid, or a setting is (one line).
    """
    config = Config.from_toml(args.config) if args.config else Config()
    tables: dict[str, dict[str, Any]] = {}
    for key, value in _settings(args, environ).items():
        table, name = key.rsplit(".", 1)
        tables.setdefault(table, {})[name] = value
    if keys := tables.get("auth", {}).get("api_keys"):
        tables["auth"]["api_keys"] = (*config.auth.api_keys, *keys)
    for table, changes in tables.items():
        try:
            config = config.replace(table, **changes)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"[{table}] {exc}") from None
    return config


#: The keys whose values ``--print-config`` does not print (``repr=False`` fields of the config).
HIDDEN = "<hidden>"


def config_toml(config: Config) -> str:
    """``config`` as TOML (``--print-config``): every table and key, ``None`` values left out
    (not set: the default rule applies), secrets as :data:`HIDDEN`."""
    def hidden(value: Any) -> Any:
        return [HIDDEN] * len(value) if isinstance(value, tuple) else HIDDEN if value else value

    def table(value: Any) -> Any:
        if attrs.has(type(value)):
            return {f.name: hidden(getattr(value, f.name)) if not f.repr else table(getattr(value, f.name))
                    for f in attrs.fields(type(value)) if getattr(value, f.name) is not None}
        if isinstance(value, Mapping):
            return {k: table(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return [table(v) for v in value]
        return value.value if hasattr(value, "value") else value

    data = table(config)
    data["policy"] = {**{name: p.value for name, p in config.policy.surfaces.items()},
                      "grace_seconds": config.policy.grace_seconds}
    data["models"] = {name: {**preset.model, **preset.engine, **({"sampling": dict(preset.sampling)}
                                                                 if preset.sampling else {})}
                      for name, preset in config.models.items()}
    return tomli_w.dumps(data)


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


#: The exit status of a command whose output's reader went away (``ringserve show NAME | head -1``):
#: a shell's for a process that ``SIGPIPE`` ended (128 + 13), as a C tool's would be.
CLOSED_PIPE = 141


def _closed_pipe_quiet(command: Callable[[], int]) -> int:
    """``command()``'s status, its output flushed; :data:`CLOSED_PIPE`, with no traceback, when the
    reader of its standard output closed the pipe (Python ignores ``SIGPIPE``, so a write raises
    ``BrokenPipeError``): standard output then points at ``/dev/null``, so that the interpreter's
    flush at exit finds nothing to write (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        status = command()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_PIPE
    return status


def main(argv: list[str] | None = None) -> int:
    argv, agent_args = split_argv(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if agent_args:
        args.agent_args = agent_args
    if getattr(args, "client_command", None) is not None:
        if ECHO_SECONDS:  # the one-file executable
            _interrupt_once(ECHO_SECONDS)
        return _closed_pipe_quiet(lambda: args.client_command(args))
    from ringserve.engine.catalog import discover
    from ringserve.engine.modelfile import ModelFileError, check_model_file
    from ringserve.engine.protocol import EngineError
    from ringserve.http.auth import AuthSetupError, with_environ
    from ringserve.http.transport import BindError
    from ringserve.live.safety import SafetySetupError
    from ringserve.server import run_process
    from ringserve.store.sqlite import StoreError
    from ringserve.surfaces.registry import SURFACES

    try:
        start_logging(args.log_level)
        config = load_config(args)
        SURFACES.check_policies(config.policy)  # a [policy] key that names no surface
        if args.print_config:  # with the keys and secret the environment adds, as the server applies them
            print(config_toml(attrs.evolve(config, auth=with_environ(config.auth))), end="")
            return 0
        if config.model.path:
            check_model_file(config.model.path)
        catalog = discover(config)  # one that cannot be made (a name twice, a preset of no model...): one line
    except (OSError, ValueError, ModelFileError) as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    try:
        return run_process(config, catalog=catalog)  # 0 after a drain, 1 if a second signal cut it short
    except (AuthSetupError, SafetySetupError, StoreError, BindError, EngineError, ModelFileError) as exc:
        # a non-loopback host with no keys, a malformed key, a safety checker that does not load, a bad store
        # file, a port taken, a model or context that did not load
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
