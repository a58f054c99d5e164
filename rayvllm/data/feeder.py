"""`ReplicaFeeder`: the Ray Data `map_batches` UDF of a batch job. Each
feeder (an actor of Ray Data's pool, `concurrency` of them) owns one
`EngineReplica` and sends it every batch Ray Data gives it, several at once
(`max_concurrent_batches`), so the engine's running batch is refilled from
the next batches while the last rows of one finish.

Invariants: a batch comes back with every input row once, in input order,
its input columns kept and the output columns added. When the replica dies
(its process killed, its node lost), the rows of the batch that had not
finished are sent again, from their prompts, to the replica Ray restarts
(or to a new one, if it cannot be restarted), at most `max_batch_retries`
times; rows that finished before are kept. A row that fails alone gets
its error in `ERROR_COLUMN` with `should_continue_on_error`, else fails
the job.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pyarrow as pa
import ray
from ray.exceptions import RayActorError

from rayvllm.data.config import ERROR_COLUMN, EngineProcessorConfig
from rayvllm.data.replica import ReplicaPlacement, start_replica
from rayvllm.data.rows import EMBED_COLUMNS, GENERATE_COLUMNS, empty_columns, request_fields

logger = logging.getLogger(__name__)


class RowError(RuntimeError):
    """A row's request failed and the job does not continue on errors."""


class ReplicaFeeder:
    def __init__(self, config: EngineProcessorConfig) -> None:
        self.config = config
        self.embed = config.task_type == "embed"
        self.placement = ReplicaPlacement(config)
        self.replica = start_replica(config, self.placement)
        ray.get(self.replica.pid.remote())  # built: Ray Data counts this feeder as started from here
        self._replacing = asyncio.Lock()

    def __del__(self) -> None:
        """Ray Data drops a feeder at the end of the job: its replica dies
        with it (its owner), and the replica's engine actors with the
        placement group released here."""
        placement = getattr(self, "placement", None)
        if placement is not None:
            placement.release()

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        results = await self._results([request_fields(row) for row in rows])
        failed = [i for i, r in enumerate(results) if ERROR_COLUMN in r]
        if failed and not self.config.should_continue_on_error:
            raise RowError(f"row {failed[0]} of the batch failed: {results[failed[0]][ERROR_COLUMN]}")
        # A failed row keeps what it came with (its prompt, its token ids).
        empty = empty_columns(self.embed)
        for name in EMBED_COLUMNS if self.embed else GENERATE_COLUMNS:
            batch = _set_column(batch, name, [r.get(name, row.get(name, empty[name])) for r, row in zip(results, rows)])
        if self.config.should_continue_on_error:
            batch = _set_column(batch, ERROR_COLUMN, [r.get(ERROR_COLUMN, "") for r in results])
        return batch

    async def _results(self, fields: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each row's output columns (or error), in input order."""
        results: list[dict[str, Any] | None] = [None] * len(fields)
        tries = self.config.max_batch_retries + 1
        for attempt in range(tries):
            todo = [(i, fields[i]) for i, r in enumerate(results) if r is None]
            if not todo:
                break
            replica = self.replica
            try:
                async for ref in replica.process.remote(todo):
                    index, columns = await ref
                    results[index] = columns
            except RayActorError as e:  # the replica died, or is restarting
                unfinished = sum(r is None for r in results)
                logger.warning("a replica died with %d rows of a batch unfinished (try %d of %d): %r",
                               unfinished, attempt + 1, tries, e)
                await self._replace(replica)
        lost = {ERROR_COLUMN: f"ReplicaLost: the row's replica died {tries} times before it finished"}
        return [r if r is not None else lost for r in results]

    async def _replace(self, dead: Any) -> None:
        """A live replica in place of `dead`: the same actor once Ray has
        restarted it, else a new one. Batches that lost the same replica
        share one replacement."""
        async with self._replacing:
            if self.replica is not dead:
                return
            try:
                # Retried while Ray restarts it (a restarting actor refuses
                # calls); answered by the new process.
                await dead.pid.options(max_task_retries=-1).remote()
            except RayActorError:  # gone for good
                logger.warning("a replica cannot be restarted; starting a new one")
                replica = start_replica(self.config, self.placement)
                await replica.pid.remote()
                self.replica = replica


def _set_column(table: pa.Table, name: str, values: list[Any]) -> pa.Table:
    column = pa.array(values)
    index = table.schema.get_field_index(name)
    if index >= 0:
        return table.set_column(index, name, column)
    return table.append_column(name, column)
