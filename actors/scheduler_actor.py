"""`SchedulerActor`: the Ray shim over the engine core (schedulers, KV block
pools, prefix caches and the worker groups they drive).

It asks Ray for no CPU (DESIGN principle 8): it computes nothing heavy and
must fit beside the workers on a small machine.
"""

from __future__ import annotations

import ray
import torch

from rayvllm.config import EngineConfig
from rayvllm.distributed.rpc_channel import ChannelServer
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.intake import IntakeStalledError, RequestIntake
from rayvllm.engine_types import EngineCoreOutput, SchedulerStats

# A step call's intake messages were sent before it, on a connection to the
# same actor; not seeing them within this long means that channel is broken.
INTAKE_WAIT_S = 60.0


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
        self.intake = RequestIntake()
        self.intake_channel: ChannelServer | None = None

    def start(self, config: EngineConfig, reserved_pg: object = None) -> int:
        """Start every worker group (in `reserved_pg` when Serve reserved
        one with the replica); returns the KV blocks per DP rank."""
        self.core = EngineCore(config, reserved_pg=reserved_pg)
        return config.cache_config.num_blocks

    def open_channels(self) -> list[tuple[tuple[str, int], bytes]]:
        """Open the engine loop's two direct channels and return their
        addresses and keys: the step channel (`step`, `make_stats`; from
        then on the core is touched only from its thread) and the one-way
        intake channel, which takes adds and aborts into `self.intake` the
        moment the loop has them, even while a step runs."""
        host = ray.util.get_node_ip_address()
        self.channel = ChannelServer(self, host, on_thread_start=_one_thread)
        self.intake_channel = ChannelServer(self.intake, host, one_way=True)
        return [(c.address, c.authkey) for c in (self.channel, self.intake_channel)]

    def step(self, intake_count: int) -> list[EngineCoreOutput]:
        """One engine step, once the first `intake_count` intake messages
        (everything the loop sent before this call) have arrived."""
        assert self.core is not None and self.intake_channel is not None
        try:
            self.intake.wait_for(intake_count, INTAKE_WAIT_S)
        except IntakeStalledError as e:
            raise IntakeStalledError(f"{e}; the intake channel's error: {self.intake_channel.error!r}") from None
        return self.core.step(self.intake)

    def make_stats(self) -> SchedulerStats:
        assert self.core is not None
        return self.core.make_stats()

    def check_health(self) -> None:
        assert self.core is not None
        self.core.check_health()

    def shutdown(self) -> None:
        for channel in (self.channel, self.intake_channel):
            if channel is not None:
                channel.close()
        if self.core is not None:
            self.core.shutdown()
            self.core = None
