"""An engine actor reaches niceness 0 by itself where the machine lets a
process lower its niceness, and through Ray's runtime environment (the
slower start) only where it does not. The real engine's threads at 0:
test_distributed.test_shutdown_leaves_nothing_behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from rayvllm.actors import niceness

SCRIPT = """
import os, sys
from rayvllm.actors import niceness
os.nice(15)
allowed = niceness.may_lower_niceness()
niceness.lower_to_zero()
print(allowed, niceness.rank_runtime_env() == niceness.HOT_PATH_RUNTIME_ENV, os.getpriority(os.PRIO_PROCESS, 0))
"""


def _run(privileged: bool) -> list[str]:
    # Without CAP_SYS_NICE (dropped from the bounding set, so the exec'd
    # Python has none), root is a user like any other here.
    drop = [] if privileged else ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"]
    out = subprocess.run([*drop, sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and util-linux's setpriv: a privileged and an unprivileged process")
def test_a_process_that_may_lower_its_niceness_needs_no_runtime_env() -> None:
    # Root may lower: the actor goes from 15 to 0 itself, no runtime environment.
    assert _run(privileged=True) == ["True", "False", "0"]
    # A process that may not: Ray's runtime environment starts it at 0; one
    # started without stays where it was.
    assert _run(privileged=False) == ["False", "True", "15"]


def test_the_probe_leaves_the_calling_thread_as_it_was() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    niceness.may_lower_niceness.cache_clear()
    niceness.may_lower_niceness()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
