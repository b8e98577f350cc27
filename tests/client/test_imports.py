"""The client is a layer of its own: it imports nothing of the server but ``ringserve.core``, so
importing it (and running ``ringserve chat``) never loads the native llama library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ringserve.client

CLIENT = Path(ringserve.client.__file__).parent


def test_the_client_imports_only_itself_and_core() -> None:
    imported = set()
    for path in sorted(CLIENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions included
            if isinstance(node, ast.Import):
                imported |= {(path.name, alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add((path.name, node.module))
    ours = {(name, module) for name, module in imported if module.split(".")[0] == "ringserve"}
    assert ours and {(name, m) for name, m in ours
                     if not m.startswith(("ringserve.client", "ringserve.core"))} == set()


def test_importing_the_client_and_the_cli_does_not_load_llama_cpp() -> None:
    code = ("import sys; sys.modules['llama_cpp'] = None  # any import of it raises ImportError\n"
            "import ringserve.client, ringserve.__main__\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('ringserve'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=CLIENT.parent.parent)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert "ringserve.client._trio" in loaded and "ringserve.client.cli" in loaded
    assert "ringserve.library" in loaded and "ringserve.launch" in loaded
    server_side = ("ringserve.http", "ringserve.live", "ringserve.server", "ringserve.store",
                   "ringserve.engine.llama", "ringserve.engine.runner", "ringserve.surfaces")
    assert [m for m in loaded if m.startswith(server_side)] == []  # the library's catalog reads names only
