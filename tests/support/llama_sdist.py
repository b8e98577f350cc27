"""llama.cpp's chat-template corpus and chat tests, from the llama-cpp-python source distribution.

The templates (``vendor/llama.cpp/models/templates/*.jinja``) and the canned model outputs of
``vendor/llama.cpp/tests/test-chat.cpp`` are third-party files: they are not in the repository
but read from the sdist of the installed llama-cpp-python, which pip downloads into a cache
folder (``$XDG_CACHE_HOME/ringserve`` or the repository's ``.cache/``) the first time each is
asked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class CorpusUnavailable(Exception):
    """pip could not download the source distribution (no network, no index)."""


def llama_cpp_templates() -> Path:
    """The folder of the corpus templates of the installed llama-cpp-python's sdist.

    Raises:
        CorpusUnavailable: the download failed (the message holds pip's last lines).
    """
    return _extracted("templates", lambda parts: parts[-2:-1] == ["templates"] and parts[-1].endswith(".jinja")
                      and parts[-5:-2] == ["vendor", "llama.cpp", "models"])


def llama_cpp_chat_tests() -> Path:
    """llama.cpp's ``tests/test-chat.cpp`` (its canned model outputs) from the same sdist.

    Raises:
        CorpusUnavailable: the download failed.
    """
    folder = _extracted("chat-tests", lambda parts: parts[-4:] == ["vendor", "llama.cpp", "tests", "test-chat.cpp"])
    return folder / "test-chat.cpp"


def _extracted(what: str, wanted: Callable[[list[str]], bool]) -> Path:
    """A cache folder holding the sdist's files whose path (split at ``/``) is ``wanted``,
    flat; pip downloads the sdist the first time."""
    release = version("llama-cpp-python")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or REPO / ".cache") / "ringserve"
    folder = cache / f"llama-cpp-python-{release}-{what}"
    if (folder / ".complete").exists():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={release}", "-d", tmp],
            capture_output=True, text=True,
        )
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if pip.returncode != 0 or not archives:
            raise CorpusUnavailable(f"pip download llama-cpp-python=={release} failed: {pip.stderr[-500:]}")
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if member.isfile() and wanted(parts):
                    source = tar.extractfile(member)
                    assert source is not None
                    (folder / parts[-1]).write_bytes(source.read())
    (folder / ".complete").touch()
    return folder
