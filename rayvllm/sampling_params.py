"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rayvllm.errors import InvalidParameterError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request.

    Invariants after construction: `stop` and `stop_token_ids` are lists;
    `top_k == 0` means no top-k (vLLM's -1 is accepted and normalised to 0);
    `temperature < 1e-5` means greedy, for which top_p/top_k/min_p are reset
    to their no-op values. `max_tokens=None` means "up to max_model_len".
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Filled by the Processor from the tokenizer/generation config, never by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        # Union, not assignment: `clone()` re-runs this and must keep the EOS
        # ids the Processor added.
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, msg: str) -> InvalidParameterError:
            return InvalidParameterError(name, msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None and any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise bad("logit_bias", "values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> "SamplingParams":
        return replace(self, **changes)
