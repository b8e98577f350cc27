"""The sync shell is what ``scripts/unasync.py`` writes from the Trio shell (httpcore's ``--check``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "unasync.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_shell_is_generated_from_the_trio_shell() -> None:
    script = load_script()
    text, used = script.unasync(script.SOURCE.read_text())
    assert script.TARGET.read_text() == text, "ringserve/client/_sync.py is stale: run python scripts/unasync.py"
    assert used == set(range(len(script.SUBS)))  # every substitution still has work to do
    assert script.main(["--check"]) == 0


def test_the_substitutions_take_the_async_out() -> None:
    script = load_script()
    text, _ = script.unasync("    async def __anext__(self) -> AsyncGenerator[StreamEvent, None]:\n"
                             "        await TrioBackend.sleep(1)  # the Trio shell\n")
    assert text == script.HEADER + ("    def __next__(self) -> Generator[StreamEvent, None, None]:\n"
                                    "        SyncBackend.sleep(1)  # the sync shell\n")
