"""`SchedulerActor`: the Ray shim over the engine core (schedulers, KV block
pools, prefix caches and the worker groups they drive).

It asks Ray for no CPU (DESIGN principle 8): it computes nothing heavy and
must fit beside the workers on a small machine.
"""

from __future__ import annotations

import ray
import torch

from rayvllm.config import EngineConfig
from rayvllm.core.sched.scheduler import SchedulerStats
from rayvllm.distributed.rpc_channel import ChannelServer
from rayvllm.engine.core_output import EngineCoreOutput
from rayvllm.engine.engine_core import EngineCore
from rayvllm.request import EngineCoreRequest


def _one_thread() -> None:
    # Scheduling is single-threaded Python; torch threads would only spin.
    torch.set_num_threads(1)


@ray.remote(num_cpus=0)
class SchedulerActor:
    """Construction is cheap; `start` builds the core so its errors
    (placement, preflight, sizing) reach the caller with their own types."""

    def __init__(self) -> None:
        _one_thread()
        self.core: EngineCore | None = None
        self.channel: ChannelServer | None = None

    def start(self, config: EngineConfig) -> int:
        """Start every worker group; returns the KV blocks per DP rank."""
        self.core = EngineCore(config)
        return config.cache_config.num_blocks

    def open_channel(self) -> tuple[tuple[str, int], bytes]:
        """Serve `step` and `make_stats` on a direct channel (the engine
        loop's per-step path); returns its address and key. From then on
        the core is touched only from the channel's thread."""
        self.channel = ChannelServer(self, ray.util.get_node_ip_address(), on_thread_start=_one_thread)
        return self.channel.address, self.channel.authkey

    def step(
        self, new_requests: list[list[EngineCoreRequest]], aborts: list[str]
    ) -> tuple[list[EngineCoreOutput], float]:
        """Everything the engine loop has for the core, then one step: the
        loop's single call per step. Returns the step's outputs and how long
        the loop should hold its next call (`EngineCore.next_step_delay`)."""
        assert self.core is not None
        # Adds before aborts, as in AsyncLLM: an abort may name a request of
        # this same batch.
        for group in new_requests:
            self.core.add_requests(group)
        if aborts:
            self.core.abort_requests(aborts)
        outputs = self.core.step()
        return outputs, self.core.next_step_delay()

    def make_stats(self) -> SchedulerStats:
        assert self.core is not None
        return self.core.make_stats()

    def check_health(self) -> None:
        assert self.core is not None
        self.core.check_health()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.core is not None:
            self.core.shutdown()
            self.core = None
