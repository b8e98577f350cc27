"""``ringserve launch claude`` and ``ringserve launch codex``: a coding agent on ringserve in one command.

``ringserve launch AGENT [--config FILE] [--models-dir DIR] [--url URL] [--api-key KEY] [--keep-server] [--print] [-- AGENT ARGS]``

The launcher looks for a server at the URL (``--url``, else ``$RINGSERVE_URL``, else the
config's ``[server]`` host and port). When nothing answers there it starts ``ringserve serve``
with the same config (and ``--models-dir``) as a child process, in a session of its own (the terminal's Ctrl-C goes to
the agent, not to the server) with its output in a log file, waits for ``GET /ready``, and stops
it when the agent exits (SIGTERM, so it drains; ``--keep-server`` leaves it running), unless
another command (``launch``, ``run``) still uses it: then the last of those stops it
(:func:`open_server`). It reads
the served model's name and context window from ``GET /v1/models`` (``max_input_tokens``), then
runs the agent with the settings below, or prints them (``--print``: shell ``export`` lines and,
for Codex, the ``config.toml`` that says the same; a server it started for them goes on, since
they point at it). Arguments after ``--`` go to the agent. The
exit status is the agent's (128 + N when signal N ended it); 2 and one line on stderr when the
launcher cannot do its part (a URL no server can have, a key refused, a server that exited), and
then a server it started is stopped.

What each agent gets (the facts behind each are in ``docs/agents.md``, observed on the versions
pinned in ``.ci/agents/package.json``):

* Claude Code: ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` (the key; a placeholder when the
  server needs none), the served model's name in ``ANTHROPIC_MODEL`` and in every variable that
  picks the model of background and sub-agent calls, the context window in
  ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` (:func:`claude_window`), ``API_TIMEOUT_MS``, ``DISABLE_TELEMETRY=1`` and ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1``.
* Codex CLI: ``-c`` overrides on its command line, so the user's ``~/.codex/config.toml`` is read
  but never written: a provider ``ringserve`` (``base_url``, ``wire_api = "responses"``, the key
  in ``$RINGSERVE_API_KEY``, ``stream_idle_timeout_ms``), the model's name and
  ``model_context_window``, and ``model_catalog_json``: a catalog of one model, the served one,
  made from Codex's own entry for :data:`CODEX_TEMPLATE` (``codex debug models --bundled``). Codex
  offers its freeform ``apply_patch`` tool only to models it has such metadata for; without it a
  model gets its fallback tool set and a 272,000-token window.

Both agents' request timers are set to the longest a ringserve stream may take
(``[server] max_stream_seconds``, or :data:`AGENT_TIMEOUT_S` when it is 0, no limit): Claude Code
gives a request 600 s and Codex 300 s of silence by default, and a retry after either starts the
whole prefill again.

This module imports nothing of the server: ``ringserve serve`` runs in its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import fcntl
import fnmatch
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, TextIO, assert_never
from urllib.parse import quote, urlsplit

import attrs
import httpx
import platformdirs

from ringserve.config import Config
from ringserve.core.errors import key_refused
from ringserve.core.frozen import SELF

__all__ = [
    "AGENTS", "AGENT_TIMEOUT_S", "CODEX_TEMPLATE", "Agent", "AgentInfo", "LaunchError", "Served", "ServerChild",
    "Settings", "add_command", "check_url", "claude_settings", "claude_window", "codex_model_entry", "codex_settings",
    "context_warning", "find_agent", "model_arg", "open_server", "render", "run", "server_url", "split_argv",
]


class Agent(enum.StrEnum):
    CLAUDE = "claude"
    CODEX = "codex"


@attrs.frozen
class AgentInfo:
    """What the launcher knows of one agent: its name, program, npm package and pinned version, the
    size of its first request (tokens: the least and the most measured), and the size of the request
    it sends instead when that one is refused (tokens; None: it sends none smaller or larger)."""

    name: str
    program: str
    package: str
    version: str
    prompt_tokens: tuple[int, int]
    refused_tokens: int | None = None


#: The agents. ``version`` is the one pinned in ``.ci/agents/package.json`` (a test keeps them
#: equal). ``prompt_tokens``: the first request of each as launched here (a model name the agent does
#: not know; Codex with :data:`CODEX_TEMPLATE`'s metadata), as ringserve counts the rendered prompt
#: (``docs/agents.md``, "Context"): Claude Code 12,583 (SmolLM2's tokenizer, ringserve's 400, 2.1.332)
#: to 13,026 (the captures' table, "Context the default prompts need"); Codex 7,881 (the bundled model,
#: ``tests/system/test_agents.py``) to about 8,150 (a user's run on an 8,192-token model, where it
#: fitted). ``refused_tokens``: Claude Code, refused, sends its request again without tool search,
#: its tools inline: 20,883 and 20,911 here, 20,924-21,315 in a user's runs (the figure its error
#: shows), rounded up.
AGENTS: dict[Agent, AgentInfo] = {
    Agent.CLAUDE: AgentInfo("Claude Code", "claude", "@anthropic-ai/claude-code", "2.1.332", (12_500, 13_100),
                            21_400),
    Agent.CODEX: AgentInfo("Codex CLI", "codex", "@openai/codex", "0.171.0", (7_850, 8_200)),
}

#: Claude Code's output cap for a model it does not know, and the most of it it keeps free in the
#: window for a reply (tokens; 2.1.332's binary: ``kfo=20000``, and the ``max_tokens`` of its
#: requests for such a model, ``docs/agents.md``): :func:`claude_window`.
CLAUDE_OUTPUT_CAP = 32_000
CLAUDE_REPLY_ROOM = 20_000
#: The agents' request timeout when ``[server] max_stream_seconds`` is 0 (no limit), in seconds.
AGENT_TIMEOUT_S = 3600.0
#: The model of Codex's bundled catalog whose metadata the served model gets: in Codex 0.171.0 the
#: newest whose tools are functions plus the freeform ``apply_patch`` (later ones use "code mode").
CODEX_TEMPLATE = "gpt-5.5"
#: Codex's provider id for ringserve, and the environment variable its key is read from.
CODEX_PROVIDER = "ringserve"
CODEX_KEY_ENV = "RINGSERVE_API_KEY"
#: The key an agent sends when the server has none configured (both agents want one).
PLACEHOLDER_KEY = "ringserve"
#: The repository's pinned copies of the agents (``npm ci --prefix .ci/agents``).
PINNED_BIN = Path(__file__).resolve().parent.parent / ".ci" / "agents" / "node_modules" / ".bin"
#: How long a started server may take to become ready (the model load), in seconds.
READY_TIMEOUT_S = 600.0
#: ``prctl(2)``'s option that names the signal a process gets when its parent dies (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1
#: What starts a server: ``ringserve serve``, from this interpreter or this one-file executable.
SERVE = (*SELF, "serve")


class LaunchError(Exception):
    """Something the launcher could not do; the message is one line for the terminal."""


@attrs.frozen
class Served:
    """The server an agent talks to: its base URL (no trailing ``/``), the model's name and context
    window (the most tokens one request may hold), the key to send, the request timeout (seconds),
    and the model of the agent's small background calls (Claude Code's titles and checks: its
    ``--small-model``; None: the same model)."""

    url: str
    model: str
    context_window: int
    api_key: str
    timeout: float
    small_model: str | None = None


@attrs.frozen
class Settings:
    """What one agent gets: its environment's additions, the arguments before the user's, and (Codex)
    the ``config.toml`` text that says the same as those arguments."""

    env: dict[str, str]
    args: tuple[str, ...] = ()
    config_toml: str = ""


def claude_window(context_window: int, env: Mapping[str, str]) -> int:
    """What ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` says for a model of ``context_window`` tokens (prompt and
    reply), given the environment Claude Code runs in (``env``): the window plus the reply room
    Claude Code takes off it, so that it compacts and stops where ringserve's window does.

    Claude Code 2.1.332 (its binary) takes the variable as the window of a model it does not know,
    and the variable silences its "doesn't recognize the model ... assumes a context window of 1m
    tokens" notice. It keeps min(its output cap, 20,000) tokens of that window for the reply (the
    cap: ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, else 32,000 for such a model), compacts the conversation
    when it is 13,000 tokens short of the rest, and refuses a prompt 3,000 short of it ("Prompt is
    too long", no request sent). ringserve's window already holds the reply (``max_tokens`` is
    clamped to what is left), so with the bare window Claude Code would compact 33,000 tokens
    before the window is full: at every turn on a 32,768-token model (against the fake engine, a
    window under the last prompt plus 33,000 made a turn a compaction and the turn, 3 requests,
    not 1). With this sum it compacts at 13,000 and refuses at 3,000 tokens short of the window.
    """
    cap = env.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "")
    output = int(cap) if cap.isdigit() and int(cap) > 0 else CLAUDE_OUTPUT_CAP
    return context_window + min(output, CLAUDE_REPLY_ROOM)


def claude_settings(served: Served, env: Mapping[str, str]) -> Settings:
    """Claude Code's environment (its variables: ``docs/agents.md``; names from its binary).

    ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` (:func:`claude_window`) gives Claude Code the window of a
    model its catalog does not describe (else 1,000,000, and a notice on stderr saying so); one
    variable for every such model, so the small model gets the main model's.
    """
    small = served.small_model or served.model
    model = {name: served.model for name in (
        "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL",
    )}
    model |= {name: small for name in (
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",  # its haiku-class calls
        "ANTHROPIC_SMALL_FAST_MODEL",  # the older name of the background calls' model
    )}
    return Settings({
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_API_KEY": served.api_key,
        **model,
        "API_TIMEOUT_MS": str(round(served.timeout * 1000)),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(claude_window(served.context_window, env)),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })


def _toml(value: str | int) -> str:
    # A JSON string is a TOML basic string: the same escapes (\" \\ \n \t \uXXXX ...).
    return json.dumps(value)


def codex_settings(served: Served, catalog: Path | None) -> Settings:
    """Codex's ``-c`` overrides and the ``config.toml`` they amount to (``catalog``: the file
    :func:`codex_model_entry`'s catalog is in, or None for none)."""
    root: dict[str, str | int] = {"model": served.model, "model_provider": CODEX_PROVIDER,
                                  "model_context_window": served.context_window}
    if catalog is not None:
        root["model_catalog_json"] = str(catalog)
    provider: dict[str, str | int] = {
        "name": "ringserve",
        "base_url": f"{served.url}/v1",
        "wire_api": "responses",
        "env_key": CODEX_KEY_ENV,
        "stream_idle_timeout_ms": round(served.timeout * 1000),
    }
    table = f"model_providers.{CODEX_PROVIDER}"
    pairs = [*root.items(), *((f"{table}.{key}", value) for key, value in provider.items())]
    config = "".join(f"{key} = {_toml(value)}\n" for key, value in root.items())
    config += f"\n[{table}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in provider.items())
    return Settings({CODEX_KEY_ENV: served.api_key},
                    tuple(arg for key, value in pairs for arg in ("-c", f"{key}={_toml(value)}")), config)


