"""`EngineArgs`: the user-facing engine knobs (pydantic, unknown keys
rejected), derived from the config dataclasses' fields (config_fields.py),
and the rules that turn them into an `EngineConfig`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from rayvllm.config import (
    ATTENTION_BACKEND_ENV,
    CPU_KV_CACHE_SPACE_ENV,
    MAX_NUM_BATCHED_TOKENS,
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
from rayvllm.config.fields import Argument, parse_value, user_arguments
from rayvllm.config.kv_offload import GIB, KVOffloadConfig, kv_layout_fingerprint
from rayvllm.config.lora import LoRAConfig
from rayvllm.messages.errors import InvalidParameterError


# The config groups whose fields' arguments `EngineArgs` takes, by the
# title docs/CONFIG.md gives each.
ENGINE_ARG_GROUPS: dict[str, type] = {
    "Model": ModelConfig,
    "Cache": CacheConfig,
    "Scheduler": SchedulerConfig,
    "Parallel": ParallelConfig,
    "Engine": EngineConfig,
    "LoRA": LoRAConfig,
    "KV offloading": KVOffloadConfig,
}
# Groups whose fields are the keys of an argument's JSON object.
NESTED_ARG_GROUPS: dict[str, type] = {"speculative_config": SpeculativeConfig, "pooler_config": PoolerConfig}


def engine_arguments() -> list[Argument]:
    """Every `EngineArgs` field, as its config dataclass declares it."""
    return [arg for cls in ENGINE_ARG_GROUPS.values() for arg in user_arguments(cls)]


def _engine_arg_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for arg in engine_arguments():
        if arg.name in fields:
            raise TypeError(f"two config fields take the argument {arg.name!r}")
        fields[arg.name] = (arg.type, Field(arg.default, description=arg.help))
    return fields


class EngineArgs(
    create_model(  # type: ignore[misc]
        "EngineArgFields", __config__=ConfigDict(extra="forbid", protected_namespaces=()), **_engine_arg_fields()
    )
):
    """The user-facing engine knobs: one field per argument of the config
    dataclasses (`ENGINE_ARG_GROUPS`), with their defaults, types and help;
    unknown keys are rejected. Names and meanings follow vLLM's, so that a
    vLLM user finds the same knobs."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineArgs":
        """Build from a plain dict whose values may be text (a command
        line's, `serve run ... key=value`), converted by each field's type;
        pydantic errors become one `InvalidParameterError` naming every
        offending key."""
        return validate_args(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineArgs":
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only here: building a config needs no torch (see rayvllm.config)

        return "cuda" if torch.cuda.is_available() else "cpu"

    def _resolve_async_scheduling(self, pc: ParallelConfig) -> bool:
        if self.async_scheduling is None:
            # Scheduling ahead overlaps only a step that runs elsewhere (a
            # worker actor of one rank); where the loop's own thread runs the
            # model it just holds each step's outputs back by a step.
            # (One rank per group and not in the SchedulerActor: data parallelism, always on Ray.)
            return pc.world_size == 1 and not pc.scheduler_hosts_worker
        if self.async_scheduling and pc.pipeline_parallel_size > 1:
            # Under async scheduling the scheduler does not have a step's
            # sampled tokens when it schedules the next; TP ranks get them
            # from their driver, but a first stage has no path from the last.
            raise InvalidParameterError("async_scheduling", "needs pipeline_parallel_size == 1")
        return self.async_scheduling

    def resolve_attention_backend(self) -> str:
        """The explicit argument wins over the environment variable."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return os.environ.get(ATTENTION_BACKEND_ENV, "auto")

    def resolve_kv_cache_memory_bytes(self, device: str) -> int | None:
        """The explicit argument wins over the environment variable, which
        sizes a CPU engine's cache only."""
        space = os.environ.get(CPU_KV_CACHE_SPACE_ENV, "")
        if self.kv_cache_memory_bytes is not None or device != "cpu" or not space:
            return self.kv_cache_memory_bytes
        try:
            gib = float(space)
        except ValueError:
            gib = 0.0
        if not gib > 0:
            raise InvalidParameterError(CPU_KV_CACHE_SPACE_ENV, f"must be a positive number of GiB, got {space!r}")
        return int(gib * GIB)

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
        """None unless `enable_lora`; a LoRA knob set without it is an error."""
        knobs = [arg.name for arg in user_arguments(LoRAConfig)]
        if not self.enable_lora:
            given = [k for k in knobs if k in self.model_fields_set]
            if given:
                raise InvalidParameterError(", ".join(given), "applies only with enable_lora=True")
            return None
        return LoRAConfig(**{k: getattr(self, k) for k in knobs})

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
            cpu_threads=self.cpu_threads,
            cpu_reserved_cores=self.cpu_reserved_cores,
            placement_group_timeout_s=self.placement_group_timeout_s,
            distributed_timeout_s=self.distributed_timeout_s,
            worker_extension_cls=self.worker_extension_cls,
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
            max_batched = MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_batched = max(max_batched, model_config.max_model_len)
        parallel_config = self.create_parallel_config()
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.resolve_kv_cache_memory_bytes(device),
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
            deterministic=self.deterministic,
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


_Args = TypeVar("_Args", bound=BaseModel)


def validate_args(model: type[_Args], data: dict[str, Any]) -> _Args:
    """`model` (`EngineArgs`, the server's options) from a plain dict whose
    values may be text, converted by each field's type (`parse_value`);
    pydantic's errors become one `InvalidParameterError` naming every
    offending key (an unknown one included)."""
    fields = model.model_fields
    values = {k: parse_value(k, fields[k].annotation, v) if k in fields else v for k, v in data.items()}
    try:
        return model(**values)
    except ValidationError as e:
        # A check across fields (a model validator) has no location; its
        # message names the fields itself.
        locs = [".".join(str(p) for p in err["loc"]) or "options" for err in e.errors()]
        msgs = [err["msg"].removeprefix("Value error, ") for err in e.errors()]
        # One error: the parameter's name leads the message once.
        details = msgs[0] if len(msgs) == 1 else "; ".join(f"{loc}: {msg}" for loc, msg in zip(locs, msgs))
        raise InvalidParameterError(", ".join(dict.fromkeys(locs)), details) from None
