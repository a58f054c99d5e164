"""One rank of a worker group, Ray-free: process-group setup, the preflight
check, the model runner with the features the config enables
(extensions.py), the methods `collective_rpc` reaches (a user's
`worker_extension_cls` adds its own) and the worker's end of weight
updates (weight_transfer.py). `rayvllm.actors.WorkerActor` is its Ray shim;
the in-process executor holds one directly."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rayvllm.config import EngineConfig
from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.distributed.weight_transfer import DEFAULT_TRANSFER_TIMEOUT_S
from rayvllm.kv_offload.factory import offloads_kv
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.model_executor.model_runner import ModelRunner
from rayvllm.models.loader import checkpoint_spec
from rayvllm.worker.core_share import CoreShare, node_cores
from rayvllm.worker.extensions import create_model_runner
from rayvllm.worker.weight_transfer import WeightReceiver


class Worker:
    """Rank `rank` of a group of `tp * pp` ranks (rank = pp_rank * tp + tp_rank).

    On the CPU the rank runs `cpu_threads` torch threads where the config
    fixes them, else an equal share of the cores (less `cpu_reserved_cores`)
    among the engine ranks busy on its node (core_share.py), re-read before
    each step."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        pc = config.parallel_config
        self.config = config
        self.rank = rank
        self.world_size = pc.world_size
        self.parallel = ParallelContext(
            tp_rank=rank % pc.tensor_parallel_size,
            tp_size=pc.tensor_parallel_size,
            pp_rank=rank // pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size,
        )
        self.core_share: CoreShare | None = None
        if config.device == "cpu" and pc.cpu_threads is None:
            # The ranks share what the serving processes leave them (at least one core).
            self.core_share = CoreShare(cores=max(1, node_cores() - (pc.cpu_reserved_cores or 0)))
        self.runner: ModelRunner | None = None
        self.weight_receiver: WeightReceiver | None = None

    def set_threads(self) -> None:
        """Size the calling thread's torch/OpenMP pool (the setting is per
        thread, and Ray presets OMP_NUM_THREADS to the actor's CPU request)."""
        if self.config.device != "cpu":
            return
        fixed = self.config.parallel_config.cpu_threads
        threads = fixed if fixed is not None else self.core_share.threads()  # type: ignore[union-attr]
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    # ---- process groups ----------------------------------------------------------

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        """Join the group's world (gloo on CPU, NCCL on CUDA) and build one
        process group per TP group; every rank creates every group, in the
        same order, as torch.distributed requires."""
        if self.world_size == 1:
            return
        backend = "nccl" if self.config.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        ctx = self.parallel
        if ctx.tp_size > 1:
            for stage in range(ctx.pp_size):
                group = dist.new_group(list(range(stage * ctx.tp_size, (stage + 1) * ctx.tp_size)))
                if stage == ctx.pp_rank:
                    ctx.tp_group = group

    def preflight(self) -> None:
        """A tiny all-reduce in this rank's TP group and a send/recv across
        each PP boundary it touches; raises if any value comes back wrong."""
        ctx = self.parallel
        device = torch.device(self.config.device)
        if ctx.tp_size > 1:
            x = torch.ones(1, device=device)
            dist.all_reduce(x, group=ctx.tp_group)
            if int(x.item()) != ctx.tp_size:
                raise RuntimeError(f"TP all-reduce returned {x.item()}, expected {ctx.tp_size}")
        works = []
        if not ctx.is_last_stage:
            works.append(dist.isend(torch.tensor([float(self.rank)], device=device), dst=ctx.next_stage_rank))
        got = torch.full((1,), -1.0, device=device)
        if not ctx.is_first_stage:
            works.append(dist.irecv(got, src=ctx.prev_stage_rank))
        for work in works:
            work.wait()
        if not ctx.is_first_stage and int(got.item()) != ctx.prev_stage_rank:
            raise RuntimeError(f"PP recv from rank {ctx.prev_stage_rank} returned {got.item()}")

    # ---- model -------------------------------------------------------------------

    def load_model(self) -> None:
        self.runner = create_model_runner(self.config, self.parallel)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        assert self.runner is not None
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        # Each step: other engines on the node may have started or stopped
        # stepping, and an in-process engine's loop thread starts with its
        # caller's count.
        self.set_threads()
        return self.runner.execute_model(scheduler_output)

    # ---- collective_rpc -----------------------------------------------------------

    def run_method(self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`collective_rpc`'s call on this rank: a method of this worker (its
        extension's included) by name, or a function given this worker first."""
        if callable(method):
            return method(self, *args, **kwargs)
        target = getattr(self, method, None)
        if method.startswith("_") or not callable(target):
            raise InvalidParameterError("method", f"the worker has no method {method!r}")
        return target(*args, **kwargs)

    # ---- weight updates (vLLM's names; weight_transfer.py) ------------------------

    def init_weight_transfer_engine(
        self, backend: str, rank_offset: int = 1, master_address: str | None = None,
        master_port: int | None = None, world_size: int | None = None,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        """Join the trainer's transfer group as rank `rank_offset + rank`."""
        if self.config.lora_config is not None or self.config.speculative_config is not None:
            raise InvalidParameterError(
                "backend", "weight updates rebuild the model; LoRA and speculative decoding do not support it yet"
            )
        assert self.runner is not None
        if self.weight_receiver is None:
            spec = checkpoint_spec(self.config.model_config.model)
            tied = self.config.model_config.hf_config.get("tie_word_embeddings", False)
            embedding = spec.get("model.embed_tokens.weight")
            optional = {"lm_head.weight": embedding} if tied and embedding and "lm_head.weight" not in spec else {}
            self.weight_receiver = WeightReceiver(spec, self.runner.dtype, optional)
        self.weight_receiver.init(backend, rank_offset + self.rank, master_address, master_port, world_size, timeout_s)

    def start_weight_update(self) -> None:
        self._receiver().start()

    def update_weights(self, update_info: WeightUpdateInfo | None = None, weights: Any = None) -> None:
        self._receiver().update(update_info, weights)

    def finish_weight_update(self) -> None:
        """Rebuild the model from the staged update (every rank checked its
        own chunk; a rank whose check failed raised before this)."""
        assert self.runner is not None
        self.runner.reload_weights(self._receiver().finish().items())

    # ---- sleep (engine_core.sleep) --------------------------------------------------

    def sleep(self, level: int) -> None:
        if self.config.lora_config is not None or self.config.speculative_config is not None or offloads_kv(self.config):
            raise InvalidParameterError(
                "level", "sleep frees the KV cache and weights that LoRA, speculation and KV offloading hold too; "
                "not supported with them yet"
            )
        assert self.runner is not None
        self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        assert self.runner is not None
        self.runner.wake_up(tags)

    def _receiver(self) -> WeightReceiver:
        if self.weight_receiver is None:
            raise InvalidParameterError("backend", "call init_weight_transfer_engine first")
        return self.weight_receiver

    def shutdown(self) -> None:
        if self.weight_receiver is not None:
            self.weight_receiver.close()
        if self.runner is not None:
            self.runner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.core_share is not None:
            self.core_share.close()


def create_worker(config: EngineConfig, rank: int) -> Worker:
    """Rank `rank`'s worker, with the methods of `worker_extension_cls`
    (vLLM's name) mixed in when the config names one; an extension may
    add methods, never replace the worker's own."""
    name = config.parallel_config.worker_extension_cls
    if name is None:
        return Worker(config, rank)
    extension = _import_class(name)
    clashes = sorted(n for n in vars(extension) if not n.startswith("__") and hasattr(Worker, n))
    if clashes:
        raise InvalidParameterError("worker_extension_cls", f"{name} redefines the worker's {', '.join(clashes)}")
    cls = type(f"{extension.__name__}Worker", (Worker, extension), {})
    return cls(config, rank)


def _import_class(name: str) -> type:
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise InvalidParameterError("worker_extension_cls", f"cannot import {name!r}: {e}") from e
    if not isinstance(found, type):
        raise InvalidParameterError("worker_extension_cls", f"{name!r} is not a class")
    return found
