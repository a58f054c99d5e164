"""Engine logprobs (`{token id: Logprob}` per position) in OpenAI's two formats.

Each position's dict holds the chosen token and the top-k the request asked
for (see `rayvllm.messages.outputs.SampleLogprobs`). JSON has no -inf, so logprobs
are clamped to -9999.0 as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobsList,
)
from rayvllm.messages.outputs import Logprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MIN_LOGPROB", "LogprobFormatter", "Steps", "padded", "prompt_logprobs_field"]

MIN_LOGPROB = -9999.0

# One entry per token; None where the engine has no logprobs for it.
Steps = Sequence[dict[int, Logprob] | None]


def padded(steps: Steps, length: int) -> list[dict[int, Logprob] | None]:
    """`steps` cut or None-padded to `length` entries."""
    return list(steps[:length]) + [None] * (length - len(steps))


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _by_rank(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    # Unranked entries (rank None) sort after ranked ones, most likely first.
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def prompt_logprobs_field(steps: Steps) -> PromptLogprobsList:
    """vLLM's `prompt_logprobs` response field."""
    return [
        None
        if step is None
        else {
            token_id: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in step.items()
        }
        for step in steps
    ]


class LogprobFormatter:
    """Formats logprobs; token strings come from `Logprob.decoded_token`,
    else from decoding the id alone."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return str(self.tokenizer.decode([token_id]))

    def completion(
        self, token_ids: Sequence[int], steps: Steps, num_top: int, initial_offset: int = 0
    ) -> CompletionLogProbs:
        """Legacy completions format, one entry per token of `token_ids`.

        `top_logprobs[i]` holds the `num_top` most likely tokens plus the
        chosen one when it is not among them (OpenAI: up to logprobs + 1);
        `text_offset` starts at `initial_offset` and advances by each token
        string's length. A token without logprobs gets None entries.
        """
        result = CompletionLogProbs()
        offset = initial_offset
        for token_id, step in zip(token_ids, padded(steps, len(token_ids))):
            chosen = step.get(token_id) if step is not None else None
            token = self.token_text(token_id, chosen)
            if step is None or chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                top: dict[str, float] = {}
                for other_id, lp in _by_rank(step)[:num_top]:
                    top.setdefault(self.token_text(other_id, lp), _clamp(lp.logprob))
                top.setdefault(token, _clamp(chosen.logprob))
                result.token_logprobs.append(_clamp(chosen.logprob))
                result.top_logprobs.append(top)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def chat(self, token_ids: Sequence[int], steps: Steps, num_top: int) -> ChatCompletionLogProbs:
        """Chat format: per token its string, logprob and UTF-8 bytes, and the
        `num_top` most likely tokens by rank, whether or not chosen is among them."""
        content: list[ChatCompletionLogProbsContent] = []
        for token_id, step in zip(token_ids, padded(steps, len(token_ids))):
            chosen = step.get(token_id) if step is not None else None
            token = self.token_text(token_id, chosen)
            top: list[ChatCompletionLogProb] = []
            if step is not None and num_top > 0:
                for other_id, lp in _by_rank(step)[:num_top]:
                    text = self.token_text(other_id, lp)
                    top.append(ChatCompletionLogProb(token=text, logprob=_clamp(lp.logprob), bytes=_utf8(text)))
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=_clamp(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                    bytes=_utf8(token),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)
