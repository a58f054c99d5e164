"""The benchmark scripts under bench/, imported as modules for their
helpers' tests (bench/ is not a package: each script puts its own folder
on sys.path for `_common`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(filename: str) -> ModuleType:
    """bench/`filename` as module `bench_<stem>`, registered in sys.modules
    (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(filename).stem.lstrip('_')}", BENCH / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
