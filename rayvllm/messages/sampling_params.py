"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5
# Seeds are signed 64-bit integers, as OpenAI's API types them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Per-request caps on what the engine holds and checks every step for a
# request: each stop string is searched in every new piece of text, each
# logit_bias entry and stop token id is applied or compared per step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample one request.

    Invariants after construction: `stop` and `stop_token_ids` are lists;
    every float is finite and every integer within the range the engine can
    hold (a seed fits in 64 bits), so no value of one request can make a
    step fail; `top_k == 0` means no top-k (vLLM's -1 is accepted and normalised to 0);
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
    # The output must match this grammar (JSON schema, regex, choice, EBNF).
    structured_outputs: StructuredOutputsParams | None = None
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
            self.logit_bias = _logit_bias(self.logit_bias)
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

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, f"must be an integer, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise bad(name, f"must be an integer, got {value!r}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
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
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"must be a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise bad(name, f"must be >= 0, got {value}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            # Stop ids are barred until min_tokens, but a finished grammar
            # allows nothing else: the row would have no token left.
            if self.min_tokens:
                raise bad("min_tokens", "cannot be combined with structured_outputs")

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


def _logit_bias(bias: object) -> dict[int, float]:
    """`{token id: bias}` from a mapping whose keys may be decimal strings
    (JSON object keys always are)."""
    if not isinstance(bias, dict):
        raise InvalidParameterError("logit_bias", f"must be a mapping of token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = key if _is_int(key) else int(str(key), 10)
        except ValueError:
            raise InvalidParameterError("logit_bias", f"keys must be token ids, got {key!r}") from None
        if not _is_number(value):
            raise InvalidParameterError("logit_bias", f"values must be numbers, got {value!r}")
        out[token_id] = float(value)
    return out
