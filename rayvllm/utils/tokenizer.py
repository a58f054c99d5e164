"""Tokenizer loading and end-of-sequence resolution.

The engine uses one HF fast tokenizer per model, loaded from a local
directory (no machine here reaches a hub). Which token ids end a sequence is
the union of the tokenizer's EOS and the ids the model's generation config
lists, because chat models (Llama 3, Qwen) stop on several tokens while their
tokenizer names only one.
"""

from __future__ import annotations

import ast
import importlib.util
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
    overridden, mistral = _auto_tokenizer_exceptions()
    model_type, model_name = model_config.get("model_type"), model_config.get("model_name")
    return (
        isinstance(model_type, str)
        and model_type not in overridden
        and not (isinstance(model_name, str) and model_name in overridden)
        and model_type not in mistral
    )


def _auto_tokenizer_exceptions() -> tuple[frozenset[str], frozenset[str]]:
    """The model types (and names) whose declared tokenizer class
    `AutoTokenizer` overrides, and those it may load as
    `MistralCommonBackend`: transformers' two tables, read from the source
    of `transformers.models.auto.tokenization_auto`. Importing that module
    builds transformers' index of every model (over a second of CPU on each
    front end's start); its tables are literals, so parsing the file gives
    them. A mapping entry that names `MistralCommonBackend` anywhere counts
    (which one applies depends on an optional package). Falls back to the
    import when the file is not in that shape."""
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin is not None:
        source = Path(spec.origin).parent / "models" / "auto" / "tokenization_auto.py"
        try:
            tables = _parse_auto_tokenizer_tables(source.read_text())
        except (OSError, SyntaxError, ValueError):
            tables = None
        if tables is not None:
            return tables
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    return frozenset(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), frozenset(
        k for k, v in TOKENIZER_MAPPING_NAMES.items() if v == "MistralCommonBackend"
    )


def _parse_auto_tokenizer_tables(text: str) -> tuple[frozenset[str], frozenset[str]] | None:
    overridden: frozenset[str] | None = None
    mistral: set[str] | None = None
    for node in ast.parse(text).body:
        target, value = _assignment(node)
        if target == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS":
            if not isinstance(value, ast.Set):
                return None
            overridden = frozenset(ast.literal_eval(value))
        elif target == "TOKENIZER_MAPPING_NAMES" and value is not None:
            mistral = set()
            for entry in ast.walk(value):
                if not (isinstance(entry, ast.Tuple) and len(entry.elts) == 2):
                    continue
                key = entry.elts[0]
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and any(
                    isinstance(n, ast.Constant) and n.value == "MistralCommonBackend" for n in ast.walk(entry.elts[1])
                ):
                    mistral.add(key.value)
    if overridden is None or mistral is None or not all(isinstance(t, str) for t in overridden):
        return None
    return overridden, frozenset(mistral)


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    """(name, value) of a module-level `name = value` or `name: T = value`."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None


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
