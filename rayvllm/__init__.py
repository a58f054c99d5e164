"""rayvllm: a vLLM-class LLM inference and serving engine, native to Ray."""

from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "SamplingParams", "StructuredOutputsParams", "PoolingParams", "LLM", "RequestOutput", "CompletionOutput",
    "EmbeddingRequestOutput", "PoolingRequestOutput", "EngineArgs", "LoRARequest", "HostWeights",
]


def __getattr__(name: str):
    # Lazy so that `import rayvllm` stays cheap and the sampling/config types
    # import without pulling in torch models or the tokenizer stack.
    if name == "LLM":
        from rayvllm.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "PoolingRequestOutput"):
        from rayvllm.messages import outputs

        return getattr(outputs, name)
    if name == "HostWeights":
        from rayvllm.distributed.weight_transfer import HostWeights

        return HostWeights
    if name == "EngineArgs":
        from rayvllm.config.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
