"""`EngineArgs`: the user-facing engine knobs (pydantic, unknown keys rejected).

Names and meanings follow vLLM's so that a vLLM user finds the same knobs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from rayvllm.config import (
    ATTENTION_BACKEND_ENV,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    is_pooling_only,
    read_hf_config,
)
from rayvllm.config.kv_offload import GIB, KVOffloadConfig, kv_layout_fingerprint
from rayvllm.config.lora import LoRAConfig
from rayvllm.messages.errors import InvalidParameterError


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # CPU KV cache budget; vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE (GiB) for this.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # None: on where it pays, the Ray path with single-rank worker groups
    # (the loop there would otherwise leave the worker idle while it
    # schedules); off in-process, where nothing would overlap.
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    placement_group_strategy: str = "PACK"
    num_cpus_per_worker: float = 1.0
    placement_group_timeout_s: float = 300.0
    distributed_timeout_s: float = 60.0
    device: str = "auto"
    max_logprobs: int = 20
    # "auto", "torch", "triton" or "flash_attn"; with "auto" the environment
    # variable RAYVLLM_ATTENTION_BACKEND, when set, decides.
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # vLLM's knobs for embedding models: runner "pooling" (or the older
    # task "embed") pools the prompt's hidden states instead of sampling;
    # the pooler config (a dict, or its JSON text from a command line)
    # names pooling_type (LAST, MEAN) and normalize. override_pooler_config
    # is vLLM's older name of the same.
    runner: str = "auto"
    task: str | None = None
    pooler_config: str | dict[str, Any] | None = None
    override_pooler_config: str | dict[str, Any] | None = None
    # vLLM's speculative decoding config (a dict, or its JSON text from a
    # command line): {"method": "ngram", "num_speculative_tokens": k, ...}
    # or {"method": "draft_model", "model": path, ...}; see SpeculativeConfig.
    speculative_config: str | dict[str, Any] | None = None
    # vLLM's LoRA knobs (lora/config.py has their defaults and meaning).
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # vLLM's KV offloading: a second tier of this many GiB behind the KV
    # cache, "native" (host memory) or "ray" (the Ray object store, shared
    # by DP ranks and replicas of the same model; implies the Ray runtime).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineArgs":
        """Build from a plain dict, turning pydantic errors into one
        `InvalidParameterError` that names every offending key."""
        try:
            return cls(**data)
        except ValidationError as e:
            names = ", ".join(".".join(str(p) for p in err["loc"]) for err in e.errors())
            details = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise InvalidParameterError(names, details) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineArgs":
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _resolve_async_scheduling(self, pc: ParallelConfig) -> bool:
        if self.async_scheduling is None:
            return pc.use_ray and pc.world_size == 1
        if self.async_scheduling and pc.world_size > 1:
            # Ranks that do not sample learn each step's input tokens from
            # the scheduler, which under async scheduling does not have them yet.
            raise InvalidParameterError(
                "async_scheduling", "needs tensor_parallel_size == pipeline_parallel_size == 1"
            )
        return self.async_scheduling

    def resolve_attention_backend(self) -> str:
        """The explicit argument wins over the environment variable."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return os.environ.get(ATTENTION_BACKEND_ENV, "auto")

    def resolve_runner(self, hf_config: dict | None = None) -> str:
        """"generate" or "pooling", from `runner`, the older `task` and (for
        "auto") the checkpoint: a bare decoder without LM head pools."""
        task = self.task
        if task not in _TASKS:
            raise InvalidParameterError("task", f"must be one of {', '.join(str(t) for t in _TASKS)}, got {task!r}")
        wants_embed = task in ("embed", "embedding")
        pooling_only = hf_config is not None and is_pooling_only(hf_config)
        if self.runner == "auto":
            if task == "generate" and pooling_only:
                raise InvalidParameterError("task", "this checkpoint has no LM head; it can only pool (task='embed')")
            return "pooling" if wants_embed or pooling_only else "generate"
        if self.runner not in ("generate", "pooling"):
            raise InvalidParameterError("runner", f"must be auto, generate or pooling, got {self.runner!r}")
        if (self.runner == "pooling" and task == "generate") or (self.runner == "generate" and wants_embed):
            raise InvalidParameterError("task", f"{task!r} contradicts runner={self.runner!r}")
        if self.runner == "generate" and pooling_only:
            archs = (hf_config or {}).get("architectures")
            raise InvalidParameterError("runner", f"architectures {archs} have no LM head; they can only pool")
        return self.runner

    def create_pooler_config(self, runner: str) -> PoolerConfig | None:
        """The pooling runner's config: `pooler_config`, with
        `override_pooler_config`'s keys on top; None for a generating runner."""
        given = {**_pooler_dict("pooler_config", self.pooler_config),
                 **_pooler_dict("override_pooler_config", self.override_pooler_config)}
        if runner != "pooling":
            if given:
                raise InvalidParameterError("pooler_config", "applies to runner='pooling' (or task='embed') only")
            return None
        unknown = sorted(set(given) - set(PoolerConfig.__dataclass_fields__))
        if unknown:
            raise InvalidParameterError("pooler_config", f"unknown keys {unknown}; expected pooling_type, normalize")
        return PoolerConfig(**given)

    def create_lora_config(self) -> LoRAConfig | None:
        """None unless `enable_lora`; the LoRA knobs without it are an error."""
        given = {k: v for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if (v := getattr(self, k)) is not None}
        if not self.enable_lora:
            if given:
                raise InvalidParameterError(", ".join(given), "applies only with enable_lora=True")
            return None
        return LoRAConfig(**given)

    def create_parallel_config(self) -> ParallelConfig:
        """The worker layout alone (no model files read): what Serve needs to
        reserve a replica's placement group."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self._resolve_executor_backend(),
            placement_group_strategy=self.placement_group_strategy,
            num_cpus_per_worker=self.num_cpus_per_worker,
            placement_group_timeout_s=self.placement_group_timeout_s,
            distributed_timeout_s=self.distributed_timeout_s,
        )

    def _resolve_executor_backend(self) -> str | None:
        """The Ray object store tier runs where Ray does."""
        if self.kv_offloading_size is None or self.kv_offloading_backend != "ray":
            return self.distributed_executor_backend
        if self.distributed_executor_backend == "uni":
            raise InvalidParameterError(
                "kv_offloading_backend", "'ray' needs the Ray runtime, not distributed_executor_backend='uni'"
            )
        return "ray"

    def create_kv_offload_config(self, model_config: ModelConfig, pc: ParallelConfig) -> KVOffloadConfig | None:
        """The second KV tier, or None when `kv_offloading_size` is unset."""
        size = self.kv_offloading_size
        if size is None:
            if self.kv_offloading_backend != "native":
                raise InvalidParameterError("kv_offloading_backend", "is set but kv_offloading_size is not")
            return None
        if not self.enable_prefix_caching:
            raise InvalidParameterError(
                "kv_offloading_size", "needs enable_prefix_caching (the tier keeps blocks by prefix hash)"
            )
        fingerprint = kv_layout_fingerprint(
            str(Path(model_config.model).resolve()), model_config.hf_config, model_config.dtype,
            self.block_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
        )
        return KVOffloadConfig(self.kv_offloading_backend, int(size * GIB), fingerprint)

    def create_engine_config(self) -> EngineConfig:
        device = self.resolve_device()
        model = self.model
        if model is None:
            from rayvllm.utils.demo import demo_model_path

            model = str(demo_model_path())
        hf_config = read_hf_config(model)
        runner = self.resolve_runner(hf_config)
        model_config = ModelConfig.from_path(
            model, self.tokenizer, self.dtype, self.max_model_len, self.seed, device, self.served_model_name,
            runner_type=runner, pooler_config=self.create_pooler_config(runner), hf_config=hf_config,
        )
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 2048 if self.enable_chunked_prefill else max(2048, model_config.max_model_len)
        parallel_config = self.create_parallel_config()
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=model_config.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                async_scheduling=self._resolve_async_scheduling(parallel_config),
            ),
            parallel_config=parallel_config,
            device=device,
            max_logprobs=self.max_logprobs,
            attention_backend=self.resolve_attention_backend(),
            enforce_eager=self.enforce_eager,
            speculative_config=self.create_speculative_config(model_config),
            lora_config=self.create_lora_config(),
            kv_offload_config=self.create_kv_offload_config(model_config, parallel_config),
        )

    def create_speculative_config(self, model_config: ModelConfig) -> SpeculativeConfig | None:
        """The checked speculative config; a draft model must share the
        target's vocabulary (its tokens are the target's)."""
        spec = SpeculativeConfig.from_user(self.speculative_config)
        if spec is None:
            return None
        if model_config.is_pooling:
            raise InvalidParameterError("speculative_config", "applies to generating models, not runner='pooling'")
        if spec.model is not None:
            if not (Path(spec.model) / "config.json").exists():
                raise InvalidParameterError("speculative_config.model", f"no config.json in {spec.model!r}")
            draft_vocab = read_hf_config(spec.model).get("vocab_size")
            if draft_vocab != model_config.vocab_size:
                raise InvalidParameterError(
                    "speculative_config.model",
                    f"vocab_size {draft_vocab} differs from the target model's {model_config.vocab_size}",
                )
        return spec


_TASKS = (None, "auto", "generate", "embed", "embedding")


def _pooler_dict(name: str, value: str | dict[str, Any] | None) -> dict[str, Any]:
    """A pooler config given as a dict or as JSON text (a command line's form)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(name, f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(name, "must be an object such as {\"pooling_type\": \"MEAN\"}")
    return value
