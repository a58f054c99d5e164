"""The OpenAI server's own options (beside the engine's `EngineArgs`): one
model that `serve run ... key=value`, `serve_config.yaml`, `rayvllm
serve --flag`, the Serve builder and the `LLMServer` replica all read, so
each default and its help live here only. Ray-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass
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


class Plane(enum.Enum):
    """Who a route is for. `API`: clients (completions, models, health...),
    always mounted. `ADAPTERS`: loading LoRA adapters by server path at run
    time (`allow_runtime_lora_updating`). `CONTROL`: the RL control plane
    (pause, reset the prefix cache, sleep, weight transfer:
    `enable_control_plane`). The last two change what the server serves for
    everyone; a server mounts them only when their option is on (otherwise
    they answer 404 as unknown paths do), and they take the admin key."""

    API = "api"
    ADAPTERS = "adapters"
    CONTROL = "control"


# The option that mounts each plane beyond the API.
PLANE_OPTIONS = {Plane.ADAPTERS: "allow_runtime_lora_updating", Plane.CONTROL: "enable_control_plane"}


@dataclass(frozen=True)
class RouteAccess:
    """The routes a server (or the router ingress in front of several)
    mounts and the keys each takes. Invariant (`ServerArgs` checks it): a
    plane beyond `API` is mounted with a key unless the operator said the
    port is private."""

    planes: frozenset[Plane]
    api_key: str | None = None
    admin_api_key: str | None = None

    def keys(self, plane: Plane) -> tuple[str, ...]:
        """The keys a route of `plane` accepts (none: it is open). The API
        takes the API key, and the admin key too (an admin is a client);
        the other planes take the admin key, or the API key where no admin
        key is set."""
        if plane is Plane.API:
            return () if self.api_key is None else tuple(k for k in (self.api_key, self.admin_api_key) if k)
        admin = self.admin_api_key or self.api_key
        return () if admin is None else (admin,)

    def unguarded(self) -> list[str]:
        """The options of the mounted planes beyond `API` that take no key."""
        return [PLANE_OPTIONS[p] for p in sorted(self.planes, key=lambda p: p.value) if p in PLANE_OPTIONS
                and not self.keys(p)]


class ServerArgs(BaseModel):
    """Options of the server itself (not of the engine); `rayvllm serve`
    takes each as a `--flag`."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on the API routes")
    enable_control_plane: bool = Field(
        False, description="mount the RL control-plane routes (/pause, /resume, /reset_prefix_cache, /sleep, "
        "/wake_up, weight transfer) on the HTTP port; they take admin_api_key, or api_key where it is unset",
    )
    admin_api_key: str | None = Field(
        None, description="the key of the control-plane and runtime LoRA routes (instead of api_key, so that a "
        "client allowed to generate is not thereby allowed to replace weights)",
    )
    port_is_private: bool = Field(
        False, description="only trusted clients reach the HTTP port: the control plane and runtime LoRA "
        "loading may then run without a key (a warning at start)",
    )
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
        False, description="mount /v1/load_lora_adapter and /v1/unload_lora_adapter; they take admin_api_key, "
        "or api_key where it is unset"
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

    @model_validator(mode="after")
    def _admin_routes_are_guarded(self) -> "ServerArgs":
        access = self.access()
        unguarded = access.unguarded()
        if unguarded and not self.port_is_private:
            raise ValueError(
                f"{' and '.join(unguarded)} would let anyone who reaches the port change the server, and no key "
                "guards it: set admin_api_key (or api_key), or port_is_private=true if only trusted clients "
                "reach the port"
            )
        if len(access.planes) == 1 and (self.admin_api_key is not None or self.port_is_private):
            raise ValueError(
                "admin_api_key and port_is_private apply to the control plane and runtime LoRA loading, and "
                "neither is on (enable_control_plane, allow_runtime_lora_updating)"
            )
        return self

    def access(self) -> RouteAccess:
        """The routes to mount and their keys."""
        planes = {Plane.API}
        if self.enable_control_plane:
            planes.add(Plane.CONTROL)
        if self.allow_runtime_lora_updating:
            planes.add(Plane.ADAPTERS)
        return RouteAccess(frozenset(planes), self.api_key, self.admin_api_key)

    def open_planes_warning(self) -> str | None:
        """What the log says at start when planes beyond the API take no key."""
        unguarded = self.access().unguarded()
        if not unguarded:
            return None
        return (
            f"{' and '.join(unguarded)} with no key (port_is_private=true): anyone who reaches this server's "
            "port can pause it, reset its cache or replace its weights or adapters"
        )

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
