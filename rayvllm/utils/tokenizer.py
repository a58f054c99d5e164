"""Tokenizer loading and end-of-sequence resolution.

The engine uses one HF fast tokenizer per model, loaded from a local
directory (no machine here reaches a hub). Which token ids end a sequence is
the union of the tokenizer's EOS and the ids the model's generation config
lists, because chat models (Llama 3, Qwen) stop on several tokens while their
tokenizer names only one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayvllm.messages.errors import InvalidParameterError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["get_tokenizer", "get_eos_token_ids", "load_generation_config_eos_ids"]


def get_tokenizer(
    path: str | Path,
    trust_remote_code: bool = False,
    revision: str | None = None,
    **kwargs: Any,
) -> "PreTrainedTokenizerBase":
    """Load the fast tokenizer at `path` (a model directory or hub id).

    Raises InvalidParameterError("tokenizer", ...) when nothing loadable is
    there, so a bad `--tokenizer` flag reads as a config error, not a trace.
    """
    # transformers is imported below, not at the top: it takes seconds to
    # import and most modules that import this one (config, tests of the
    # core) never need it.
    try:
        if revision is None and not kwargs and _is_plain_backend(Path(path)):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(str(path))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                str(path),
                trust_remote_code=trust_remote_code,
                revision=revision,
                use_fast=True,
                **kwargs,
            )
    except (OSError, ValueError, KeyError) as e:
        raise InvalidParameterError("tokenizer", f"cannot load a tokenizer from {str(path)!r}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        # Slow tokenizers work (the detokenizer has a pure-Python path) but
        # cost a lot more per token; say so once, at load time.
        logger.warning("Using a slow tokenizer for %s; incremental detokenization will be slower.", path)
    return tokenizer


def _is_plain_backend(directory: Path) -> bool:
    """Whether `AutoTokenizer` is certain to load this local directory as a
    `TokenizersBackend` over its tokenizer.json, whatever the model's
    config holds: its tokenizer config names that class (or its alias
    `PreTrainedTokenizerFast`) and no custom code, and the model type is
    not one whose declared class transformers overrides (its own lists).
    Loading that class directly skips `AutoConfig`, whose import of the
    model's config module brings in torch.distributed.tensor and sympy:
    seconds on the start of every front end and Serve replica."""
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not (isinstance(tokenizer_config, dict) and isinstance(model_config, dict)):
        return False
    if not (directory / "tokenizer.json").is_file() or "auto_map" in tokenizer_config:
        return False
    if tokenizer_config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return False
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    model_type, model_name = model_config.get("model_type"), model_config.get("model_name")
    overridden = MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    return (
        isinstance(model_type, str)
        and model_type not in overridden
        and not (isinstance(model_name, str) and model_name in overridden)
        and TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    )


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def load_generation_config_eos_ids(model_path: str | Path | None) -> list[int]:
    """EOS ids the model directory declares, in file order.

    generation_config.json wins; config.json is the fallback, mirroring how
    transformers derives a generation config from the model config. A path
    that is not a local directory (a hub id) yields [].
    """
    if model_path is None:
        return []
    directory = Path(model_path)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("Ignoring unreadable %s: %s", file, e)
            continue
        ids = _as_id_list(data.get("eos_token_id"))
        if ids or name == "generation_config.json":
            # A generation config without eos ids means "none beyond the
            # tokenizer's"; do not second-guess it with config.json.
            return ids
    return []


def get_eos_token_ids(tokenizer: "PreTrainedTokenizerBase", model_path: str | Path | None = None) -> list[int]:
    """All ids that end a sequence, primary first, without duplicates.

    The primary EOS (element 0) is the tokenizer's `eos_token_id`, or the
    generation config's first id when the tokenizer has none; it is the one
    the engine reports as `stop_reason=None`. Empty when neither knows one.
    """
    ids: list[int] = []
    primary = getattr(tokenizer, "eos_token_id", None)
    if isinstance(primary, int):
        ids.append(primary)
    for token_id in load_generation_config_eos_ids(model_path):
        if token_id not in ids:
            ids.append(token_id)
    return ids
