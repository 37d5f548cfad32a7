"""The shape of the package, checked from the source (no model, a second): no module in ``zpp/``
over 600 lines and none in ``zpp/server/`` over 400; the stage workers import nothing of the
front end (``zpp.server``, ``zpp.frontend``, ``zpp.llm``) nor the engine core of the front end's
process; no import cycle between zpp modules, counting imports inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES, MAX_SERVER_LINES = 600, 400

# Known exceptions (none now: bench/serve.py is split, the cli <-> bench cycle is gone); an entry
# added here must be deleted when it no longer applies (the test then says so).
KNOWN_LONG: set[str] = set()
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "zpp").rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The zpp modules ``name`` imports anywhere in its source (``from pkg import mod`` counts as
    importing ``pkg.mod`` when that is a module)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = f"{parent}.{base}" if base else parent
            for a in node.names:
                deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {d for d in deps if d in known and d != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_too_long():
    long = {}
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > (MAX_SERVER_LINES if name.startswith("zpp.server.") else MAX_LINES):
            long[name] = lines
    assert set(long) == KNOWN_LONG, long


def test_workers_import_no_front_end():
    graph = _graph()
    bad = {name: sorted(d for d in deps if d.startswith(("zpp.server", "zpp.frontend", "zpp.llm", "zpp.engine")))
           for name, deps in graph.items() if name.startswith("zpp.workers")}
    assert not any(bad.values()), bad


def test_engine_core_imports_no_server():
    graph = _graph()
    bad = {name: sorted(d for d in deps if d.startswith(("zpp.server", "zpp.llm")))
           for name, deps in graph.items() if name.startswith(("zpp.engine", "zpp.frontend"))}
    assert not any(bad.values()), bad


def test_no_import_cycle():
    assert _cycles(_graph()) == KNOWN_CYCLES
