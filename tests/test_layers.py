"""The layers of ringserve, enforced: every import between its modules runs along
:data:`ALLOWED`, llama-cpp-python is imported in one module, and no modules import each other
in a cycle.

The import graph comes from the source (``ast``), so every import counts: at module level,
under ``TYPE_CHECKING`` and inside functions. A group is a package under ``ringserve/``
(``core``, ``engine``, ...) or a top-level module (``config``, ``metrics``, ...). The table is
h11's "Rule 1" (its ``_connection.py`` header), written down where a test reads it. Seeded by
the import-graph script of the design review (``REVIEW.md``, appendix).
"""

from __future__ import annotations

import ast
import collections
import enum
from collections.abc import Iterator
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent / "ringserve"

#: group -> the groups its modules may import (besides its own). Read from the bottom up:
#: ``core`` is sans-I/O values and rules; ``formats`` the model families' chat formats; ``config``
#: the server's frozen configuration, importable by every server layer; ``engine`` the models and
#: the runner; ``surfaces`` the wire formats of the HTTP APIs; ``store``, ``logs`` and ``live``
#: what the server keeps (messages, their ring logs, the ones being generated); ``http`` the
#: routes; ``server`` the composition root; ``__main__`` the CLI. ``client`` is a library for
#: other processes: it reads wire formats from ``core`` only, never the server's modules; ``launch``
#: (an agent on a server) starts or finds the server as a process and talks to it over HTTP.
ALLOWED: dict[str, frozenset[str]] = {
    "ringserve": frozenset(),  # the package's __init__: the version only
    "core": frozenset(),
    "formats": frozenset({"core"}),
    "config": frozenset({"core"}),
    "engine": frozenset({"core", "formats", "config"}),
    "surfaces": frozenset({"core", "formats", "config"}),
    "store": frozenset({"core", "formats", "config"}),
    "logs": frozenset({"core", "formats", "config", "store"}),
    # the sources it watches are below the hub: it reads their statistics() values
    "metrics": frozenset({"core", "config", "engine", "store", "logs"}),
    "live": frozenset({"core", "formats", "config", "engine", "surfaces", "store", "logs", "metrics"}),
    "http": frozenset({"core", "formats", "config", "engine", "surfaces", "store", "logs", "live", "metrics"}),
    "server": frozenset({"core", "formats", "config", "engine", "surfaces", "store", "logs", "live", "metrics", "http"}),
    "client": frozenset({"core"}),
    "launch": frozenset({"core", "config", "client"}),  # `ringserve launch`: finds or starts a server over HTTP
    # `ringserve pull|ls|ps|rm|show|run`: the catalog and a GGUF's metadata, never libllama (tests/test_imports.py)
    "library": frozenset({"core", "formats", "config", "engine", "client", "launch"}),
    "__main__": frozenset(
        {"core", "formats", "config", "engine", "surfaces", "store", "logs", "live", "metrics", "http", "server", "client",
         "launch", "library"}
    ),
}

#: Edges that break :data:`ALLOWED` today, each with the work that removes it. The list only
#: shrinks: an edge listed here that no longer exists fails the test (delete its line).
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}

#: The only module that imports llama-cpp-python (every other takes it from there: see its docstring).
NATIVE = "ringserve.engine._native"

#: Modules only some others may import: what only tests need is never on a request's path.
IMPORTED_ONLY_BY = {
    "ringserve.engine.examples": {"ringserve.engine.fake"},  # the fake engine's replies to a grammar
}


class Kind(enum.StrEnum):
    RUNTIME = "runtime"
    TYPE_CHECKING = "TYPE_CHECKING"
    FUNCTION = "function-level"


