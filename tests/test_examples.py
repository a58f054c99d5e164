"""Each example imports (its names resolve against the package as it is
now): examples/rl_loop.py once imported a helper from a module it had left,
and nothing ran it. Running them end to end is left to the tests of what
they show (test_data_processor, test_weight_sync); this catches the rot
that costs nothing to catch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"batch.py", "rl_loop.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module level only: the run is behind `__main__`
    assert callable(getattr(module, "main", None))
