"""The synchronous engine: Processor -> engine core client -> OutputProcessor.

Used by the offline `LLM`; the async loop of the server wraps the same
pieces. The core steps in its own loop (on a thread of this process, or in
the SchedulerActor); `step` reads what it pushed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine.restart_policy import RestartPolicy
from rayvllm.engine.weight_sync import sync_weights
from rayvllm.frontend.output_processor import OutputProcessor, mark_final_only
from rayvllm.frontend.processor import Processor
from rayvllm.messages.errors import EngineDeadError, InvalidParameterError, StepFailedError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.utils.tokenizer import get_tokenizer


class LLMEngine:
    """`engine_core`: the client of the core it drives, started (which kind
    is chosen above this package: rayvllm.actors.factory)."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient) -> None:
        self.config = config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(
            config.model_config, self.tokenizer, max_logprobs=config.max_logprobs,
            max_n=config.scheduler_config.max_num_seqs, lora_config=config.lora_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = engine_core
        # Requests added since the last step (each fan-out one group): they
        # reach the core together, before its next step, as one batch.
        self._unsent: list[list[EngineCoreRequest]] = []
        # A dead engine (a killed worker or SchedulerActor, a lost node) is
        # replaced and its requests resumed, as the serving engine does.
        self.restarts = RestartPolicy(engine_core, self.output_processor)
        self._asleep = False

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
    ) -> None:
        """Validate, tokenize and enqueue; `n > 1` fans out into child requests
        that the OutputProcessor gathers back into one RequestOutput.
        `final_only`: the caller reads the request's output only when it
        has finished, and never an aborted one's (`LLM.generate`): with
        FINAL_ONLY outputs, no stop strings and no logprobs, the core then
        sends this process the request's first token and its end only, and
        an abort's output holds the first token alone."""
        if self._asleep:
            raise InvalidParameterError("engine", "the engine is asleep: wake_up() first")
        core_reqs, prompt_text = self.processor.process_with_fanout(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority, lora_request=lora_request
        )
        if final_only:
            core_reqs = mark_final_only(core_reqs, output_kind)
        self.output_processor.add_fanout(request_id, core_reqs, prompt_text, output_kind)
        self._unsent.append(core_reqs)

    def _send_added(self) -> None:
        groups, self._unsent = self._unsent, []
        self.engine_core.add_request_groups(groups)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = self.output_processor.child_request_ids(request_ids)
        self._send_added()  # an abort never overtakes the add it names
        self.engine_core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the engine steps since the last call (waiting for
        one when none is ready). A request whose step raised on a live
        worker raises here (offline, the caller sees it); a dead engine is
        replaced (`RestartPolicy`) and this call returns nothing new."""
        if not self.has_unfinished_requests() and not self.engine_core.has_pending_intake():
            return []  # an idle core pushes nothing
        try:
            self._send_added()
            core_outputs = self.engine_core.step()
        except StepFailedError:
            raise
        except EngineDeadError as failure:
            self.restarts.begin(failure)
            self.restarts.replace(failure)
            return []
        self.restarts.step_done()
        result = self.output_processor.process_outputs(core_outputs)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
            if not self.has_unfinished_requests():
                # The batch is done: the core has freed what those held
                # (applied inputs are acknowledged by a push) before the
                # caller looks.
                try:
                    while self.engine_core.has_pending_intake():
                        self.engine_core.step()
                except EngineDeadError:
                    pass  # a dead core holds nothing; the next step replaces it
        return result.request_outputs

    # ---- the control plane (docs/RL.md): utility calls, run between steps ----------

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """`method` on every worker: a worker method's name (a
        `worker_extension_cls` adds some) or a function given the worker
        first; each worker's result, in rank order."""
        return self.engine_core.call_utility("collective_rpc", method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False while requests hold blocks."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def init_weight_transfer_engine(self, backend: str, **init_info: Any) -> None:
        """Prepare every worker for updates by `backend`; gloo/nccl join the
        trainer's group (`master_address`, `master_port`, `world_size`,
        `rank_offset`: the first engine worker's rank, 1 by default)."""
        self.engine_core.call_utility("init_weight_transfer_engine", backend, **init_info)

    def start_weight_update(self) -> None:
        self.engine_core.call_utility("start_weight_update")

    def update_weights(self, update_info: WeightUpdateInfo | dict[str, Any] | None = None, weights: Any = None) -> None:
        """One chunk: `weights` (a dict or an object ref) for ray, else the
        names, dtype_names and shapes of the tensors the trainer broadcasts."""
        self.engine_core.call_utility("update_weights", update_info, self.engine_core.share_weights(weights))

    def finish_weight_update(self) -> None:
        self.engine_core.call_utility("finish_weight_update")

    def sync_weights(self, weights: Any, backend: str = "ray") -> None:
        """The four phases in one call (engine/weight_sync.py)."""
        sync_weights(self.engine_core, weights, backend)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; the weights stay in host memory) or the
        weights too (level 2); memory really goes back to the OS. Nothing
        generates until `wake_up` brings the KV cache back."""
        self.engine_core.call_utility("sleep", level)
        self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the `tags` ("weights", "kv_cache"; None: both); level
        2's weights come back from the checkpoint, unless a weight update
        brought new ones meanwhile."""
        self._asleep = self.engine_core.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self._asleep

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        self.restarts.close()
        self.engine_core.shutdown()
