"""A pytest plugin (loaded by conftest) that tells pytest-xdist what to hand
a worker as one unit (`-n 2 --dist loadgroup`, set in pyproject.toml): the
modules on the shared `serve run` together, so it starts once; the modules
on the shared Ray cluster in two halves (with Serve on it, and without),
each on one worker with a cluster of its own; every other module whole, so
its module-scoped fixtures set up once.

Which module uses which shared fixture is known only where tests are
collected, in the workers, and xdist's own `xdist_group` marks cannot carry
it under pytest 9.2 (xdist writes the group into `item._nodeid`, which
pytest no longer reads). So each worker writes the modules' groups to a
file that the controller names (an environment variable the workers
inherit), before it reports its collection; the controller's scheduler
reads it when it splits the collection, which is after every worker has
reported. Without xdist none of this runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from item_scopes import module_of, uses_shared

# conftest's shared fixtures, in the order a module's group is picked by.
SHARED_GROUPS = ("serve_apps", "serve_local", "ray_local")
GROUPS_FILE_ENV = "RAYVLLM_TEST_GROUPS_FILE"


def groups_of(items: list[pytest.Item]) -> dict[str, str]:
    """Module -> its group: the first shared fixture any of its tests
    uses, else the module itself."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(module_of(item), []).append(item)
    return {
        module: next((f for f in SHARED_GROUPS if any(uses_shared(i, f) for i in members)), module)
        for module, members in modules.items()
    }


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="rayvllm-test-groups-", suffix=".json")
        os.close(fd)
        os.unlink(path)  # written by the first worker to collect
        os.environ[GROUPS_FILE_ENV] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and GROUPS_FILE_ENV in os.environ:
        Path(os.environ.pop(GROUPS_FILE_ENV)).unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)  # pytest without xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scope scheduling with a module's group as its scope."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups_file = Path(os.environ[GROUPS_FILE_ENV])

    class ModuleGroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # First called once every worker has reported its collection.
            if self.groups is None:
                self.groups = json.loads(groups_file.read_text()) if groups_file.exists() else {}
            module = nodeid.split("::", 1)[0]
            return self.groups.get(module, module)

    return ModuleGroupScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    # Before -k / -m deselection: a module's group does not depend on which
    # of its tests run.
    path = os.environ.get(GROUPS_FILE_ENV)
    if path and hasattr(config, "workerinput"):
        staged = f"{path}.{config.workerinput['workerid']}"
        Path(staged).write_text(json.dumps(groups_of(items)))
        os.replace(staged, path)
    return (yield)
