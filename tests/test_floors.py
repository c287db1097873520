"""The floors: kernels/ < engine/ < app/ (the services) < app/gui/ (the window). Nothing imports a floor above
its own, the engine imports no Qt and no NVML, the services import no Qt when they load, and no two modules
import each other (directly or round a longer circle). Every import statement counts, at module level or
inside a function (a lazy import is still an edge), read with `ast` without importing anything.

One upward edge is allowed, and only inside a function: a service may open the window on demand (the
`specdeck` command with no subcommand calls app.gui.main.run_app). At module level it would load Qt."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "app")
FLOORS = {"kernels": 1, "engine": 2, "app": 3, "app.gui": 4}
QT = {"PySide6", "pyqtgraph"}
# Third-party packages a floor may not import: the GUI toolkit and the GPU monitor belong to the app.
FORBIDDEN = {
    "kernels": QT | {"pynvml", "platformdirs"},
    "engine": QT | {"pynvml"},
}
# (from floor, to floor) edges allowed inside a function only: a service opening the window.
LAZY_UPWARD = {(3, 4)}

# Known violations: none since the command line and the tuning services (profiles, workloads, bench,
# tune, threads) moved from engine/ into app/. A new upward edge fails the test.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
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


def _import_nodes(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it runs when the module loads (not inside a function)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, at_load))
            inside = at_load and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inside)

    visit(tree, True)
    return found


def imports(module: str, at_load_only: bool = False) -> tuple[set[str], set[str]]:
    """(our modules, top-level third-party names) that `module` imports anywhere in its source (with
    at_load_only: only the imports that run when it loads, outside functions)."""
    path = MODULES[module]
    ours: set[str] = set()
    other: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node, at_load in _import_nodes(ast.parse(path.read_text(), str(path))):
        if at_load_only and not at_load:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            # `from pkg import name`: the submodule when `name` is one, else the module itself
            targets = [
                f"{base}.{a.name}" if _ours(f"{base}.{a.name}") not in (None, _ours(base)) else base for a in node.names
            ]
        for target in targets:
            mine = _ours(target)
            if mine is None:
                other.add(target.split(".")[0])
            elif mine != module:
                ours.add(mine)
    return ours, other


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS[".".join(parts[:2])] if ".".join(parts[:2]) in FLOORS else FLOORS[parts[0]]


GRAPH = {m: imports(m) for m in MODULES}
AT_LOAD = {m: imports(m, at_load_only=True) for m in MODULES}
SERVICES = sorted(m for m in MODULES if m.split(".")[0] == "app" and _floor(m) == FLOORS["app"])


def test_the_walk_sees_every_floor():
    assert {"kernels.ops", "kernels.cuda", "engine.engine", "engine.spec", "app.cli", "app.gui.window"} <= set(MODULES)
    assert "kernels.ops" in GRAPH["engine.model"][0] and "kernels.cuda" in GRAPH["kernels.ops"][0]
    assert "PySide6" in GRAPH["app.gui.window"][1]
    assert [_floor(m) for m in ("kernels.ops", "engine.spec", "app.cli", "app.gui", "app.gui.window")] == [
        1,
        2,
        3,
        4,
        4,
    ]
    assert "app.gui.main" in GRAPH["app.cli"][0] and "app.gui.main" not in AT_LOAD["app.cli"][0]  # lazy


def test_no_upward_edge():
    upward = []
    for module, (ours, other) in GRAPH.items():
        lazy_ok = {t for t in ours - AT_LOAD[module][0] if (_floor(module), _floor(t)) in LAZY_UPWARD}
        upward += [(module, t) for t in ours - lazy_ok if _floor(t) > _floor(module)]
        upward += [(module, t) for t in other if t in FORBIDDEN.get(module.split(".")[0], ())]
    assert sorted(set(upward) - ALLOWED) == [], "an import points up a floor (or engine/kernels import Qt/NVML)"


def test_engine_and_kernels_import_nothing_from_the_app():
    edges = [(m, t) for m, (ours, _) in GRAPH.items() if _floor(m) < FLOORS["app"] for t in ours if t.startswith("app")]
    assert edges == []


def test_the_services_import_no_qt_when_they_load():
    """app/ outside app/gui/ loads without Qt: no PySide6 or pyqtgraph, and no app.gui module, imported at
    module level (inside a function, only when PySide6 is there: the window opened on demand)."""
    loading_qt = []
    for module in SERVICES:
        ours, other = AT_LOAD[module]
        loading_qt += [(module, t) for t in other & QT]
        loading_qt += [(module, t) for t in ours if _floor(t) == FLOORS["app.gui"]]
    assert SERVICES and loading_qt == []


def test_the_services_load_without_qt_in_a_fresh_interpreter():
    """The same rule, checked by importing every service (transitively: whatever they import) in a new
    Python and looking for Qt in sys.modules."""
    services = [m for m in SERVICES if m != "app.__main__"]  # __main__ runs the command
    code = (
        "import importlib, sys\n"
        f"for name in {services!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in ('PySide6', 'pyqtgraph') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


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
