"""Rows through one `AsyncLLM`: each row one request, all of a replica's
rows in its one running batch, whatever Ray Data batch they came in.
Ray-free (the replica actor, replica.py, is its Ray shim).

Invariants: `run` yields each row it was given exactly once, as
`(index, columns)`, in the order rows finish; a row whose own request is
invalid or was failed by the engine yields `{ERROR_COLUMN: message}` and
the others go on; an engine that died raises `EngineDeadError` out of
`run` (the replica is then lost as a whole). Leaving `run` early aborts
its unfinished requests.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rayvllm.data.config import ERROR_COLUMN
from rayvllm.data.rows import RowStages, embed_columns, generate_columns, pooling_params, sampling_params
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.frontend.processor import PromptType
from rayvllm.messages.errors import RequestFailedError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind

# What a row's own request can raise: bad fields, a bad chat, a grammar
# that does not compile, a request the engine failed alone.
ROW_ERRORS = (ValueError, TypeError, KeyError, RequestFailedError)


def row_error(e: BaseException) -> dict[str, Any]:
    return {ERROR_COLUMN: f"{type(e).__name__}: {e}"}


class RowRunner:
    """`max_pending_requests` bounds the rows in the engine at once (None:
    no bound); `num_started` counts rows admitted so far."""

    def __init__(self, engine: AsyncLLM, stages: RowStages, embed: bool, max_pending_requests: int | None) -> None:
        self.engine = engine
        self.stages = stages
        self.embed = embed
        self._slots = asyncio.Semaphore(max_pending_requests) if max_pending_requests else None
        self._ids = itertools.count()
        self._lora_ids: dict[str, int] = {}
        self.num_started = 0
        self._started_waiters: list[tuple[int, asyncio.Future[None]]] = []

    async def run(self, rows: list[tuple[int, Mapping[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        tasks = {asyncio.ensure_future(self._run_row(fields)): index for index, fields in rows}
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield tasks[task], task.result()
        finally:
            for task in tasks:
                task.cancel()

    async def wait_started(self, n: int) -> None:
        """Return once `n` rows have been admitted to the engine."""
        if self.num_started < n:
            future = asyncio.get_running_loop().create_future()
            self._started_waiters.append((n, future))
            await future

    def _started(self) -> None:
        self.num_started += 1
        for n, future in [w for w in self._started_waiters if w[0] <= self.num_started]:
            self._started_waiters.remove((n, future))
            future.set_result(None)

    async def _run_row(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self._slots is None:
            return await self._request(fields)
        async with self._slots:
            return await self._request(fields)

    async def _request(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        try:
            prompt, text, add_special_tokens = self._prompt(fields)
            params = pooling_params(fields) if self.embed else sampling_params(fields)
            stream = self.engine.add_request(
                prompt, params, f"row-{next(self._ids)}", add_special_tokens=add_special_tokens,
                output_kind=RequestOutputKind.FINAL_ONLY, lora_request=self._lora(fields), final_only=True,
            )
        except ROW_ERRORS as e:
            return row_error(e)
        self._started()
        final: RequestOutput | PoolingRequestOutput | None = None
        try:
            async for final in stream:
                pass
        except RequestFailedError as e:
            return row_error(e)
        finally:
            await stream.aclose()
        if isinstance(final, PoolingRequestOutput):
            return embed_columns(final, text)
        assert isinstance(final, RequestOutput)
        return generate_columns(final, text, self.stages)

    def _lora(self, fields: Mapping[str, Any]) -> LoRARequest | None:
        """The row's adapter; one id per adapter name for this engine's life."""
        path = self.stages.adapter_path(fields)
        if path is None:
            return None
        name = str(fields["model"])
        return LoRARequest(name, self._lora_ids.setdefault(name, len(self._lora_ids) + 1), path)

    def _prompt(self, fields: Mapping[str, Any]) -> tuple[PromptType, str | None, bool]:
        """The engine prompt of a row, its text, and whether the tokenizer
        adds special tokens (not to a rendered chat: it holds them)."""
        stages = self.stages
        ids = fields.get("prompt_token_ids")
        text = fields.get("prompt")
        if ids is not None:
            prompt: PromptType = {"prompt_token_ids": list(ids), **({"prompt": text} if text is not None else {})}
            return prompt, text, True
        if fields.get("messages") is not None:
            if not stages.apply_chat_template:
                raise ValueError("the row has `messages` but apply_chat_template is off")
            text = self.engine.render_chat(fields["messages"], chat_template=stages.chat_template)
            ids = self.engine.tokenize(text, add_special_tokens=False)
            return {"prompt_token_ids": ids, "prompt": text}, text, False
        if text is None:
            raise ValueError("the row has none of `prompt`, `messages`, `prompt_token_ids`")
        return text, text, True
