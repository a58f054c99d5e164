"""Run the project from its checkout, uninstalled (bench/gpu_proof.sh).

`pip install -e .` maps `rayvllm.kernels` to kernels/ and `rayvllm.actors`
to actors/ (pyproject's `package-dir`). A machine without network may not
be able to install (build isolation fetches setuptools), so with this
folder on PYTHONPATH Python runs this file at start-up, as `sitecustomize`,
in every process and subprocess, and it applies the same mapping from the
same table: the repository root goes on sys.path and a finder maps the
other packages. A `sitecustomize` further down sys.path still runs after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
REPO_ROOT = _HERE.parent.parent


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the packages whose folder is not their dotted path."""

    def __init__(self, packages: dict[str, Path]) -> None:
        self.packages = packages

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.packages.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject's `[tool.setuptools] package-dir`, less the packages that
    live where their name says (the root on sys.path finds those)."""
    with open(root / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in table.items() if Path(folder) != Path(*name.split("."))}


def _run_next_sitecustomize() -> None:
    rest = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and Path(spec.origin or "").resolve() != Path(__file__).resolve():
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
sys.meta_path.insert(0, CheckoutFinder(package_dirs(REPO_ROOT)))
_run_next_sitecustomize()
