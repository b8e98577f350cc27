"""llama.cpp's template corpus and chat tests, from the pinned llama-cpp-python source distribution.

The files are third-party: they are read at test time from the sdist that pip downloads
(``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION``) into a cache
folder, never copied into the repository. The cache is ``$RINGSERVE_CORPUS_CACHE`` or
``~/.cache/ringserve/corpus``; the download happens once (about 10 s and 70 MB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp is the reference."""

_NAME = f"llama_cpp_python-{VERSION}"
_PARTS = ("models/templates", "tests", "common", "docs/autoparser.md")
"""The parts of the vendored llama.cpp that are extracted (6 MB of its 180)."""


def _cache() -> Path:
    return Path(os.environ.get("RINGSERVE_CORPUS_CACHE", Path.home() / ".cache" / "ringserve" / "corpus"))


def llama_cpp() -> Path:
    """The vendored llama.cpp tree of the sdist, with only the parts in :data:`_PARTS`.

    Skips the calling test when pip cannot download the sdist (no network)."""
    root = _cache() / _NAME / "vendor" / "llama.cpp"
    if (root / "models" / "templates").is_dir():
        return root
    archive = _cache() / f"{_NAME}.tar.gz"
    if not archive.exists():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(_cache())],
            capture_output=True, text=True, check=False,
        )
        if done.returncode != 0 or not archive.exists():
            pytest.skip(f"cannot download the llama-cpp-python {VERSION} sdist: {done.stderr.strip()[-300:]}")
    prefixes = tuple(f"{_NAME}/vendor/llama.cpp/{part}" for part in _PARTS)
    with tarfile.open(archive) as tar:
        wanted = [m for m in tar.getmembers() if m.name.startswith(prefixes) and m.isfile()]
        tar.extractall(_cache(), members=wanted, filter="data")
    return root


def templates() -> dict[str, str]:
    """The corpus: each ``models/templates/*.jinja`` file's stem and its text."""
    folder = llama_cpp() / "models" / "templates"
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja"))}