def codex_model_entry(catalog: Mapping[str, Any], served: Served) -> dict[str, Any] | None:
    """The served model's entry for Codex's ``model_catalog_json``: :data:`CODEX_TEMPLATE`'s entry
    in ``catalog`` (what ``codex debug models --bundled`` prints) under the served model's name and
    context window, without an upgrade offer, availability notice or paid speed tiers, and asking for
    reasoning summaries (``default_reasoning_summary`` ``auto``; the template's is ``none``, and
    Codex shows a model's reasoning only from summaries: ringserve's are the whole reasoning).
    None when the catalog has no such model."""
    template = next((m for m in catalog.get("models", ()) if m.get("slug") == CODEX_TEMPLATE), None)
    if template is None:
        return None
    cleared: dict[str, Any] = {"upgrade": None, "availability_nux": None, "additional_speed_tiers": [], "service_tiers": []}
    return {
        **template,
        **{key: value for key, value in cleared.items() if key in template},
        "slug": served.model,
        "display_name": served.model,
        "description": f"{served.model}, served by ringserve",
        "context_window": served.context_window,
        "max_context_window": served.context_window,
        "default_reasoning_summary": "auto",
    }


def context_warning(agent: Agent, served: Served) -> str | None:
    """One line, before the agent starts, when the model's context may be smaller than the agent's
    first request (:data:`AGENTS`' ``prompt_tokens``): the request's size, the context, whether it
    will be refused (a context under the least measured) or may not fit (within the measured range,
    where a request that fits leaves little for the reply), and what to do."""
    info = AGENTS[agent]
    least, most = info.prompt_tokens
    if served.context_window >= most:
        return None
    size = f"{info.name}'s first request is about {least:,}-{most:,} tokens"
    context = f"{served.model}'s context of {served.context_window:,}"
    if served.context_window < least:
        retry = ("" if info.refused_tokens is None else
                 f"; refused, it retries with up to {info.refused_tokens:,} tokens, the size its error names")
        verdict = f"{size}, more than {context}: expect a 400 (prompt too long){retry}"
    else:
        verdict = f"{size}: it may not fit {context}, and if it does it leaves little for the reply"
    return (f"ringserve: warning: {verdict}; launch it on a model with a longer context: ringserve launch "
            f"{agent.value} --model MODEL.gguf (or --model NAME of the server's, GET /v1/models)")


