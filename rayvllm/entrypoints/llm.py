"""Offline batch inference: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from tqdm import tqdm

from rayvllm.actors.factory import llm_engine_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.weight_update import WeightUpdateInfo

PromptType = str | dict[str, Any] | list[int]
_Params = TypeVar("_Params", SamplingParams, PoolingParams)


class LLM:
    """vLLM's offline API. With no `model`, the embedded demo model is used.

    Any `EngineArgs` field is accepted as a keyword (`tokenizer`, `dtype`,
    `max_model_len`, `max_num_seqs`, `kv_cache_memory_bytes`, ...), with
    EngineArgs' defaults (docs/CONFIG.md lists them), as in vLLM.
    On Ray, `placement_group` (a caller's `ray.util.placement_group`) puts
    the engine's workers in its bundles, one per rank in the order
    `placement_group_bundle_indices` gives (default: the first ones); the
    group stays the caller's (docs/RL.md).
    """

    def __init__(
        self, model: str | None = None, *, placement_group: Any = None,
        placement_group_bundle_indices: Sequence[int] | None = None, **kwargs: Any,
    ) -> None:
        args = EngineArgs.from_dict({"model": model, **kwargs})
        self.llm_engine = llm_engine_from_engine_args(
            args, placement_group=placement_group, placement_group_bundle_indices=placement_group_bundle_indices
        )
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Release the engine: with the Ray backend, its scheduler actor,
        worker actors, process groups and placement groups."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # ---- the control plane for RL loops (docs/RL.md); `LLMEngine` documents each --

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def init_weight_transfer_engine(self, backend: str, **init_info: Any) -> None:
        self.llm_engine.init_weight_transfer_engine(backend, **init_info)

    def start_weight_update(self) -> None:
        self.llm_engine.start_weight_update()

    def update_weights(self, update_info: WeightUpdateInfo | dict[str, Any] | None = None, weights: Any = None) -> None:
        self.llm_engine.update_weights(update_info, weights)

    def finish_weight_update(self) -> None:
        self.llm_engine.finish_weight_update()

    def sync_weights(self, weights: Any, backend: str = "ray") -> None:
        self.llm_engine.sync_weights(weights, backend)

    def sleep(self, level: int = 1) -> None:
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order. `lora_request`:
        one adapter for every prompt, or one (or None: the base model) each."""
        prompt_list = _prompt_list(prompts)
        params_list = _per_prompt(sampling_params, SamplingParams, len(prompt_list), "sampling_params")
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidParameterError("priority", "must have one entry per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise InvalidParameterError("lora_request", f"got {len(loras)} for {len(prompt_list)} prompts")
        ids = self._add_requests(prompt_list, params_list, priority, loras)
        return cast(list[RequestOutput], self._run_engine(ids, use_tqdm))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One `EmbeddingRequestOutput` per prompt, in input order; the
        engine must run the pooling runner (`runner="pooling"` or
        `task="embed"`)."""
        return [EmbeddingRequestOutput.from_base(out) for out in self.encode(prompts, pooling_params, use_tqdm)]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One `PoolingRequestOutput` per prompt (`outputs.data`: the vector
        as a float32 tensor), in input order; a pooling runner's engine."""
        prompt_list = _prompt_list(prompts)
        params_list = _per_prompt(pooling_params, PoolingParams, len(prompt_list), "pooling_params")
        ids = self._add_requests(prompt_list, params_list, None, [None] * len(prompt_list))
        return cast(list[PoolingRequestOutput], self._run_engine(ids, use_tqdm))

    def _add_requests(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None],
    ) -> list[str]:
        """Add every prompt, or none: a bad one aborts those added before it."""
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                if isinstance(prompt, list):
                    prompt = {"prompt_token_ids": prompt}
                request_id = str(next(self._counter))
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0, lora_request=loras[i],
                    final_only=True,
                )
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        processor = self.llm_engine.processor
        prompts: list[PromptType] = []
        for conv in conversations:
            text = processor.render_chat(
                conv,  # type: ignore[arg-type]
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            # The rendered text already holds the template's special tokens.
            ids = processor.tokenize(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, a prompt dict or token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [cast(PromptType, prompts)]
    return list(cast(Sequence[PromptType], prompts))


def _per_prompt(params: _Params | Sequence[_Params] | None, kind: type[_Params], n: int, name: str) -> list[_Params]:
    """The params of each of `n` prompts: one for all (the default when None), or one each."""
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    given = list(cast(Sequence[_Params], params))
    if len(given) != n:
        raise InvalidParameterError(name, f"got {len(given)} {kind.__name__} for {n} prompts")
    return given
