"""What the KV-aware router needs to know of an HTTP request, worked out
once at the router ingress: the prompt's token ids exactly as the replica's
Processor will make them, and the request's session. Ray-free.

A request whose blocks the ingress cannot hash as the engine will (an
adapter's model, a cache salt, a request's own chat template, a body that
does not parse: its replica answers that) gets no token ids and is routed
by load and session alone; it is never guessed from its text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayvllm.entrypoints.openai.protocol import ChatCompletionRequest, parse_request
from rayvllm.frontend.processor import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["SESSION_HEADER", "RoutingHints", "routing_hints"]

# The header that keeps a conversation on one replica (else the body's `user`).
SESSION_HEADER = "x-session-id"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class RoutingHints:
    """The keyword arguments a routed call carries for the router."""

    prompt_token_ids: list[int] | None = None
    session_id: str | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_token_ids, "session_id": self.session_id}


def routing_hints(
    path: str, data: Mapping[str, Any] | None, headers: Mapping[str, str], tokenizer: "PreTrainedTokenizerBase",
    served_model_name: str,
) -> RoutingHints:
    session = headers.get(SESSION_HEADER)
    if session is None and data is not None and isinstance(data.get("user"), str):
        session = data["user"]
    tokens = None
    if data is not None and _base_model(data, served_model_name) and data.get("cache_salt") is None:
        try:
            tokens = _prompt_tokens(path, data, tokenizer)
        except Exception:  # noqa: BLE001 - the replica answers a bad body; routing goes by load
            tokens = None
    return RoutingHints(tokens, session)


def _base_model(data: Mapping[str, Any], served_model_name: str) -> bool:
    model = data.get("model")
    return model is None or model == served_model_name


def _prompt_tokens(path: str, data: Mapping[str, Any], tokenizer: "PreTrainedTokenizerBase") -> list[int] | None:
    if path == COMPLETIONS_PATH:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt, add_special_tokens=bool(data.get("add_special_tokens", True))))
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        return None
    if path == CHAT_PATH:
        req = parse_request(ChatCompletionRequest, dict(data))
        if req.chat_template is not None:
            return None
        text = render_chat(tokenizer, req.template_messages(), **req.template_options(), tools=req.template_tools())
        return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
    return None
