"""The names a server answers to (vLLM's `OpenAIServingModels`): the base
model's and its LoRA adapters', from `--lora-modules name=path ...` and
from /v1/load_lora_adapter at run time. `/v1/models` lists adapters with
`parent` = the base model, and `model=<adapter>` in a request picks one."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rayvllm.entrypoints.openai.protocol import ModelCard, ModelList
from rayvllm.messages.errors import InvalidParameterError, ModelNotFoundError
from rayvllm.messages.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(value: str | Sequence[str | dict] | None) -> list[LoRAModulePath]:
    """vLLM's forms: `name=path` items, or JSON objects with name, path and
    optionally base_model_name; a single string may hold several items
    separated by spaces (`serve run ... lora_modules="a=/p b=/q"`)."""
    if value is None:
        return []
    items: Sequence[str | dict] = value.split() if isinstance(value, str) else value
    modules: list[LoRAModulePath] = []
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except ValueError as e:
                raise InvalidParameterError("lora_modules", f"{item!r} is not valid JSON: {e}") from None
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"name", "path", "base_model_name"})
            if unknown or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
                raise InvalidParameterError(
                    "lora_modules", f"{item!r}: an object needs string name and path (and optionally base_model_name)"
                )
            modules.append(LoRAModulePath(item["name"], item["path"], item.get("base_model_name")))
            continue
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise InvalidParameterError("lora_modules", f"{item!r} is not name=path")
        modules.append(LoRAModulePath(name, path))
    return modules


class OpenAIServingModels:
    """Invariant: adapter names never shadow a base model name, and each
    adapter has an id of its own (a reloaded name gets a new one, so its
    cached prefixes and slot are never taken for the old adapter's)."""

    def __init__(
        self,
        base_model_names: list[str],
        max_model_len: int,
        root: str | None = None,
        lora_modules: Sequence[LoRAModulePath] = (),
        check_lora: Callable[[LoRARequest], object] | None = None,
    ) -> None:
        """`check_lora`: the engine's check of an adapter (raises
        InvalidParameterError), run when an adapter is added."""
        if not base_model_names:
            raise ValueError("base_model_names must not be empty")
        self.base_model_names = list(base_model_names)
        self.max_model_len = max_model_len
        self.root = root
        self.check_lora = check_lora
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._created = int(time.time())
        for module in lora_modules:
            self.load_lora_adapter(module.name, module.path)

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The served name a request's `model` picks and its adapter; an
        unknown name is a 404."""
        if not requested:
            return self.base_model_names[0], None
        if requested in self.base_model_names:
            return requested, None
        lora = self.lora_requests.get(requested)
        if lora is None:
            raise ModelNotFoundError(f"The model `{requested}` does not exist.")
        return requested, lora

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
            raise InvalidParameterError("lora_name", "lora_name and lora_path must be non-empty strings")
        if lora_name in self.base_model_names or lora_name in self.lora_requests:
            raise InvalidParameterError("lora_name", f"the name {lora_name!r} is already served")
        lora = LoRARequest(lora_name, next(self._ids), lora_path, self.base_model_names[0])
        if self.check_lora is not None:
            self.check_lora(lora)
        self.lora_requests[lora_name] = lora
        return lora

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Requests already admitted finish with the adapter; new ones are a 404."""
        if not isinstance(lora_name, str) or not lora_name:
            raise InvalidParameterError("lora_name", "must be a non-empty string")
        if self.lora_requests.pop(lora_name, None) is None:
            raise ModelNotFoundError(f"The LoRA adapter `{lora_name}` is not loaded.")

    def show_models(self) -> ModelList:
        cards = [
            ModelCard(id=name, created=self._created, root=self.root or self.base_model_names[0], max_model_len=self.max_model_len)
            for name in self.base_model_names
        ]
        cards += [
            ModelCard(id=name, created=self._created, root=lora.lora_path, parent=self.base_model_names[0])
            for name, lora in self.lora_requests.items()
        ]
        return ModelList(data=cards)
