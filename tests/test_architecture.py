"""The package's layering (ARCHITECTURE.md): imports run downward only, no module circles, nothing imports the CLI.

Layers, top to bottom: cli → stages (and workflow, the Snakefile's helper) → render → runtime → predictors →
metrics → traces → models → data → config → contracts → io. A module may import its own layer or any layer below;
an import of a higher layer (lazy imports inside functions included) fails this test, naming the line.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "specprefetch"
LAYERS = [("cli", "__main__"), ("stages", "workflow"), ("render",), ("runtime",), ("predictors",), ("metrics",),
          ("traces",), ("models",), ("data",), ("config",), ("contracts", "registry"), ("io", "_lazy", "__init__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute specprefetch import, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specprefetch"):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("specprefetch")]
    return out


def test_every_module_has_a_layer() -> None:
    unknown = sorted({m.split(".")[1] for m in _modules() if "." in m} - set(RANK))
    assert not unknown, f"add these to LAYERS (and ARCHITECTURE.md): {unknown}"


def test_imports_run_downward() -> None:
    bad = []
    for module, path in _modules().items():
        for line, target, _ in _imports(path):
            if _layer(target) < _layer(module):
                bad.append(f"{path.relative_to(REPO)}:{line}: {module} imports {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


# Inside the runtime, its groups (ARCHITECTURE.md): the lm-eval client over the simulation over the measurement over
# the core. The group package itself (``runtime``) is the lowest: it only re-exports the core lazily.
RUNTIME_GROUPS = ["lm_eval_model", "simulation", "measurement", "core"]


def _runtime_group(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["specprefetch", "runtime"]:
        return None
    return RUNTIME_GROUPS.index(parts[2]) if len(parts) > 2 else len(RUNTIME_GROUPS)


def test_every_runtime_module_is_in_a_group() -> None:
    loose = sorted(m for m in _modules() if m.startswith("specprefetch.runtime.")
                   and m.split(".")[2] not in RUNTIME_GROUPS)
    assert not loose, f"put these in a runtime group (core, measurement, simulation) or add it here: {loose}"


def test_runtime_groups_import_downward() -> None:
    bad = []
    for module, path in _modules().items():
        mine = _runtime_group(module)
        if mine is None:
            continue
        for line, target, _ in _imports(path):
            theirs = _runtime_group(target)
            if theirs is not None and theirs < mine:
                bad.append(f"{path.relative_to(REPO)}:{line}: {module} imports {target}")
    assert not bad, "imports against the runtime's groups:\n" + "\n".join(bad)


def test_no_module_circles() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for _, target, names in _imports(path):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            graph[module] |= set(subs) or ({target} if target in modules else set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_only_the_cli_imports_stages_and_nothing_imports_the_cli() -> None:
    bad = []
    for module, path in _modules().items():
        for line, target, _ in _imports(path):
            if target == "specprefetch.cli" and module != "specprefetch.__main__":
                bad.append(f"{path.relative_to(REPO)}:{line}")
            if target.startswith("specprefetch.stages") and _layer(module) > RANK["stages"]:
                bad.append(f"{path.relative_to(REPO)}:{line}")
    assert not bad, bad


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """The rule is not vacuous: an import of the runtime from the metrics is an upward one."""
    assert _layer("specprefetch.runtime.core.engine") < _layer("specprefetch.metrics")
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from specprefetch.runtime.core.engine import OffloadedRuntime\n")
    assert _imports(probe) == [(2, "specprefetch.runtime.core.engine", ["OffloadedRuntime"])]
    # and inside the runtime, the core importing the simulator is an upward one
    assert _runtime_group("specprefetch.runtime.simulation.simrun") < _runtime_group("specprefetch.runtime.core.layer")
