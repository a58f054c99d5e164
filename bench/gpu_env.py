"""What a GPU proof ran on (bench/gpu_proof.sh): device, CUDA, the versions
of every package the engine and its tests import, where `rayvllm` and its
remapped packages are imported from, and whether the offline engine
imports. Prints `key: value` lines; never fails on a missing package (it
says "missing")."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from collections.abc import Iterator

# The engine's third-party imports, then the proof's tools.
PACKAGES = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "yaml", "jinja2",
    "prometheus_client", "tqdm", "pytest", "xdist", "flash_attn", "ray",
)


def _version(name: str) -> str:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"missing ({type(exc).__name__}: {exc})".splitlines()[0]
    return str(getattr(module, "__version__", getattr(module, "VERSION", "present")))


def _cuda_lines() -> Iterator[str]:
    import torch

    yield f"torch CUDA: {torch.version.cuda}; cuDNN: {torch.backends.cudnn.version()}"
    if not torch.cuda.is_available():
        yield "CUDA device: none"
        return
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        yield (f"CUDA device {i}: {p.name}, compute capability {p.major}.{p.minor}, "
               f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")


def _origin(name: str) -> str:
    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # noqa: BLE001
        return f"not importable ({type(exc).__name__}: {exc})"
    return spec.origin if spec is not None and spec.origin else "not found"


def main() -> None:
    print(f"host: {platform.node()}")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"platform: {platform.platform()}")
    for name in PACKAGES:
        print(f"{name}: {_version(name)}")
    for line in _cuda_lines():
        print(line)
    for name in ("rayvllm", "rayvllm.kernels", "rayvllm.actors"):
        print(f"{name} from: {_origin(name)}")
    try:
        importlib.import_module("rayvllm.entrypoints.llm")
    except Exception as exc:  # noqa: BLE001
        print(f"engine import: failed ({type(exc).__name__}: {exc})".splitlines()[0])
    else:
        print("engine import: ok")


if __name__ == "__main__":
    main()
