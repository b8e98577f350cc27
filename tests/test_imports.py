"""What importing a module loads: the client, the surfaces and the core never load llama-cpp-python
(the native llama library), so ``ringserve chat`` and a program that only talks to a server start
without it. Each import runs in a fresh interpreter where importing ``llama_cpp`` raises."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import ringserve.core

ROOT = Path(__file__).resolve().parent.parent

BLOCK = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError(f"{name} is blocked by tests/test_imports.py")
        return None

sys.meta_path.insert(0, Blocked())
"""

CORE = sorted(f"ringserve.core.{m.name}" for m in pkgutil.iter_modules(ringserve.core.__path__))


def imports_without_llama_cpp(*modules: str) -> subprocess.CompletedProcess[str]:
    code = BLOCK + "".join(f"import {m}\n" for m in modules) + "assert 'llama_cpp' not in sys.modules\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "modules",
    [("ringserve.client",), ("ringserve.__main__",), ("ringserve.surfaces.registry",), CORE,
     ("ringserve.library",)],
    # the CLI: what `ringserve chat` and `ringserve tail` import; the library: `ringserve pull`, `ls`, `run`
    ids=["client", "cli", "surfaces", "core", "library"],
)
def test_imports_without_llama_cpp(modules):
    done = imports_without_llama_cpp(*modules)
    assert done.returncode == 0, done.stderr


def test_the_block_works():
    done = imports_without_llama_cpp("ringserve.engine.gbnf")
    assert done.returncode != 0 and "llama_cpp is blocked by tests/test_imports.py" in done.stderr
