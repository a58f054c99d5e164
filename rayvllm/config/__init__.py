"""Engine configuration: plain dataclasses, checked in `__post_init__`.

`EngineArgs` (the pydantic boundary) builds an `EngineConfig`; nothing inside
the engine reads user input any other way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rayvllm.config.dtypes import DTYPE_ALIASES, resolve_dtype, to_torch_dtype
from rayvllm.config.fields import ArgSpec, config_field
from rayvllm.config.kv_offload import KVOffloadConfig
from rayvllm.config.lora import LoRAConfig
from rayvllm.messages.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

# "auto" picks by device and availability (kernels/backends.py); the
# environment variable stands in for an "auto" engine argument.
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
ATTENTION_BACKEND_ENV = "RAYVLLM_ATTENTION_BACKEND"
# GiB of KV cache on CPU where `kv_cache_memory_bytes` is unset (vLLM's CPU
# build reads VLLM_CPU_KVCACHE_SPACE the same way).
CPU_KV_CACHE_SPACE_ENV = "RAYVLLM_CPU_KVCACHE_SPACE"

# What a model runner does with the final hidden states (vLLM's runner types).
RUNNER_TYPES = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN")

logger = logging.getLogger(__name__)


def read_hf_config(model: str) -> dict:
    """The parsed config.json of a model directory."""
    config_path = Path(model) / "config.json"
    if not config_path.exists():
        raise InvalidParameterError("model", f"no config.json in {model!r}")
    return json.loads(config_path.read_text())


def rope_length_limit(hf_config: dict) -> int | None:
    """The longest sequence served with the model's RoPE exactly as
    transformers computes it (None: no limit short of the model's own).
    LongRoPE (Phi-3's rope_type longrope) rotates with its short factors
    up to `original_max_position_embeddings` and switches every position of
    a forward pass to its long factors past it, so beyond that length a
    key's rotation depends on which pass computed it."""
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    return int(rope.get("original_max_position_embeddings") or hf_config["original_max_position_embeddings"])


def is_pooling_only(hf_config: dict) -> bool:
    """A bare decoder checkpoint (`LlamaModel`, `Qwen2Model`, ...: no LM
    head, as embedding models ship) can only pool, as in vLLM."""
    archs = hf_config.get("architectures") or []
    return bool(archs) and all(str(a).endswith("Model") for a in archs)


@dataclass
class PoolerConfig:
    """How the pooling runner turns a prompt's final hidden states (after
    the last norm) into one vector, with vLLM's names: the last token's
    state or the mean over the prompt, L2-normalised when `normalize`
    (the default for embeddings; a request's `PoolingParams.normalize`
    overrides it)."""

    pooling_type: str = config_field(
        "LAST: the last prompt token's hidden state; MEAN: the mean over the prompt", "LAST"
    )
    normalize: bool = config_field("L2-normalise the vector (a request's normalize overrides it)", True)

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise InvalidParameterError(
                "pooler_config.pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise InvalidParameterError("pooler_config.normalize", f"must be true or false, got {self.normalize!r}")


@dataclass
class ModelConfig:
    """Invariants: `max_model_len <= max_position_embeddings` unless rope
    scaling says otherwise; `hf_config` is the parsed config.json."""

    model: str = config_field(
        "the model's directory (config.json, safetensors weights, tokenizer); unset: the embedded demo model",
        arg_type=str | None, arg_default=None,
    )
    tokenizer: str = config_field(
        "the tokenizer's directory; unset: the model's", arg_type=str | None, arg_default=None
    )
    # torch's name of the dtype (`torch_dtype` makes it one): a config
    # crosses processes that never import torch.
    dtype: str = config_field(
        f"weights' and activations' dtype: auto (the checkpoint's; float32 on CPU), {', '.join(DTYPE_ALIASES)}",
        arg_type=str, arg_default="auto",
    )
    max_model_len: int = config_field(
        "the longest prompt plus output, in tokens; unset: the model's max_position_embeddings",
        arg_type=int | None, arg_default=None,
    )
    seed: int = config_field("the seed of random sampling", arg_default=0)
    hf_config: dict = field(repr=False)
    served_model_name: str = config_field(
        "the model's name in the API; unset: model", "", arg_type=str | None, arg_default=None
    )
    # "pooling": the model embeds prompts and never samples; then
    # `pooler_config` is set (and only then).
    runner_type: str = config_field(
        "generate: sample tokens; pooling: embed prompts; auto: pooling for a checkpoint without LM head "
        "(or with task embed), else generate",
        "generate", arg_name="runner", arg_default="auto",
        also=(ArgSpec("vLLM's older switch: embed (or embedding) means runner pooling, generate means "
                      "runner generate", name="task", type=str | None, default=None),),
    )
    pooler_config: PoolerConfig | None = config_field(
        "how the pooling runner makes one vector of a prompt: a JSON object with the keys "
        f"{', '.join(PoolerConfig.__dataclass_fields__)}",
        None, arg_type=str | dict[str, Any] | None,
        also=(ArgSpec("vLLM's older name of pooler_config; its keys win over pooler_config's",
                      name="override_pooler_config", type=str | dict[str, Any] | None, default=None),),
    )

    @classmethod
    def from_path(
        cls,
        model: str,
        tokenizer: str | None,
        dtype: str | torch.dtype,
        max_model_len: int | None,
        seed: int,
        device: str,
        served_model_name: str | None = None,
        runner_type: str = "generate",
        pooler_config: PoolerConfig | None = None,
        hf_config: dict | None = None,
    ) -> "ModelConfig":
        """`hf_config`: the model's config.json when the caller read it already."""
        if hf_config is None:
            hf_config = read_hf_config(model)
        derived = int(hf_config.get("max_position_embeddings", 2048))
        limit = rope_length_limit(hf_config)
        if max_model_len is None and limit is not None and limit < derived:
            logger.info(
                "max_model_len %d (not max_position_embeddings %d): the model's LongRoPE is served exactly only up "
                "to original_max_position_embeddings", limit, derived,
            )
            derived = limit
        if max_model_len is None:
            max_model_len = derived
        return cls(
            model=model,
            tokenizer=tokenizer or model,
            dtype=resolve_dtype(dtype, hf_config, device),
            max_model_len=max_model_len,
            seed=seed,
            hf_config=hf_config,
            served_model_name=served_model_name or model,
            runner_type=runner_type,
            pooler_config=pooler_config,
        )

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise InvalidParameterError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        limit = rope_length_limit(self.hf_config)
        if limit is not None and self.max_model_len > limit:
            raise InvalidParameterError(
                "max_model_len", f"{self.max_model_len} exceeds the model's original_max_position_embeddings "
                f"({limit}), past which its LongRoPE (rope_type longrope) changes factors mid-sequence: each key's "
                "rotation then depends on which forward pass computed it, which batching and chunked prefill "
                f"change, so tokens would differ from transformers'; refused rather than served so (at most {limit})",
            )
        if self.runner_type not in RUNNER_TYPES:
            raise InvalidParameterError("runner", f"must be one of {', '.join(RUNNER_TYPES)}, got {self.runner_type!r}")
        if (self.pooler_config is not None) != self.is_pooling:
            raise InvalidParameterError("pooler_config", "is set exactly when runner is 'pooling'")

    @property
    def is_pooling(self) -> bool:
        return self.runner_type == "pooling"

    @property
    def torch_dtype(self) -> torch.dtype:
        return to_torch_dtype(self.dtype)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        return int(head_dim) if head_dim else int(self.hf_config["hidden_size"]) // self.num_attention_heads


@dataclass
class CacheConfig:
    """`num_blocks` is decided at engine start from the memory budget (or the
    override) and includes the null block 0; `sliding_window` at engine
    start too, from the model's layers (EngineCore): the window past which
    each request's KV blocks are released, None to keep them all."""

    # The KV budget on CPU unless `kv_cache_memory_bytes` (or
    # CPU_KV_CACHE_SPACE_ENV, which sets it) says otherwise.
    CPU_KV_CACHE_BYTES: ClassVar[int] = 2 << 30

    block_size: int = config_field("tokens per KV cache block (a power of two)", 16)
    enable_prefix_caching: bool = config_field(
        "reuse the KV cache blocks of a prompt prefix that an earlier request computed", True
    )
    gpu_memory_utilization: float = config_field(
        "the fraction of the GPU's memory the engine may use (weights, activations, KV cache); "
        "decides the KV cache's size on CUDA", 0.9,
    )
    kv_cache_memory_bytes: int | None = config_field(
        "the KV cache's budget in bytes; unset: what gpu_memory_utilization leaves on CUDA, "
        f"on CPU {CPU_KV_CACHE_SPACE_ENV} GiB where that is set, else {CPU_KV_CACHE_BYTES >> 30} GiB", None,
    )
    num_gpu_blocks_override: int | None = config_field(
        "this many KV cache blocks (the null block included), whatever the memory budget", None
    )
    num_blocks: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError("block_size", f"must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidParameterError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise InvalidParameterError("kv_cache_memory_bytes", "must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise InvalidParameterError("num_gpu_blocks_override", "must be >= 2 (block 0 is the null block)")


# A step's token budget unless `max_num_batched_tokens` says otherwise.
MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    max_num_seqs: int = config_field("the most requests in one step's batch", 256)
    max_num_batched_tokens: int = config_field(
        f"the most tokens one step computes; unset: {MAX_NUM_BATCHED_TOKENS}, or max_model_len where that is "
        "larger and chunked prefill is off",
        MAX_NUM_BATCHED_TOKENS, arg_type=int | None, arg_default=None,
    )
    max_model_len: int = 2048
    enable_chunked_prefill: bool = config_field(
        "split a long prompt over steps, so that decoding requests keep running beside it", True
    )
    policy: str = config_field(
        "fcfs: first come, first served; priority: by each request's priority, then arrival",
        "fcfs", arg_name="scheduling_policy",
    )
    # Schedule step k+1 while step k is still on the workers (decodes are
    # scheduled against the token step k will sample); see Scheduler.
    async_scheduling: bool = config_field(
        "schedule step k+1 while step k runs on the workers; unset: on with the Ray runtime where each "
        "worker group is one rank in a worker actor (data parallelism; the loop would otherwise leave the worker "
        "idle while it schedules), off where the SchedulerActor runs the model itself (one rank, one DP rank: "
        "scheduling ahead would only hold each output back by a step), in-process and with tensor parallelism "
        "(on request there: TP rank 0 hands each step's tokens to its group); not with pipeline stages",
        False, arg_type=bool | None, arg_default=None,
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError(
                "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off",
            )
        if self.policy not in ("fcfs", "priority"):
            raise InvalidParameterError("scheduling_policy", f"must be 'fcfs' or 'priority', got {self.policy!r}")


PLACEMENT_GROUP_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = config_field("ranks that split each layer (attention heads, MLP columns)", 1)
    pipeline_parallel_size: int = config_field("ranks that split the layers into consecutive stages", 1)
    data_parallel_size: int = config_field(
        "engine cores, each with its own worker group, that share the requests", 1
    )
    distributed_executor_backend: str | None = config_field(
        "uni: the worker runs in this process; ray: worker actors on the Ray cluster; unset: ray where "
        "there is more than one rank (or a Ray KV tier), else uni", None,
    )
    # One bundle per rank of a worker group (TP x PP ranks).
    placement_group_strategy: str = config_field(
        f"Ray's placement of a worker group's ranks: {', '.join(PLACEMENT_GROUP_STRATEGIES)}", "PACK"
    )
    num_cpus_per_worker: float = config_field(
        "logical CPUs each CPU worker rank asks Ray for (a GPU rank asks for one GPU)", 1.0
    )
    cpu_threads: int | None = config_field(
        "torch threads per CPU worker rank; unset: the node's cores shared evenly among the engine ranks "
        "stepping on it (re-read before each step)", None,
    )
    cpu_reserved_cores: int | None = config_field(
        "cores of the node that the CPU ranks leave to the processes carrying requests to them (Serve's proxy, "
        "the replica; vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU); unset: 1 in a Serve replica whose requests come "
        "through Serve's proxy (no direct ingress), else 0", None,
    )
    # Past these, fail with names rather than hang.
    placement_group_timeout_s: float = config_field(
        "seconds to wait for a worker group's placement group to be placed", 300.0
    )
    distributed_timeout_s: float = config_field(
        "seconds for a worker group's process group to form and pass its preflight", 60.0
    )
    worker_extension_cls: str | None = config_field(
        "a class (module:Class or module.Class) whose methods every worker gains, for collective_rpc "
        "(vLLM's name); it is imported where the workers run; unset: none", None,
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.placement_group_strategy not in PLACEMENT_GROUP_STRATEGIES:
            raise InvalidParameterError(
                "placement_group_strategy",
                f"must be one of {', '.join(PLACEMENT_GROUP_STRATEGIES)}, got {self.placement_group_strategy!r}",
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InvalidParameterError("cpu_threads", f"must be >= 1, got {self.cpu_threads}")
        if self.cpu_reserved_cores is not None and self.cpu_reserved_cores < 0:
            raise InvalidParameterError("cpu_reserved_cores", f"must be >= 0, got {self.cpu_reserved_cores}")
        for name in ("num_cpus_per_worker", "placement_group_timeout_s", "distributed_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(name, f"must be > 0, got {getattr(self, name)}")
        if self.worker_extension_cls is not None and not any(c in self.worker_extension_cls for c in ".:"):
            raise InvalidParameterError(
                "worker_extension_cls", f"must be module:Class or module.Class, got {self.worker_extension_cls!r}"
            )
        if self.distributed_executor_backend not in (None, "uni", "ray"):
            raise InvalidParameterError(
                "distributed_executor_backend",
                f"must be 'uni' or 'ray', got {self.distributed_executor_backend!r}",
            )

    @property
    def world_size(self) -> int:
        """Ranks in one worker group (one data-parallel rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def scheduler_hosts_worker(self) -> bool:
        """One DP rank of one worker: on Ray its model runs inside the
        SchedulerActor, on the engine loop's thread (as vLLM's EngineCoreProc
        runs its UniProcExecutor), which saves a process hop and a second
        process competing for the cores every step."""
        return self.world_size == 1 and self.data_parallel_size == 1

    @property
    def use_ray(self) -> bool:
        return self.distributed_executor_backend == "ray" or self.world_size > 1 or self.data_parallel_size > 1


SPEC_METHODS = ("ngram", "draft_model")
# The n-gram lookup bounds when neither is given.
PROMPT_LOOKUP_DEFAULT = 5


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config`: `method` "ngram" (prompt lookup over the
    request's own tokens: the longest suffix n-gram, n from
    `prompt_lookup_max` down to `prompt_lookup_min`, found earlier in the
    sequence proposes what followed it) or "draft_model" (`model`, a smaller
    model with the target's vocabulary, run by the same worker). Each step
    verifies up to `num_speculative_tokens` drafts per request. As in vLLM,
    a `model` without `method` means "draft_model", and a missing lookup
    bound takes the other's value (both PROMPT_LOOKUP_DEFAULT when neither
    is given)."""

    num_speculative_tokens: int = config_field("drafts proposed, and verified, per request and step")
    method: str = config_field(
        "ngram: prompt lookup over the request's own tokens; draft_model: a smaller model with the "
        "target's vocabulary; unset: draft_model when model is given, else ngram",
        "draft_model", arg_type=str | None, arg_default=None,
    )
    model: str | None = config_field("the draft model's directory (method draft_model)", None)
    prompt_lookup_max: int | None = config_field(
        f"the longest n-gram looked up (method ngram); unset: prompt_lookup_min, or {PROMPT_LOOKUP_DEFAULT}",
        None,
    )
    prompt_lookup_min: int | None = config_field(
        f"the shortest n-gram looked up (method ngram); unset: prompt_lookup_max, or {PROMPT_LOOKUP_DEFAULT}",
        None,
    )

    @classmethod
    def from_user(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (a command line's form); unknown
        keys are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidParameterError("speculative_config", f"not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise InvalidParameterError(
                "speculative_config", 'must be an object such as {"method": "ngram", "num_speculative_tokens": 3}'
            )
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidParameterError(
                "speculative_config", f"unknown keys {unknown}; expected {sorted(cls.__dataclass_fields__)}"
            )
        if "num_speculative_tokens" not in value:
            raise InvalidParameterError("speculative_config.num_speculative_tokens", "is required")
        given = dict(value)
        if given.get("method") is None:
            given["method"] = "draft_model" if given.get("model") else "ngram"
        return cls(**given)

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> InvalidParameterError:
            return InvalidParameterError(f"speculative_config.{name}", msg)

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise bad("num_speculative_tokens", f"must be an integer >= 1, got {k!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise bad("model", "is required for method 'draft_model' (a model directory)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise bad("prompt_lookup_max", "applies to method 'ngram' only")
            return
        if self.model is not None:
            raise bad("model", "applies to method 'draft_model' only")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise bad(name, f"must be an integer >= 1, got {n!r}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = PROMPT_LOOKUP_DEFAULT
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise bad(
                "prompt_lookup_min",
                f"({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})",
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a request's scheduled tokens that proposing writes:
        a draft model caches its own drafts' KV (all but the last)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str = config_field(
        "cpu or cuda; auto: cuda where available", "cpu", arg_default="auto"
    )
    max_logprobs: int = config_field("the most logprobs (and prompt_logprobs) a request may ask for", 20)
    attention_backend: str = config_field(
        f"the attention kernels: {', '.join(ATTENTION_BACKENDS)}; with auto the environment variable "
        f"{ATTENTION_BACKEND_ENV}, where set, decides, else the device and what is installed",
        "auto",
    )
    enforce_eager: bool = config_field("never capture CUDA graphs (the CPU always runs eager)", False)
    # Batch invariance comes from kernels that reduce in one fixed order per
    # token: the C GEMM (each output summed over K in order, whatever the
    # rows beside it) and the C attention kernels for every token, prefill
    # tokens included (each its own exact softmax over its context, summed
    # alike in the decode and the prefill kernel).
    deterministic: bool = config_field(
        "batch-invariant mode: a request's tokens and logprobs are bitwise the same whatever else shares its "
        "batch and however its prompt is chunked (float32 on the CPU; slower, see docs/BENCHMARKS.md)", False,
    )
    speculative_config: SpeculativeConfig | None = config_field(
        'speculative decoding, a JSON object such as {"method": "ngram", "num_speculative_tokens": 3}; '
        f"its keys: {', '.join(SpeculativeConfig.__dataclass_fields__)}",
        None, arg_type=str | dict[str, Any] | None,
    )
    # Set exactly when LoRA adapters are enabled (`enable_lora`).
    lora_config: LoRAConfig | None = config_field(
        "serve LoRA adapters (max_loras, max_lora_rank and max_cpu_loras size the slots)",
        None, arg_name="enable_lora", arg_type=bool, arg_default=False,
    )
    # The second KV tier behind each rank's block pool (None: none).
    kv_offload_config: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidParameterError(
                "attention_backend",
                f"unknown backend {self.attention_backend!r}; expected one of {', '.join(ATTENTION_BACKENDS)}",
            )
        if self.deterministic:
            self._check_deterministic()

    def _check_deterministic(self) -> None:
        """What batch-invariant mode cannot cover yet is refused, not run
        with a silent exception: its kernels are the CPU's float32 ones, and
        LoRA's and speculation's own paths have no fixed-order variant."""
        needs = {
            "device='cpu'": self.device == "cpu",
            "dtype float32": self.model_config.dtype == "float32",
            "attention_backend auto or torch": self.attention_backend in ("auto", "torch"),
            # Two ranks' partial sums add in either order to the same bits;
            # gloo's ring over more ranks orders them by where an element
            # falls in its chunks, which moves with the batch's size.
            "tensor_parallel_size <= 2": self.parallel_config.tensor_parallel_size <= 2,
            "no LoRA": self.lora_config is None,
            "no speculative decoding": self.speculative_config is None,
        }
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise InvalidParameterError("deterministic", f"batch-invariant mode needs {', '.join(missing)}")
