"""The OpenAI server's own options (beside the engine's `EngineArgs`): one
model that `serve run ... key=value`, `serve_config.yaml`, `rayvllm
serve --flag`, the Serve builder and the `LLMServer` replica all read, so
each default and its help live here only. Ray-free."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayvllm.config.engine_args import validate_args
from rayvllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

# Unfinished requests a server admits per sequence slot of its engine
# (max_num_seqs) unless `max_pending_requests` says otherwise: enough queue
# to keep every slot busy, bounded so that a flood gets 503s, not memory.
PENDING_PER_SEQ = 4
# Prompt tokens admitted but not yet prefilled, unless
# `max_pending_prompt_tokens` says otherwise: this many full prefill steps
# (max_num_batched_tokens each), and room for a few max_model_len prompts.
# Beyond it a queue is minutes of prefill that every new request would wait
# behind: a 503 that a client or router can act on is kinder. Enough for
# the request bound's worth of 1,024-token prompts at max_num_seqs 64: at
# 32 steps a burst of 200 prompts of 512 tokens (ten seconds of prefill
# for a small model on 2 cores) got 72 503s where vLLM's server, which
# has no such bound, queued them all (docs/BENCHMARKS.md).
PENDING_PREFILL_STEPS = 128
PENDING_MAX_LEN_PROMPTS = 4


def default_max_pending_prompt_tokens(max_num_batched_tokens: int, max_model_len: int) -> int:
    return max(PENDING_PREFILL_STEPS * max_num_batched_tokens, PENDING_MAX_LEN_PROMPTS * max_model_len)


# How requests are spread over replicas (`request_router`).
REQUEST_ROUTERS = ("kv", "pow2")


class ServerArgs(BaseModel):
    """Options of the server itself (not of the engine); `rayvllm serve`
    takes each as a `--flag`."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on the API routes")
    max_pending_requests: int | None = Field(
        None, description=f"answer 503 beyond this many unfinished requests; unset: {PENDING_PER_SEQ} x max_num_seqs"
    )
    max_pending_prompt_tokens: int | None = Field(
        None, description="answer 503 when a request would queue more than this many prompt tokens not yet "
        f"prefilled; unset: max({PENDING_PREFILL_STEPS} x max_num_batched_tokens, "
        f"{PENDING_MAX_LEN_PROMPTS} x max_model_len)",
    )
    # Each access-log line costs the replica and Ray's log monitor CPU that a
    # small machine's forward needs (vLLM: --disable-uvicorn-access-log).
    disable_access_log: bool = Field(False, description="no per-request access log line from the replica")
    # A max_model_len prompt of token ids is well under 1 MiB of JSON.
    max_request_bytes: int | None = Field(
        16 << 20, description="answer 413 to request bodies over this many bytes (None: no limit)"
    )
    # Serve stops routing to a replica that shuts down, waits for its
    # requests up to this long, then stops it (its graceful_shutdown_timeout_s).
    drain_timeout_s: float = Field(30.0, description="on shutdown, how long in-flight requests get to finish")
    # Serve's own period: checking every 2 s cost burst throughput on a small
    # machine (docs/BENCHMARKS.md); shorter finds a dead replica sooner.
    health_check_period_s: float = Field(
        10.0, gt=0, description="how often Serve checks each replica; a dead one is replaced after its next check"
    )
    step_timeout_s: float | None = Field(
        None, description="an engine step running longer is taken for a hang: the engine is restarted, "
        "its requests resumed; unset: AsyncLLM's STEP_TIMEOUT_S",
    )
    # A template is code, run (sandboxed) on the replica.
    trust_request_chat_template: bool = Field(
        False, description="accept a chat_template in requests (vLLM's name)"
    )
    enable_auto_tool_choice: bool = Field(
        False, description='let the model call tools on its own (tool_choice "auto"); needs tool_call_parser'
    )
    tool_call_parser: str | None = Field(
        None, description=f"how tool calls are found in the model's text: {', '.join(TOOL_PARSERS)} (vLLM's names)"
    )

    lora_modules: list[str] | str | None = Field(
        None, description="LoRA adapters to serve as models, name=path each (vLLM's form; needs enable_lora)"
    )
    # vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING; here an option (clients name server paths).
    allow_runtime_lora_updating: bool = Field(
        False, description="serve /v1/load_lora_adapter and /v1/unload_lora_adapter"
    )
    num_replicas: int = Field(1, ge=1, description="Serve replicas of the server, each with its own engine")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="scale replicas between min_replicas and max_replicas (Serve's keys: upscale_delay_s, "
        "downscale_delay_s, look_back_period_s, ...) on the engines' load: target_queued_prompt_tokens, "
        "target_ongoing_requests, target_kv_usage per replica (instead of num_replicas)",
    )
    request_router: str = Field(
        "kv", description="with more than one replica: 'kv' sends each request where its prefix is cached, "
        "weighed against load; 'pow2' is Serve's own power-of-two-choices router",
    )
    stream_migration_limit: int = Field(
        3, ge=0, description="with more than one replica: how many times a stream whose replica dies moves to "
        "another, continuing from the tokens sent (0: it ends with an error event)",
    )

    @property
    def max_replicas(self) -> int:
        """The most replicas this server may run at once."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", 1))
        return self.num_replicas

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServerArgs":
        """From a plain dict whose values may be text, converted by each
        field's type; errors name the offending keys."""
        return validate_args(cls, data)

    @model_validator(mode="after")
    def _one_way_to_count_replicas(self) -> "ServerArgs":
        if self.autoscaling_config is not None and self.num_replicas != 1:
            raise ValueError("num_replicas and autoscaling_config exclude each other (autoscaling sets the count)")
        return self

    @field_validator("request_router")
    @classmethod
    def _known_router(cls, value: str) -> str:
        if value not in REQUEST_ROUTERS:
            raise ValueError(f"unknown request_router {value!r}; expected one of {', '.join(REQUEST_ROUTERS)}")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; expected one of {', '.join(TOOL_PARSERS)}")
        return value
