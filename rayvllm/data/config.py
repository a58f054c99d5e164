"""`EngineProcessorConfig`: what a batch job over Ray Data asks of the
engine, named and shaped like Ray Data LLM's `vLLMEngineProcessorConfig`
so that a job switches by changing its import. Each default and its help
live here only (docs/CONFIG.md is written from these fields). Ray-free."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayvllm.config.engine_args import EngineArgs

# Ray Data LLM's name for the column that holds a failed row's error.
ERROR_COLUMN = "__inference_error__"

TaskType = Literal["generate", "embed"]


class EngineProcessorConfig(BaseModel):
    """One batch processor: `concurrency` engine replicas (Ray actors, each
    holding an engine built from `engine_kwargs`), fed `batch_size` rows at
    a time by a Ray Data `map_batches` stage."""

    model_config = ConfigDict(extra="forbid")

    model_source: str | None = Field(
        None, description="the model's path (as `LLM(model=...)`); unset: the embedded demo model"
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="any EngineArgs field (docs/CONFIG.md): parallel sizes, LoRA, speculation, cache and "
        "scheduler sizes; `model` is `model_source`",
    )
    task_type: TaskType = Field(
        "generate", description="generate: text from prompts; embed: one vector per prompt (the pooling runner)"
    )
    concurrency: int | tuple[int, int] = Field(
        1, description="engine replicas: a number, or a (min, max) range that Ray Data scales within"
    )
    batch_size: int = Field(32, description="rows per Ray Data batch sent to a replica")
    max_concurrent_batches: int = Field(
        8, description="batches a replica's feeder keeps in flight at once, so the engine's running batch "
        "never drains between Ray Data batches",
    )
    max_pending_requests: int | None = Field(
        None, description="rows in flight in one replica's engine at once; the rest wait in the replica "
        "(unset: no bound beyond the engine's own queue)",
    )
    apply_chat_template: bool = Field(True, description="render a row's `messages` with the chat template")
    chat_template: str | None = Field(None, description="a Jinja chat template instead of the tokenizer's")
    tokenize: bool = Field(
        True, description="Ray Data LLM's tokenize stage, accepted so that a config carries over: here the "
        "engine tokenizes a row's text as it admits it either way (rows with `prompt_token_ids` skip it)",
    )
    detokenize: bool = Field(
        True, description="fill `generated_text`; off: it is left empty (the engine still decodes for stop strings)"
    )
    should_continue_on_error: bool = Field(
        False, description=f"a row whose request fails gets its error in `{ERROR_COLUMN}` and the job goes "
        "on; off: the job fails",
    )
    max_batch_retries: int = Field(
        3, description="how many times a batch's unfinished rows are resubmitted after their replica died "
        "before they count as failed (a row that kills every engine must not loop forever)",
    )
    dynamic_lora_loading_path: str | None = Field(
        None, description="a folder of LoRA adapters: a row whose `model` names one of its subfolders runs "
        "with that adapter (LoRA enabled through engine_kwargs); unset: `model` is the adapter's own path",
    )
    placement_group_config: dict[str, Any] | None = Field(
        None, description="each engine worker's Ray placement: `bundle_per_worker` (or equal `bundles`, one "
        "per rank) and `strategy` (PACK, SPREAD, ...)",
    )
    runtime_env: dict[str, Any] | None = Field(None, description="the Ray runtime_env of the engine replicas")

    @field_validator("concurrency")
    @classmethod
    def _positive_concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if not 1 <= low <= high:
            raise ValueError(f"must be >= 1, or a (min, max) range with 1 <= min <= max; got {value!r}")
        return value

    @field_validator("batch_size", "max_concurrent_batches")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _model_given_once(self) -> "EngineProcessorConfig":
        given = self.engine_kwargs.get("model")
        if given is not None and self.model_source is not None and given != self.model_source:
            raise ValueError(f"engine_kwargs['model'] ({given!r}) differs from model_source ({self.model_source!r})")
        return self

    def engine_args(self) -> EngineArgs:
        """The replicas' `EngineArgs`: `engine_kwargs` with the model, the
        pooling runner for `embed`, and the placement the config asks for."""
        kwargs = dict(self.engine_kwargs)
        if self.model_source is not None:
            kwargs["model"] = self.model_source
        if self.task_type == "embed" and "runner" not in kwargs:
            kwargs["task"] = "embed"
        kwargs.update(_placement_args(self.placement_group_config))
        args = EngineArgs.from_dict(kwargs)
        bundles = (self.placement_group_config or {}).get("bundles")
        ranks = args.tensor_parallel_size * args.pipeline_parallel_size
        if bundles and len(bundles) not in (ranks, ranks * args.data_parallel_size):
            raise ValueError(f"placement_group_config: {len(bundles)} bundles for {ranks} ranks per engine")
        return args


def _placement_args(config: dict[str, Any] | None) -> dict[str, Any]:
    """EngineArgs fields from a `placement_group_config`. Each worker rank of
    an engine has one bundle of the same shape (the engine's worker groups
    are uniform), so only a CPU count and a strategy can be expressed; a GPU
    rank always takes one GPU."""
    if not config:
        return {}
    unknown = set(config) - {"bundle_per_worker", "bundles", "strategy"}
    if unknown:
        raise ValueError(f"placement_group_config: unknown keys {sorted(unknown)}")
    bundles = config.get("bundles")
    bundle = config.get("bundle_per_worker")
    if bundles:
        if bundle is not None or any(b != bundles[0] for b in bundles):
            raise ValueError(
                "placement_group_config: `bundles` must be equal (one per rank), without bundle_per_worker"
            )
        bundle = bundles[0]
    out: dict[str, Any] = {}
    if bundle and bundle.get("CPU"):
        out["num_cpus_per_worker"] = float(bundle["CPU"])
    if "strategy" in config:
        out["placement_group_strategy"] = config["strategy"]
    return out
