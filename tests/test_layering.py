"""The import graph: types at the bottom, features injected, the Ray layer
and the factories at the top, no cycle.

Every import of a rayvllm module counts, wherever it sits: module level,
under `if TYPE_CHECKING`, inside a function; relative imports are resolved,
and the installed names are mapped to their folders as pyproject's
package-dir maps them (`rayvllm.actors` is actors/, `rayvllm.kernels` is
kernels/). An import may point down `LAYERS` or sideways within one layer;
neither files nor folders (the top ones: rayvllm.core with core/sched) may
form a cycle.
"""

from __future__ import annotations

import ast
import functools
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The floors of docs/ARCHITECTURE.md, L0 (bottom) to L11. A module belongs to
# the layer of its longest listed prefix; `rayvllm` alone is the package root
# (__init__.py: the public API).
LAYERS: list[tuple[str, ...]] = [
    ("rayvllm.messages",),  # everything that crosses a process or package boundary
    # Config dataclasses and EngineArgs; utils (cache paths, tokenizer loading,
    # the demo model's checkpoint) sit beside them: EngineArgs builds the demo
    # model when none is given, and utils imports no config (no folder cycle).
    ("rayvllm.config", "rayvllm.utils"),
    ("rayvllm.kernels", "rayvllm.distributed"),
    ("rayvllm.layers", "rayvllm.models"),
    ("rayvllm.core",),  # block pool, KV cache manager, scheduler; its protocols for the features
    ("rayvllm.model_executor",),  # model runner, sampler, input batch; its extension protocol
    ("rayvllm.lora", "rayvllm.spec_decode", "rayvllm.structured_output", "rayvllm.kv_offload"),
    ("rayvllm.worker", "rayvllm.executor"),
    ("rayvllm.engine", "rayvllm.frontend"),
    ("rayvllm.actors",),  # the Ray layer: thin shims over the Ray-free core
    ("rayvllm.entrypoints", "rayvllm.data"),  # entrypoints; batch inference over Ray Data
    ("rayvllm",),
]

@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}; {_layer_name(self.source)} -> {_layer_name(self.target)})"


def _package_dirs() -> dict[str, Path]:
    """Installed package name -> folder, from pyproject's package-dir."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


@functools.cache
def _modules() -> dict[str, Path]:
    """Every rayvllm module by its installed name; a folder mapped to another
    package (rayvllm/actors would be rayvllm.actors) is read there, not twice."""
    dirs = _package_dirs()
    out: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            owner = max((p for p in dirs if name == p or name.startswith(p + ".")), key=len)
            if owner == package:
                out[name] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module that importing `name` (a module or a name in one) loads."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Arrow]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod; `from mod import f` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules) if target.split(".")[0] == "rayvllm" else None
            if resolved is not None and resolved != name:
                yield Arrow(name, resolved, node.lineno)


@functools.cache
def _arrows() -> tuple[Arrow, ...]:
    modules = _modules()
    return tuple(arrow for name, path in modules.items() for arrow in _imports(name, path, modules))


def _layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    assert best is not None, f"{module} is on no layer: add its folder to LAYERS"
    return best[1]


def _layer_name(module: str) -> str:
    index = _layer_of(module)
    return f"L{index} {'/'.join(LAYERS[index])}"


def _top_folder(module: str) -> str:
    """The top folder a module lives in (`rayvllm.core.sched.scheduler`:
    rayvllm.core), its subfolders included."""
    return ".".join(module.split(".")[:2])


def _own_folder(module: str) -> str:
    """The folder a module's file sits in (`rayvllm.core.sched.scheduler`:
    rayvllm.core.sched; a package's __init__ sits in its own folder)."""
    return module if _modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than
    one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's smallest node (breadth first)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_every_module_is_on_a_layer() -> None:
    for module in _modules():
        _layer_of(module)


def test_no_arrow_points_up() -> None:
    upward = sorted({str(a) for a in _arrows() if _layer_of(a.target) > _layer_of(a.source)})
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_file_cycle() -> None:
    graph: dict[str, set[str]] = {name: set() for name in _modules()}
    for arrow in _arrows():
        graph[arrow.source].add(arrow.target)
    cycles = [" -> ".join(c) for c in _cycles(graph)]
    assert not cycles, "import cycles between files:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder", [_top_folder, _own_folder], ids=["top folders", "every folder"])
def test_no_folder_cycle(folder: Callable[[str], str]) -> None:
    arrows = _arrows()
    graph: dict[str, set[str]] = {folder(name): set() for name in _modules()}
    for arrow in arrows:
        if folder(arrow.source) != folder(arrow.target):
            graph[folder(arrow.source)].add(folder(arrow.target))
    found = []
    for cycle in _cycles(graph):
        witnesses = [next(str(a) for a in arrows if (folder(a.source), folder(a.target)) == step) for step in zip(cycle, cycle[1:])]
        found.append(" -> ".join(cycle) + "\n    " + "\n    ".join(witnesses))
    assert not found, "import cycles between folders:\n" + "\n".join(found)


def test_messages_import_nothing_above_them() -> None:
    """The bottom floor holds without exemption."""
    above = sorted(str(a) for a in _arrows() if _layer_of(a.source) == 0 and _layer_of(a.target) != 0)
    assert not above, "\n".join(above)


def test_the_package_root_is_the_public_api() -> None:
    """rayvllm/ holds __init__.py and packages, no loose module."""
    loose = sorted(p.name for p in (REPO / "rayvllm").glob("*.py") if p.name != "__init__.py")
    assert not loose, loose


def test_executor_base_knows_no_executor_class() -> None:
    """The executor protocol knows no implementation, not even inside a function."""
    arrows = [a for a in _arrows() if a.source == "rayvllm.executor.base"]
    assert not [str(a) for a in arrows if a.target.startswith("rayvllm.executor.")]


def test_the_engine_and_the_executors_know_no_ray() -> None:
    """Ray itself sits on top too: no import in the engine or executor
    packages, not inside a function nor under `TYPE_CHECKING`, is of `ray`;
    the layer above injects the Ray kinds (`rayvllm.actors.factory`)."""
    found: list[str] = []
    for folder in ("engine", "executor"):
        for path in sorted((REPO / "rayvllm" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                found += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "ray" or n.startswith("ray.")]
    assert found == []
