"""A CPU rank's torch threads (rayvllm/worker/core_share.py): the node's
cores shared among the engine ranks stepping on it, every core back to a
rank busy alone, and a dead rank's file removed; `cpu_threads` fixes them;
`cpu_reserved_cores` leaves cores to the serving processes, one by default
in a Serve replica behind Serve's proxy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rayvllm.worker.core_share import BUSY_WINDOW_S, REFRESH_S, CoreShare, default_directory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_busy_ranks_share_the_cores_and_an_idle_or_dead_one_gives_its_share_back(tmp_path: Path) -> None:
    a = CoreShare(tmp_path, cores=8)
    assert a.threads(now=100.0) == 8  # alone
    b = CoreShare(tmp_path, cores=8)
    c = CoreShare(tmp_path, cores=8)
    assert b.threads(now=100.1) == 8 // 2  # a and b stepped within the window
    assert a.threads(now=100.1 + REFRESH_S / 2) == 8  # not re-read yet
    assert c.threads(now=100.2) == 2  # 8 among 3: 3, 3 and 2, the remainder to the first two
    assert a.threads(now=100.2 + REFRESH_S) == 3
    assert b.threads(now=100.2 + REFRESH_S) == 3
    # b and c stop stepping: a, still busy, gets every core back once the window passes.
    assert a.threads(now=100.2 + BUSY_WINDOW_S + REFRESH_S) == 8
    # A rank whose process died without closing: its file goes, it never counts.
    dead = tmp_path / f"{_dead_pid()}.0"
    dead.touch()
    os.utime(dead, (200.0, 200.0))
    assert a.threads(now=200.0) == 8 and not dead.exists()
    for share in (a, b, c):
        share.close()
    assert list(tmp_path.iterdir()) == []


def test_more_busy_ranks_than_cores_each_run_one_thread(tmp_path: Path) -> None:
    shares = [CoreShare(tmp_path, cores=2) for _ in range(3)]
    assert [s.threads(now=50.0) for s in shares] == [2, 1, 1]  # each sees those that stepped before it
    assert [s.threads(now=50.0 + REFRESH_S) for s in shares] == [1, 1, 1]


def test_a_workers_step_sizes_its_threads_and_cpu_threads_fixes_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rayvllm import EngineArgs
    from rayvllm.worker.worker import Worker

    previous = torch.get_num_threads()
    try:
        fixed = Worker(EngineArgs(model=str(tiny_model_dir), cpu_threads=1).create_engine_config(), rank=0)
        assert fixed.core_share is None
        torch.set_num_threads(2)
        fixed.set_threads()
        assert torch.get_num_threads() == 1
        shared = Worker(EngineArgs(model=str(tiny_model_dir)).create_engine_config(), rank=0)
        assert shared.core_share is not None
        shared.core_share.close()
        shared.core_share = CoreShare(tmp_path, cores=2)  # a directory no other engine steps in
        other = CoreShare(tmp_path, cores=2)
        other.threads()
        shared.set_threads()
        assert torch.get_num_threads() == 1
        other.close()
        shared.core_share.close()
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineArgs(model=str(tiny_model_dir), cpu_threads=0).create_engine_config()


def test_reserved_cores_are_left_out_of_the_share(tiny_model_dir: Path) -> None:
    from rayvllm import EngineArgs
    from rayvllm.worker.core_share import node_cores
    from rayvllm.worker.worker import Worker

    for reserved, expected in ((None, node_cores()), (1, max(1, node_cores() - 1)), (10_000, 1)):
        config = EngineArgs(model=str(tiny_model_dir), cpu_reserved_cores=reserved).create_engine_config()
        worker = Worker(config, rank=0)
        assert worker.core_share is not None and worker.core_share.cores == expected, reserved
        worker.core_share.close()
    with pytest.raises(ValueError, match="cpu_reserved_cores"):
        EngineArgs(model=str(tiny_model_dir), cpu_reserved_cores=-1).create_engine_config()


def test_a_replica_behind_serves_proxy_leaves_a_core_to_it(serve_local: str, tiny_model_dir: Path) -> None:
    """This test's Serve has no direct ingress: requests reach the replica
    through Serve's proxy, and its engine's ranks share all cores but one."""
    from ray import serve

    from rayvllm.entrypoints.openai.api_server import LLMServer
    from rayvllm.worker.core_share import node_cores

    args = dict(model=str(tiny_model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    handle = serve.run(LLMServer.bind(args), name="reserved-core", route_prefix=None)  # type: ignore[attr-defined]
    try:
        assert handle.collective_rpc.remote(lambda worker: worker.core_share.cores).result() == [
            max(1, node_cores() - 1)
        ]
    finally:
        serve.delete("reserved-core")


def test_an_in_process_engines_steps_mark_its_rank_busy(tiny_model_dir: Path) -> None:
    """The engine's own step path (not only a direct call) keeps its rank's
    file fresh in the node's directory, where other engines count it."""
    from rayvllm import LLM, SamplingParams

    mine = f"{os.getpid()}."
    directory = default_directory()
    directory.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in directory.iterdir() if p.name.startswith(mine)}
    llm = LLM(model=str(tiny_model_dir))
    start = time.time()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0))
    touched = [p for p in directory.iterdir() if p.name.startswith(mine) and p.name not in before]
    assert len(touched) == 1 and touched[0].stat().st_mtime >= start - 1
    llm.shutdown()
    assert not touched[0].exists()


def test_the_directory_is_shared_by_every_user_or_falls_back_to_this_users_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made here: writable by all and sticky, as /tmp. One another user
    made without that mode (not writable here): this user's own beside it."""
    shared = CoreShare(tmp_path / "ranks", cores=2)
    assert (shared.directory.stat().st_mode & 0o7777) == 0o1777
    shared.close()
    from rayvllm.worker import core_share

    make = core_share._make_shared_directory

    def not_ours(directory: Path) -> None:
        if directory.name == "locked":
            raise PermissionError(13, "Permission denied", str(directory))
        make(directory)

    monkeypatch.setattr(core_share, "_make_shared_directory", not_ours)
    own = CoreShare(tmp_path / "locked", cores=2)
    assert own.directory == tmp_path / f"locked-{os.getuid()}" and own.threads(now=1.0) == 2
    own.close()
