"""Where a collected test belongs: its module, and whether it uses one of
tests/conftest.py's shared fixtures (conftest orders and stops the shared
cluster and server by these; tests/xdist_groups.py groups modules by them)."""

from __future__ import annotations

import pytest


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def uses_shared(item: pytest.Item, fixture: str) -> bool:
    """`item` asks for `fixture` as tests/conftest.py defines it (a module
    may define its own of that name)."""
    defs = item._fixtureinfo.name2fixturedefs.get(fixture, ())  # type: ignore[attr-defined]
    return bool(defs) and defs[-1].func.__module__ == "conftest"
