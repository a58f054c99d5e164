"""`AsyncLLM` is an `EngineClient`: it has every member of the protocol the
OpenAI layer is written against, each method with the protocol's
parameters (names, kinds, defaults) and its sync/async kind, and on a real
engine the members answer as the engine's own parts do."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.entrypoints.openai.engine_client import EngineClient
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams

ENGINE = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=64)
MESSAGES = [{"role": "user", "content": "hello there"}]


def _members() -> dict[str, object]:
    return {name: value for name, value in vars(EngineClient).items() if not name.startswith("_")}


def _parameters(function: object) -> list[tuple[str, object, object]]:
    assert callable(function)
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", sorted(n for n, v in _members().items() if not isinstance(v, property)))
def test_async_llm_methods_have_the_protocol_signatures(name: str) -> None:
    declared = _members()[name]
    implemented = getattr(AsyncLLM, name)
    assert _parameters(implemented) == _parameters(declared)
    assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared)


def test_a_real_async_llm_is_an_engine_client(tiny_model_dir: Path, tiny_tokenizer) -> None:
    async def main() -> None:
        engine = async_llm_from_engine_args(EngineArgs(model=str(tiny_model_dir), **ENGINE))
        try:
            assert isinstance(engine, EngineClient)
            assert (engine.served_model_name, engine.model_path) == (str(tiny_model_dir), str(tiny_model_dir))
            assert (engine.max_model_len, engine.vocab_size) == (128, 4096)
            assert engine.tokenize("hello world") == tiny_tokenizer.encode("hello world")
            rendered = engine.render_chat(MESSAGES, add_generation_prompt=True)
            assert rendered == tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            engine.check_runner(SamplingParams())
            with pytest.raises(InvalidParameterError) as pooling:
                engine.check_runner(PoolingParams())
            assert pooling.value.param == "model"
            with pytest.raises(InvalidParameterError) as lora:
                engine.check_lora(LoRARequest("adapter", 1, str(tiny_model_dir)))
            assert lora.value.param == "lora_request"
            await engine.check_health()
            payload, content_type = await engine.render_metrics()
            assert content_type.startswith("text/plain") and b"rayvllm:num_requests_running" in payload
            assert engine.num_pending_requests() == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
