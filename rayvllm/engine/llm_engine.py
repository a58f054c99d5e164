"""The synchronous engine: Processor -> EngineCore -> OutputProcessor.

Used by the offline `LLM`; the async loop of the server wraps the same pieces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.core_client import CoreRestarts, make_engine_core
from rayvllm.frontend.output_processor import OutputProcessor
from rayvllm.frontend.processor import Processor
from rayvllm.messages.errors import EngineDeadError, StepFailedError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.utils.tokenizer import get_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(
            config.model_config, self.tokenizer, max_logprobs=config.max_logprobs,
            max_n=config.scheduler_config.max_num_seqs, lora_config=config.lora_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = make_engine_core(config)
        # On Ray a dead engine (a killed worker or SchedulerActor, a lost
        # node) is replaced and its requests resumed from the output
        # processor's table, as the serving engine does; an in-process core
        # shares this process, so no new one would escape what ended it.
        self.restarts = (
            CoreRestarts(self.engine_core, self.output_processor)  # type: ignore[arg-type]
            if config.parallel_config.use_ray else None
        )

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and enqueue; `n > 1` fans out into child requests
        that the OutputProcessor gathers back into one RequestOutput."""
        core_reqs, prompt_text = self.processor.process_with_fanout(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority, lora_request=lora_request
        )
        self.output_processor.add_fanout(request_id, core_reqs, prompt_text, output_kind)
        self.engine_core.add_requests(core_reqs)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = self.output_processor.child_request_ids(request_ids)
        self.engine_core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step's outputs. A request whose step raised on a live
        worker raises here (offline, the caller sees it); a dead engine on
        Ray is replaced and this step returns nothing new."""
        try:
            core_outputs = self.engine_core.step()
        except StepFailedError:
            raise
        except EngineDeadError as failure:
            if self.restarts is None:
                raise
            self.restarts.drop_culprits(failure)  # blames none: past the limit in a row, re-raises
            self.restarts.replace_core(failure, self.output_processor.resumable_requests())
            return []
        if self.restarts is not None:
            self.restarts.step_done()
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