def render(agent: Agent, served: Served, settings: Settings) -> str:
    """The ``--print`` text: a comment naming the server, ``export`` lines, and for Codex its
    ``config.toml``."""
    info = AGENTS[agent]
    small = "" if served.small_model is None else f" (small model {served.small_model})"
    lines = [f"# {info.name} on ringserve at {served.url}: model {served.model}{small}, "
             f"{served.context_window:,} tokens of context"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in settings.env.items()]
    if settings.config_toml:
        lines += ["# config.toml (~/.codex/ or $CODEX_HOME; `ringserve launch codex` passes these as -c overrides):",
                  settings.config_toml.rstrip("\n")]
    return "\n".join(lines) + "\n"


def find_agent(info: AgentInfo, path: str | None, pinned: Path = PINNED_BIN) -> str | None:
    """The agent's program: on ``path`` (``$PATH``), else the repository's pinned copy, else None."""
    found = shutil.which(info.program, path=path)
    if found is not None:
        return found
    copy = pinned / info.program
    return str(copy) if copy.is_file() and os.access(copy, os.X_OK) else None


def _missing(info: AgentInfo) -> LaunchError:
    return LaunchError(f"{info.name} ({info.program}) is on neither PATH nor {PINNED_BIN}; "
                       f"install it: npm install -g {info.package}@{info.version}")


