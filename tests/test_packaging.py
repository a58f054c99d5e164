"""A plain (non-editable) install carries every package: pyproject lists
them one by one, so a folder left out is missing from the wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> dict[str, Path]:
    """Installed package name -> folder, for every folder with an __init__.py
    under the package-dir roots (a root mapped elsewhere is read there)."""
    roots = {name: REPO / folder for name, folder in SETUPTOOLS["package-dir"].items()}
    found: dict[str, Path] = {}
    for root_name, root in roots.items():
        for init in root.rglob("__init__.py"):
            name = ".".join([root_name, *init.parent.relative_to(root).parts])
            owner = max((r for r in roots if name == r or name.startswith(r + ".")), key=len)
            if owner == root_name:
                found[name] = init.parent
    return found


def test_pyproject_lists_every_package() -> None:
    listed = set(SETUPTOOLS["packages"])
    source = set(_source_packages())
    assert not source - listed, f"packages missing from pyproject's list: {sorted(source - listed)}"
    assert not listed - source, f"listed packages with no folder: {sorted(listed - source)}"


_IMPORT_ALL = r"""
import importlib, sys
target, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, target)
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(target), (name, module.__file__)
print(len(names))
"""


def test_a_plain_install_imports_every_module(tmp_path: Path) -> None:
    # Built from a copy of the sources: a build/ left in the checkout would
    # carry modules deleted since into the wheel, and the checkout stays clean.
    source = tmp_path / "source"
    source.mkdir()
    for name in ["pyproject.toml", "README.md", *(f"{m}.py" for m in SETUPTOOLS["py-modules"])]:
        shutil.copy2(REPO / name, source / name)
    for folder in set(SETUPTOOLS["package-dir"].values()):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    modules = [
        ".".join([package, path.stem]) if path.name != "__init__.py" else package
        for package, folder in _source_packages().items()
        for path in folder.glob("*.py")
    ]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(target), *sorted(modules)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(len(modules))
