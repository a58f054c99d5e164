"""POST /v1/embeddings over a pooling engine, free of any HTTP framework
and of Ray (like `serving.OpenAIServing`, whose request plumbing it shares)."""

from __future__ import annotations

import contextlib

from rayvllm.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EmbeddingUsage,
    encode_embedding,
)
from rayvllm.entrypoints.openai.serving import OpenAIServing, _completion_prompts, _named_for, _response_id
from rayvllm.messages.errors import RequestFailedError
from rayvllm.messages.outputs import PoolingRequestOutput

__all__ = ["OpenAIServingEmbedding"]


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, request_id: str) -> EmbeddingResponse:
        """One embedding per input item, in order. Raises (400) on a model
        that does not pool, before reading the input; then as
        `create_completion` does, with prompt errors named `input`.
        Engine request ids: `request_id` for one input, else
        `f"{request_id}-{index}"`."""
        model = self._model_name(req.model)
        params = req.to_pooling_params()
        self.engine.check_runner(params)
        with _named_for(req):  # type: ignore[arg-type]
            prompts = _completion_prompts(req.input)
        streams = await self._start(req, prompts, params, request_id)  # type: ignore[arg-type]
        results: list[PoolingRequestOutput | None] = [None] * len(prompts)
        async with contextlib.aclosing(streams.outputs()) as outputs:
            async for index, out in outputs:
                if isinstance(out, PoolingRequestOutput):
                    results[index] = out
        data: list[EmbeddingResponseData] = []
        prompt_tokens = 0
        for index, result in enumerate(results):
            if result is None:  # aborted: the engine is shutting down
                raise RequestFailedError(f"embedding request {request_id} input {index} ended without a result")
            prompt_tokens += len(result.prompt_token_ids)
            embedding = encode_embedding(result.outputs.data.tolist(), req.encoding_format)
            data.append(EmbeddingResponseData(index=index, embedding=embedding))
        return EmbeddingResponse(
            id=_response_id("embd-", request_id),
            model=model,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