def server_url(config: Config) -> str:
    """The URL the config's server listens on (a wildcard host is reached on loopback).

    Raises:
        LaunchError: ``[server] port`` is 0 (a port chosen at start cannot be found here).
    """
    server = config.server
    if server.port == 0:
        raise LaunchError("[server] port is 0, so the server's port is not known here: set it, or give --url")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(server.host, server.host)
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if server.certfile else 'http'}://{host}:{server.port}"


def _url_arg(url: str) -> str:
    return f"the URL {url!r} (--url or $RINGSERVE_URL)"


def check_url(url: str) -> str:
    """The server's URL from ``--url`` or ``$RINGSERVE_URL`` as the launcher uses it: checked, without
    a trailing ``/``.

    Raises:
        LaunchError: not an ``http``/``https`` URL with a host; a port that is malformed, out of
            range or 0 (a server started there would listen on a port chosen at start, which the
            launcher cannot find).
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, a malformed IPv6 host
        raise LaunchError(f"{_url_arg(url)}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LaunchError(f"{_url_arg(url)}: not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8080)")
    if port == 0:
        raise LaunchError(f"{_url_arg(url)}: port 0 names no server (one started there would listen on a random"
                          " port): give the server's port")
    return url.rstrip("/")


def configured_key(flag: str | None, config: Config) -> tuple[str, str] | None:
    """The API key a command sends and where it came from: ``--api-key`` (whose default is
    $RINGSERVE_API_KEY), else the config's first ``[auth] api_keys``; None without either.

    Raises:
        LaunchError: a key an HTTP header cannot carry (see :func:`check_key`).
    """
    if flag:
        key, source = flag, "--api-key or $RINGSERVE_API_KEY"
    elif config.auth.api_keys:
        key, source = next(iter(config.auth.api_keys)), "the config's [auth] api_keys"
    else:
        return None
    check_key(key, source)
    return key, source


def check_key(api_key: str, source: str) -> None:
    """Check that an HTTP header can carry ``api_key``: printable ASCII (RFC 9110's field values,
    less the controls and non-ASCII bytes that no server's key holds).

    Raises:
        LaunchError: a character that is not (a newline, a tab, a non-ASCII letter): one line
            naming ``source``, the character and its position, never the key.
    """
    bad = next(((i, c) for i, c in enumerate(api_key) if not (c.isascii() and c.isprintable())), None)
    if bad is not None:
        raise LaunchError(f"the API key ({source}) has {bad[1]!r} at position {bad[0]}: a key is printable ASCII")


def _serve_args(config_path: Path | None, url: str | None, model_file: Path | None = None,
                models_dir: str | None = None) -> list[str]:
    """``ringserve serve``'s arguments: the model file, the models folder, the config, and the host and
    port of a ``--url``."""
    args = [] if model_file is None else [str(model_file)]
    args += [] if not models_dir else ["--models-dir", models_dir]
    args += [] if config_path is None else ["--config", str(config_path)]
    if url is not None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise LaunchError(f"--url {url}: no server answers there, and without a host and port none can be started")
        args += ["--host", parts.hostname, "--port", str(parts.port)]
    return args


#: The port of a URL that names none.
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Readiness(enum.Enum):
    NONE = "none"  # nothing listens
    LOADING = "loading"  # a server, not ready yet (or draining)
    READY = "ready"


def _readiness(client: httpx.Client, url: str) -> _Readiness:
    try:
        status = client.get(f"{url}/ready").status_code
    except httpx.TransportError:
        return _Readiness.NONE
    if status == 200:
        return _Readiness.READY
    if status == 503:
        return _Readiness.LOADING
    raise LaunchError(f"{url}/ready answered {status}: is this a ringserve server?")


def _get(client: httpx.Client, url: str, path: str, api_key: str, key_source: str | None,
         body: dict[str, Any] | None = None) -> httpx.Response:
    """``GET`` (or, with ``body``, ``POST``) ``path`` with the key; a refused key is a :class:`LaunchError`."""
    headers = {"Authorization": f"Bearer {api_key}"}
    if body is None:
        response = client.get(f"{url}{path}", headers=headers)
    else:
        response = client.post(f"{url}{path}", headers=headers, json=body, timeout=READY_TIMEOUT_S)
    if response.status_code == 401:
        raise LaunchError(key_refused(url, key_source))
    return response


def served_model(client: httpx.Client, url: str, api_key: str, key_source: str | None,
                 wanted: str | None, model_file: Path | None = None) -> tuple[str, int]:
    """The name and context window of the model ``wanted`` names on the server (a name, an alias;
    None: the server's default model, else its first), loaded (``POST /models/load``) when its
    window is not known yet (``key_source``: where ``api_key`` came from, None for the placeholder).
    ``model_file``: the GGUF file ``wanted`` is the stem of, given to a server that was running
    already.

    Raises:
        LaunchError: the server has no such model (for ``model_file``, saying that the server names
            its models, not their files: ``GET /v1/models`` gives no file, so a preset that serves
            the file under another name cannot be found by it), or it cannot be loaded (one line).
    """
    unnamed = ("" if model_file is None else
               f" (--model {model_file} asks for its file's name: the server names its models, not their files, and"
               " may serve that file under another; give that name, --model NAME)")
    named = wanted is not None
    if wanted is None:
        wanted = _get(client, url, "/health", api_key, key_source).json().get("model")
    if wanted is None:
        listed = _get(client, url, "/v1/models", api_key, key_source).json().get("data") or [{}]
        wanted = str(listed[0].get("id", ""))
    for _ in range(2):
        model = _model_json(client, url, api_key, key_source, wanted, unnamed)
        if named and not _names(model, wanted):  # the server's fallback to its default model
            listed = _get(client, url, "/v1/models", api_key, key_source).json().get("data") or []
            raise LaunchError(f"{url}: no model {wanted!r} there (a request for it gets {model['id']}); the models "
                              f"are: {', '.join(sorted(str(m.get('id')) for m in listed))}{unnamed}")
        if "max_input_tokens" in model:
            return str(model["id"]), int(model["max_input_tokens"])
        loaded = _get(client, url, "/models/load", api_key, key_source, {"model": model["id"]})
        if loaded.status_code not in (200, 400):  # (400: loaded meanwhile)
            said = loaded.json().get("error", {}).get("message")  # ("the model 'X' cannot be loaded: why")
            if not said:
                said = f"the model {model['id']!r} cannot be loaded ({loaded.status_code})"
            raise LaunchError(f"{url}: {said}")
    raise LaunchError(f"{url}/v1/models/{wanted} does not give the model's context window (max_input_tokens): "
                      "a ringserve older than this launcher?")


def model_named(client: httpx.Client, url: str, api_key: str, key_source: str | None,
                wanted: str) -> tuple[str, bool]:
    """The id of the model a request naming ``wanted`` gets, and whether ``wanted`` names it (False:
    the server's fallback to its default model).

    Raises:
        LaunchError: the key was refused, or the server answered an error (its message: a 404 where
            ``[router] strict_model_name`` is set).
    """
    model = _model_json(client, url, api_key, key_source, wanted)
    return str(model["id"]), _names(model, wanted)


def _model_json(client: httpx.Client, url: str, api_key: str, key_source: str | None, wanted: str,
                hint: str = "") -> dict[str, Any]:
    """``GET /v1/models/{wanted}``'s model; an error answer is a :class:`LaunchError` with its
    message (and ``hint`` for a 404), and so is an empty name (``/v1/models/`` names no model)."""
    if not wanted:
        raise LaunchError("the model's name is empty: give one of the server's (ringserve ls)")
    path = f"/v1/models/{quote(wanted, safe='')}"
    response = _get(client, url, path, api_key, key_source)
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", "") if response.content else ""
        raise LaunchError(f"{url}: {message or f'GET {path} answered {response.status_code}'}"
                          f"{hint if response.status_code == 404 else ''}")
    model: dict[str, Any] = response.json()
    return model


def _names(model: dict[str, Any], name: str) -> bool:
    """Whether ``GET /v1/models/{name}``'s ``model`` is the one ``name`` names, not the fallback: its
    id, an alias, or an alias pattern that matches (as ``Catalog.find`` matches, ``fnmatch``)."""
    aliases = [str(alias) for alias in model.get("aliases", ())]
    return name == model.get("id") or any(fnmatch.fnmatchcase(name, alias) for alias in aliases)


class ServerChild:
    """``ringserve serve`` started by the launcher: its own session, output in ``log``."""

    def __init__(self, argv: Sequence[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self, drain_timeout: float) -> None:
        """SIGTERM (the server drains, up to ``drain_timeout`` s), then SIGKILL if it is still there."""
        self.proc.terminate()
        try:
            self.proc.wait(drain_timeout + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_ready(client: httpx.Client, url: str, child: ServerChild | None) -> None:
    """Wait until the server at ``url`` is ready (its model loaded): the one the launcher started
    (``child``), or one that answered but was loading."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    where = url if child is None else f"{url} (log: {child.log})"
    while (state := _readiness(client, url)) is not _Readiness.READY:
        if child is not None and (status := child.proc.poll()) is not None:
            lines = child.log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise LaunchError(f"the server exited with status {status}: {lines[-1]} (log: {child.log})")
        if child is None and state is _Readiness.NONE:
            raise LaunchError(f"the server at {url} went away while it was loading")
        if time.monotonic() > deadline:
            raise LaunchError(f"the server at {where} is not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


@attrs.define
class ServerUse:
    """A command's use of the server at ``url``, from :func:`open_server` to :meth:`end`.

    Attributes:
        url: the server's URL.
        child: the server this command started (None: one that ran already).
        log: the log of a server a command starts at that port (``server-PORT.log``); beside it
            ``server-PORT.pid`` names the server while a command's server runs there (its pid and
            start time: written when it starts, removed when it stops or is kept for good).
        lock: this command's shared lock on ``server-PORT.use.lock``, held while it uses the
            server, so that the last command to end can tell it is the last.
    """

    url: str
    child: ServerChild | None
    log: Path
    lock: IO[str]

    @property
    def handed(self) -> Path:
        return self.log.with_suffix(".pid")

    def end(self, keep: bool, drain_timeout: float, err: TextIO) -> None:
        """End this command's use. The last command to use a server a command started stops it
        (SIGTERM: it drains, up to ``drain_timeout`` s): the one that started it, or, where that one
        ended first (or was killed), the last of the others. ``keep`` (``--keep-server``,
        ``launch --print``) leaves it running for good, whichever command started it; a line on
        ``err`` says where a server left running is."""
        self.lock.close()
        with open(self.lock.name, "w") as alone:
            try:
                fcntl.flock(alone, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while a server drains: a
            except BlockingIOError:                                # command that comes then waits
                last = False
            else:
                last = True
            pid = self.child.proc.pid if self.child is not None else _handed_pid(self.handed)
            if pid is None or (self.child is not None and self.child.proc.poll() is not None):
                if last:  # (what is left of a server that has exited)
                    self.handed.unlink(missing_ok=True)
                return  # a server started by hand (never stopped here), or one that has exited
            if not keep and not last:
                if self.child is not None:
                    print(f"ringserve: the server goes on at {self.url} (pid {pid}; log: {self.log}): another"
                          " ringserve command uses it, and the last to end stops it", file=err)
                return
            if not keep and not self.handed.exists():  # (the command started it, and another kept it)
                print(f"ringserve: the server goes on at {self.url} (pid {pid}; log: {self.log}): another"
                      " ringserve command kept it (--keep-server)", file=err)
                return
            self.handed.unlink(missing_ok=True)
            if keep:
                print(f"ringserve: the server goes on at {self.url} (pid {pid}; log: {self.log})", file=err)
            elif self.child is not None:
                self.child.stop(drain_timeout)
            else:
                _stop(pid, drain_timeout)


def _handed_pid(handed: Path) -> int | None:
    """The pid ``handed`` names while it is that process's (the same start time: a pid is used
    again only by a process started later), else None."""
    try:
        pid, started = handed.read_text().split()
        return int(pid) if _started(int(pid)) == started else None
    except (OSError, ValueError):  # no such file, or the server has gone
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/PID/stat``'s 22nd field, in clock ticks since boot),
    None when it has exited (a zombie has: not every init reaps)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _stop(pid: int, drain_timeout: float) -> None:
    """Stop the server ``pid`` (another command's child: SIGTERM, SIGKILL after ``drain_timeout`` and
    10 s), and wait until it has exited."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout + 10
    while _started(pid) is not None:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.1)


def open_server(client: httpx.Client, url: str, config_path: Path | None, url_arg: str | None, *,
                drain_timeout: float, serve: Sequence[str] = SERVE, err: TextIO = sys.stderr,
                model_file: Path | None = None, models_dir: str | None = None) -> ServerUse:
    """The server at ``url`` once it is ready: the one running there, or one started as ``serve``
    with ``model_file``, ``models_dir`` (``--models-dir``), ``config_path`` and the host and port of
    ``url_arg`` (``--url``), in a session of its own with its output in a log file; a line on ``err``
    says so. ``ringserve launch`` and ``ringserve run`` use it, and end the use with
    :meth:`ServerUse.end`.

    Commands share a server at a port through two locks beside its log: one command starts it at a
    time (a second one, run meanwhile, waits for that server and uses it, where both started one on
    one log file and the second failed on the port in use), and each holds a shared lock while it
    uses it, so the server is stopped by the command that started it only once no other uses it.

    Raises:
        LaunchError: a server that exited or did not become ready (one it started is stopped
            first, given ``drain_timeout`` seconds), a URL no server can be started at.
    """
    parts = urlsplit(url)
    log = platformdirs.user_log_path("ringserve") / f"server-{parts.port or _DEFAULT_PORTS[parts.scheme]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    use = open(log.with_suffix(".use.lock"), "w")
    try:
        try:
            fcntl.flock(use, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ringserve: the server at {url} is stopping; waiting for it", file=err)
            fcntl.flock(use, fcntl.LOCK_SH)
        with open(log.with_suffix(".start.lock"), "w") as start:
            readiness = _readiness(client, url)
            if readiness is _Readiness.NONE:
                try:
                    fcntl.flock(start, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"ringserve: another command is starting a server at {url}; waiting for it", file=err)
                    fcntl.flock(start, fcntl.LOCK_EX)  # held until that server is ready, or has failed
                    readiness = _readiness(client, url)
            if readiness is not _Readiness.NONE:
                _wait_ready(client, url, None)
                return ServerUse(url, None, log, use)
            config_path = None if config_path is None else config_path.resolve()
            child = ServerChild([*serve, *_serve_args(config_path, url_arg, model_file, models_dir)], log)
            served = ServerUse(url, child, log, use)
            try:  # named at once: a command that uses it stops it last, also where this one is killed
                served.handed.write_text(f"{child.proc.pid} {_started(child.proc.pid)}\n")
                print(f"ringserve: no server at {url}; starting one (log: {log})", file=err)
                _wait_ready(client, url, child)
            except BaseException:
                child.stop(drain_timeout)
                served.handed.unlink(missing_ok=True)
                raise
            return served
    except BaseException:
        use.close()
        raise


def _codex_catalog(program: str | None, env: Mapping[str, str], served: Served, err: TextIO) -> Path | None:
    """Write the served model's Codex catalog (a file named by its content, in the user's cache) and
    return its path; None, with a warning, when Codex's own catalog cannot be read or lacks the
    template model."""
    why = "Codex is not installed"
    if program is not None:
        done = subprocess.run([program, "debug", "models", "--bundled"], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60)
        why = f"`codex debug models --bundled` failed (status {done.returncode})"
        if done.returncode == 0:
            try:
                entry = codex_model_entry(json.loads(done.stdout), served)
            except (ValueError, AttributeError):
                entry = None
            why = f"Codex's bundled catalog has no {CODEX_TEMPLATE} to copy"
            if entry is not None:
                text = json.dumps({"models": [entry]}, ensure_ascii=False)
                path = (platformdirs.user_cache_path("ringserve") / "codex"
                        / f"catalog-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                return path
    print(f"ringserve: warning: {why}: Codex gets no metadata for {served.model} (so no apply_patch tool)", file=err)
    return None


def _exit_on(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def ended_by_signals() -> Iterator[None]:
    """Within it, SIGTERM and SIGHUP (a terminal closed) raise ``SystemExit(128 + N)``, so that a
    command's ``finally`` blocks run (a server it started is stopped, or handed on) where the signal
    would end the process at once. Elsewhere than on the main thread (a test's) it does nothing:
    only that thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _exit_on) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _dies_with_launcher() -> Callable[[], None] | None:
    """What the agent's child process runs before it execs, on Linux: it asks for SIGTERM when the
    launcher dies (``prctl(PR_SET_PDEATHSIG)``, ``prctl(2)``), or takes it at once if the launcher
    died before that; None elsewhere.

    A launcher killed by SIGKILL (a test harness's or ``timeout -s KILL``'s) cannot pass the signal
    on: the agent would go on as an orphan, reading its stream, which keeps the generation a reader
    and its slot busy to the reply's end (minutes on a small CPU model), while its user sees the
    command gone. SIGTERM ends Claude Code and Codex, which close their connection.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    launcher = os.getpid()

    def die_with_launcher() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return die_with_launcher


def _run_agent(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the agent to its end; the exit status (128 + N after signal N).

    Ctrl-C is the agent's (the terminal sends SIGINT to it directly; Claude Code reads a second one
    as "quit"), so the launcher ignores it; SIGTERM and SIGHUP sent to the launcher are passed on,
    and on Linux the agent gets SIGTERM when the launcher dies of any other cause
    (:func:`_dies_with_launcher`).
    """
    agent = subprocess.Popen(argv, env=dict(env), preexec_fn=_dies_with_launcher())

    def forward(signum: int, _frame: FrameType | None) -> None:
        agent.send_signal(signum)

    handlers = {signal.SIGINT: lambda _signum, _frame: None, signal.SIGTERM: forward, signal.SIGHUP: forward}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        status = agent.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status if status >= 0 else 128 - status


def run(args: argparse.Namespace, *, serve: Sequence[str] = SERVE) -> int:
    """``ringserve launch``: find or start the server, then run the agent or print its settings.

    ``serve`` is the command that starts a server, to which ``--models-dir``, the config and the
    ``--url``'s host and port are appended.
    """
    with ended_by_signals():
        return _launch(args, serve)


def _launch(args: argparse.Namespace, serve: Sequence[str]) -> int:
    out, err = sys.stdout, sys.stderr
    agent = Agent(args.agent)
    info = AGENTS[agent]
    use: ServerUse | None = None
    keep = False  # leave the server it started running (once the launcher has done its part)
    try:
        try:  # as `ringserve serve` reads it: the file, then the RINGSERVE_* variables
            config: Config = args.load_config(argparse.Namespace(config=args.config, model_file=None,
                                                                 models_dir=args.models_dir))
        except (OSError, ValueError) as exc:
            raise LaunchError(str(exc)) from None
        url = server_url(config) if args.url is None else check_url(args.url)
        api_key, key_source = configured_key(args.api_key, config) or (PLACEHOLDER_KEY, None)
        program = find_agent(info, os.environ.get("PATH"), PINNED_BIN)
        if program is None and not args.print:
            raise _missing(info)
        model_file, wanted = model_arg(args.model)
        with httpx.Client(timeout=10) as client:
            use = open_server(client, url, args.config, args.url, drain_timeout=config.server.drain_timeout,
                              serve=serve, err=err, model_file=model_file, models_dir=args.models_dir)
            model, context_window = served_model(client, url, api_key, key_source, wanted,
                                                 model_file if use.child is None else None)
            small = None if args.small_model is None else served_model(
                client, url, api_key, key_source, args.small_model)[0]
        served = Served(url, model, context_window, api_key, config.server.max_stream_seconds or AGENT_TIMEOUT_S,
                        small)
        warning = context_warning(agent, served)
        if warning is not None:
            print(warning, file=err)
        env = {**os.environ}
        match agent:
            case Agent.CLAUDE:
                settings = claude_settings(served, env)
            case Agent.CODEX:
                settings = codex_settings(served, _codex_catalog(program, env, served, err))
            case _:
                assert_never(agent)
        # Printed settings point at the server; --keep-server keeps it for the agent's next run.
        keep = args.keep_server or args.print
        if args.print:
            out.write(render(agent, served, settings))
            return 0
        assert program is not None
        return _run_agent([program, *settings.args, *args.agent_args], env | settings.env)
    except LaunchError as exc:
        print(f"ringserve: {exc}", file=err)
        return 2
    except KeyboardInterrupt:  # (while a server starts: the agent's own Ctrl-C never reaches here)
        print(file=err)
        return 130
    finally:
        if use is not None:  # where the launcher failed, no server it started is left behind
            use.end(keep, config.server.drain_timeout, err)


def model_arg(model: str | None) -> tuple[Path | None, str | None]:
    """``--model``: a GGUF file (a server started here serves it; its name is the file's stem) and
    the name to ask for, or a name of the server's models; None: the server's default model. A
    link keeps its own name (not resolved: the server names the model by the path it is given, as
    for a link in a models_dir or in the Hugging Face cache's snapshots)."""
    if model is None:
        return None, None
    path = Path(model).expanduser()
    if model.endswith(".gguf") and path.is_file():
        return path.absolute(), path.name.removesuffix(".gguf")
    return None, model


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``launch ... -- AGENT ARGS`` split at its first ``--`` (argparse in Python 3.11 loses a
    ``--`` in a subcommand's arguments, and every later one); other commands are left whole."""
    argv = list(argv)
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def add_command(sub: Any, load_config: Callable[[argparse.Namespace], Config]) -> None:
    """Register ``launch`` on the CLI's subparsers (it sets ``client_command``, as ``chat`` does); it
    reads the configuration with ``load_config`` (``__main__.load_config``: the file and the
    ``RINGSERVE_*`` variables, as the server it may start reads them)."""
    about = "run Claude Code or Codex CLI on ringserve, starting the server if none runs"
    launch = sub.add_parser("launch", help=about, description=f"{about[0].upper()}{about[1:]} (docs/agents.md, Launch).",
                            epilog="Arguments after -- go to the agent: ringserve launch codex -- exec --skip-git-repo-check 'Say hi'")
    launch.add_argument("agent", choices=tuple(Agent), help="the agent")
    launch.add_argument("--config", type=Path, help="TOML config file, for the URL, the key and a server to start")
    launch.add_argument("--models-dir", help="a folder of GGUF models, for a server to start (as ringserve serve's)")
    launch.add_argument("--url", default=os.environ.get("RINGSERVE_URL"),
                        help="the server's URL (default $RINGSERVE_URL, else the config's host and port)")
    launch.add_argument("--api-key", default=os.environ.get("RINGSERVE_API_KEY"),
                        help="API key (default $RINGSERVE_API_KEY, else the config's first key)")
    launch.add_argument("--model", help="the model: a name of the server's models, or a GGUF file (a server started"
                        " here serves it); default: the server's default model")
    launch.add_argument("--small-model", help="Claude Code's model for its small background calls (titles, checks;"
                        " a name of the server's models); default: --model")
    launch.add_argument("--keep-server", action="store_true", help="leave a server this command started running (--print always does)")
    launch.add_argument("--print", action="store_true", help="print the agent's settings instead of running it")
    launch.set_defaults(client_command=run, agent_args=[], load_config=load_config)