@attrs.frozen
class Edge:
    source: str
    target: str
    kind: Kind
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.kind}, line {self.line})"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def group(module: str) -> str:
    """``ringserve.core.sse`` -> ``core``; ``ringserve.config`` -> ``config``; ``ringserve`` -> ``ringserve``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _marked(tree: ast.Module) -> tuple[set[int], set[int]]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (its body) and inside functions."""
    checking: set[int] = set()
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            nested |= {id(sub) for sub in ast.walk(node) if sub is not node}
    return checking, nested


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement names (a relative one made absolute)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def imports(mods: dict[str, Path]) -> Iterator[tuple[str, str, Kind, int]]:
    """``(module, imported name, kind, line)`` for every import statement in the package."""
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        checking, nested = _marked(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            kind = Kind.TYPE_CHECKING if id(node) in checking else Kind.FUNCTION if id(node) in nested else Kind.RUNTIME
            for name in _imported(node, module, path.name == "__init__.py"):
                yield module, name, kind, node.lineno


def edges() -> list[Edge]:
    """Every import of one ringserve module by another (the longest module prefix of each name)."""
    mods = modules()
    found = {}
    for module, name, kind, line in imports(mods):
        parts = name.split(".")
        target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods), None)
        if target is not None and target != module:
            found.setdefault((module, target, kind), Edge(module, target, kind, line))
    return sorted(found.values(), key=lambda e: (e.source, e.target, e.kind))


def violations() -> dict[tuple[str, str], list[Edge]]:
    """The edges :data:`ALLOWED` does not allow, by ``(source, target)``."""
    out: dict[tuple[str, str], list[Edge]] = collections.defaultdict(list)
    for edge in edges():
        source, target = group(edge.source), group(edge.target)
        if source != target and target not in ALLOWED[source]:
            out[(edge.source, edge.target)].append(edge)
    return out


def test_every_module_is_in_a_group_of_the_table():
    unplaced = sorted({group(m) for m in modules()} - ALLOWED.keys())
    assert not unplaced, f"place these in tests/test_layers.py ALLOWED: {unplaced}"
    assert all(targets <= ALLOWED.keys() for targets in ALLOWED.values())


def test_the_table_is_a_partial_order():
    """No two groups may import each other, directly or around a loop: a cycle of groups
    would allow a cycle of modules."""
    order: list[str] = []
    remaining = {g: set(targets) for g, targets in ALLOWED.items()}
    while remaining:
        ready = sorted(g for g, targets in remaining.items() if not targets & remaining.keys())
        assert ready, f"the groups {sorted(remaining)} allow each other around a loop"
        order += ready
        for g in ready:
            del remaining[g]
    assert order[0] in ("core", "ringserve")


def test_imports_run_down_the_layers():
    """Every import is one :data:`ALLOWED` allows, or a listed known violation."""
    found = violations()
    new = [str(e) for key, es in sorted(found.items()) if key not in KNOWN_VIOLATIONS for e in es]
    assert not new, "imports against the layers (tests/test_layers.py ALLOWED):\n" + "\n".join(new)


def test_known_violations_still_exist():
    """The known-violation list only shrinks: a fixed edge leaves it."""
    gone = sorted(set(KNOWN_VIOLATIONS) - set(violations()))
    assert not gone, f"fixed: delete these from KNOWN_VIOLATIONS in tests/test_layers.py: {gone}"


def test_only_the_native_module_imports_llama_cpp():
    importers = sorted(
        {module for module, name, _, _ in imports(modules()) if name.split(".")[0] == "llama_cpp"}
    )
    assert importers == [NATIVE]


def test_modules_for_tests_are_imported_only_where_listed():
    for module, importers in IMPORTED_ONLY_BY.items():
        found = {edge.source for edge in edges() if edge.target == module}
        assert found <= importers, f"{module} is imported by {sorted(found - importers)}"


def test_no_import_cycle():
    """No module reaches itself through runtime or ``TYPE_CHECKING`` imports (function-level
    ones run after both modules are loaded). A known violation is counted once, above."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for edge in edges():
        if edge.kind != Kind.FUNCTION and (edge.source, edge.target) not in KNOWN_VIOLATIONS:
            graph[edge.source].add(edge.target)
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], {start}
        while stack:
            node, path = stack.pop()
            for target in sorted(graph[node]):
                if target == start and start == min(path):
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
