"""The synchronous engine: Processor -> EngineCore -> OutputProcessor.

Used by the offline `LLM`; the async loop of the server wraps the same pieces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rayvllm.config import EngineConfig
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine_args import EngineArgs
from rayvllm.output_processor import OutputProcessor
from rayvllm.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from rayvllm.pooling_params import PoolingParams
from rayvllm.processor import Processor
from rayvllm.sampling_params import SamplingParams
from rayvllm.tokenizer import get_tokenizer

if TYPE_CHECKING:
    from rayvllm.engine.ray_core_client import RayEngineCoreClient


def make_engine_core(config: EngineConfig, reserved_pg: Any = None) -> "EngineCore | RayEngineCoreClient":
    """In-process core by default; the SchedulerActor on Ray when any
    parallel size exceeds 1 or `distributed_executor_backend="ray"`
    (`reserved_pg`: the Serve replica's placement group, for that case)."""
    if config.parallel_config.use_ray:
        from rayvllm.engine.ray_core_client import RayEngineCoreClient

        return RayEngineCoreClient(config, reserved_pg)
    return EngineCore(config)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(
            config.model_config, self.tokenizer, max_logprobs=config.max_logprobs,
            max_n=config.scheduler_config.max_num_seqs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = make_engine_core(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> None:
        """Validate, tokenize and enqueue; `n > 1` fans out into child requests
        that the OutputProcessor gathers back into one RequestOutput."""
        core_reqs, prompt_text = self.processor.process_with_fanout(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority
        )
        self.output_processor.add_fanout(request_id, core_reqs, prompt_text, output_kind)
        self.engine_core.add_requests(core_reqs)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = self.output_processor.child_request_ids(request_ids)
        self.engine_core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.engine_core.step()
        result = self.output_processor.process_outputs(core_outputs)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
