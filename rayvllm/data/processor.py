"""`build_processor`: a `Processor` that maps a Ray Data `Dataset` through
engine replicas, as Ray Data LLM's `build_llm_processor` does:
preprocess (a row map, which Ray Data runs in the engine stage's actors)
-> the engine stage (`map_batches` over a pool of `ReplicaFeeder`s, each
owning one engine replica) -> postprocess (a row map that rows with an
error skip). Nothing runs until the dataset is
consumed; the replicas live while Ray Data's pool does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.data import ActorPoolStrategy, Dataset

from rayvllm.data.config import ERROR_COLUMN, EngineProcessorConfig
from rayvllm.data.feeder import ReplicaFeeder

Row = dict[str, Any]
RowFn = Callable[[Row], Row]


class _SkipErrors:
    """`postprocess` on every row but those that failed (kept as they are)."""

    def __init__(self, postprocess: RowFn) -> None:
        self.postprocess = postprocess

    def __call__(self, row: Row) -> Row:
        return row if row.get(ERROR_COLUMN) else self.postprocess(row)


def _pool(config: EngineProcessorConfig) -> ActorPoolStrategy:
    """One feeder per replica: a fixed pool, or a range Ray Data scales
    within; each feeder takes `max_concurrent_batches` batches at once."""
    size = config.concurrency
    bounds = {"size": size} if isinstance(size, int) else {"min_size": size[0], "max_size": size[1]}
    return ActorPoolStrategy(**bounds, max_concurrent_calls_per_actor=config.max_concurrent_batches)


class Processor:
    """Ray Data LLM's `Processor`: calling it on a dataset returns the
    mapped dataset, unexecuted; each execution starts its own feeders and
    replicas and stops them when it ends."""

    def __init__(self, config: EngineProcessorConfig, preprocess: RowFn | None, postprocess: RowFn | None) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, dataset: Dataset) -> Dataset:
        config = self.config
        if self.preprocess is not None:
            # Asking for no CPU, as the feeders do, lets Ray Data fuse the
            # row map into the feeders' stage: each batch is preprocessed in
            # its feeder on the way to the engine. As a stage of its own it
            # was one Ray task per input block on the engine's cores (from
            # `from_items`: a block per 2 rows), and it starved the engine.
            dataset = dataset.map(self.preprocess, num_cpus=0)
        dataset = dataset.map_batches(
            ReplicaFeeder,
            fn_constructor_kwargs={"config": config},
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=_pool(config),
            # A feeder only waits on its replica, which holds the engine's resources.
            num_cpus=0,
        )
        if self.postprocess is not None:
            dataset = dataset.map(_SkipErrors(self.postprocess))
        return dataset


def build_processor(
    config: EngineProcessorConfig, preprocess: RowFn | None = None, postprocess: RowFn | None = None
) -> Processor:
    """Ray Data LLM's `build_llm_processor`: `preprocess` maps each input
    row to one the engine reads (`prompt` | `messages` | `prompt_token_ids`,
    `sampling_params` | `pooling_params`), `postprocess` each output row."""
    config.engine_args()  # bad engine_kwargs fail here, not in every replica
    return Processor(config, preprocess, postprocess)
