"""The import graph (DESIGN: types at the bottom, factories at the top, no
import cycle): module-level imports of every rayvllm module, read with ast."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Installed package name -> source folder (pyproject's package-dir).
ROOTS = {"rayvllm": REPO / "rayvllm", "rayvllm.actors": REPO / "actors", "rayvllm.kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "rayvllm" and parts and parts[0] in ("actors", "kernels"):
                continue
            out[name] = path
    return out


def _module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """rayvllm modules imported at module level (not inside functions, not
    under `if TYPE_CHECKING`)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _module_level_imports(path, modules) - {name} for name, path in modules.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_engine_types_sit_at_the_bottom() -> None:
    """The data types every layer shares import no engine layer; the
    executor base knows no executor class, not even inside a function."""
    graph = _graph()
    assert graph["rayvllm.messages.engine_types"] <= {"rayvllm.messages.request"}
    base = ast.parse((REPO / "rayvllm" / "executor" / "base.py").read_text())
    imported = {n.module for n in ast.walk(base) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith("rayvllm.executor.")}
    upward = ("rayvllm.engine.", "rayvllm.worker.")
    assert not {m for m in graph["rayvllm.core.sched.scheduler"] if m.startswith(upward)}
