"""The floors: kernels/ < engine/ < app/. Nothing imports a floor above its own, the engine imports no Qt and
no NVML, and no two modules import each other (directly or round a longer circle). Every import statement
counts, at module level or inside a function (a lazy import is still an edge), read with `ast` without
importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"kernels": 1, "engine": 2, "app": 3}
# Third-party packages a floor may not import: the GUI toolkit and the GPU monitor belong to the app.
FORBIDDEN = {
    "kernels": {"PySide6", "pyqtgraph", "pynvml", "platformdirs"},
    "engine": {"PySide6", "pyqtgraph", "pynvml"},
}

# Known violations: none since the command line and the tuning services (profiles, workloads, bench,
# tune, threads) moved from engine/ into app/. A new upward edge fails the test.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in FLOORS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The longest prefix of `name` that is one of our modules."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def imports(module: str) -> tuple[set[str], set[str]]:
    """(our modules, top-level third-party names) that `module` imports anywhere in its source."""
    path = MODULES[module]
    ours: set[str] = set()
    other: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            # `from pkg import name`: the submodule when `name` is one, else the module itself
            targets = [
                f"{base}.{a.name}" if _ours(f"{base}.{a.name}") not in (None, _ours(base)) else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            mine = _ours(target)
            if mine is None:
                other.add(target.split(".")[0])
            elif mine != module:
                ours.add(mine)
    return ours, other


GRAPH = {m: imports(m) for m in MODULES}


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def test_the_walk_sees_every_floor():
    assert {"kernels.ops", "kernels.cuda", "engine.engine", "engine.spec", "app.window"} <= set(MODULES)
    assert "kernels.ops" in GRAPH["engine.model"][0] and "kernels.cuda" in GRAPH["kernels.ops"][0]
    assert "PySide6" in GRAPH["app.window"][1]


def test_no_upward_edge():
    upward = []
    for module, (ours, other) in GRAPH.items():
        upward += [(module, t) for t in ours if _floor(t) > _floor(module)]
        upward += [(module, t) for t in other if t in FORBIDDEN.get(module.split(".")[0], ())]
    assert sorted(set(upward) - ALLOWED) == [], "an import points up a floor (or engine/kernels import Qt/NVML)"


def test_the_allow_list_holds_only_real_violations():
    """When a known violation is fixed, its entry must go (so the list only shrinks)."""
    for module, target in ALLOWED:
        ours, other = GRAPH[module]
        assert target in ours | other, f"{module} no longer imports {target}: remove it from ALLOWED"


def test_no_import_circle():
    """Tarjan's strongly connected components over our modules: every component must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == [], f"modules that import each other: {circles}"
