"""The router ingress's hints for an HTTP request: exactly the token ids
the replica's Processor makes of its prompt (or none where the blocks would
hash otherwise), and its session."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayvllm.entrypoints.openai.routing_hints import routing_hints
from rayvllm.frontend.processor import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NAME = "tiny"


def test_completion_prompts_tokenize_as_the_processor_does(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    text = routing_hints("/v1/completions", {"prompt": "hello there"}, {}, tiny_tokenizer, NAME)
    assert text.prompt_token_ids == list(tiny_tokenizer.encode("hello there"))
    bare = routing_hints("/v1/completions", {"prompt": "hello", "add_special_tokens": False}, {}, tiny_tokenizer, NAME)
    assert bare.prompt_token_ids == list(tiny_tokenizer.encode("hello", add_special_tokens=False))
    ids = routing_hints("/v1/completions", {"prompt": [7, 8, 9], "model": NAME}, {}, tiny_tokenizer, NAME)
    assert ids.prompt_token_ids == [7, 8, 9]
    batch = routing_hints("/v1/completions", {"prompt": [[5, 6], [7]]}, {}, tiny_tokenizer, NAME)
    assert batch.prompt_token_ids == [5, 6]


def test_chat_renders_the_template_as_the_server_does(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hints = routing_hints("/v1/chat/completions", {"messages": messages}, {}, tiny_tokenizer, NAME)
    text = render_chat(tiny_tokenizer, messages)
    assert hints.prompt_token_ids == list(tiny_tokenizer.encode(text, add_special_tokens=False))


def test_blocks_that_hash_otherwise_get_no_tokens(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    """An adapter's model, a cache salt, a request's own template, a body the
    server will refuse, another route: routed by load, never guessed."""
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "model": "some-adapter"}),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "s"}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/chat/completions", {"messages": messages, "chat_template": "{{ messages }}"}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/embeddings", {"input": "hi"}),
    ]:
        assert routing_hints(path, body, {}, tiny_tokenizer, NAME).prompt_token_ids is None, body


def test_the_session_comes_from_the_header_else_the_user() -> None:
    tok = None  # no prompt is tokenized below
    assert routing_hints("/health", None, {"x-session-id": "s1"}, tok, NAME).session_id == "s1"  # type: ignore[arg-type]
    body = {"user": "u1", "model": "adapter"}
    assert routing_hints("/v1/completions", body, {}, tok, NAME).session_id == "u1"  # type: ignore[arg-type]
    both = routing_hints("/v1/completions", body, {"x-session-id": "s2"}, tok, NAME)  # type: ignore[arg-type]
    assert both.as_kwargs() == {"prompt_token_ids": None, "session_id": "s2"}
