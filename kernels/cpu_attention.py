"""The C decode kernel (`csrc_paged_attention.c`), built on first use.

It is compiled with the system C compiler into the rayvllm cache directory
(keyed by the source's hash, so edits rebuild) and called through ctypes,
which releases the GIL. Without a compiler the engine falls back to the torch
reference; `RAYVLLM_CPU_ATTENTION=torch` forces that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc_paged_attention.c")
# Reassociation lets the dot products vectorise (summation order differs from
# torch's in the last bits, like any other attention kernel); no -ffast-math,
# whose finite-math assumption would break the -inf running max.
_FLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-shared", "-fPIC", "-pthread",
]


def _cache_root() -> Path:
    root = os.environ.get("RAYVLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rayvllm"
    )
    return Path(root) / "kernels"


def _build() -> Path | None:
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _cache_root() / f"paged_attention_{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temp name and rename, so concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run(
        [compiler, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True
    )
    if result.returncode != 0:
        os.unlink(tmp)
        logger.warning("building the CPU attention kernel failed: %s", result.stderr.strip())
        return None
    os.replace(tmp, target)
    return target


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("RAYVLLM_CPU_ATTENTION", "c") == "torch":
        return None
    path = _build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention_decode_f32.argtypes = [ptr] * 5 + [i64, ptr, ptr] + [i64] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.paged_attention_decode_f32.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query `[T, H, D]` float32 (one query token per row); token t attends to
    keys `0 .. ctx_lens[t]-1` of block-table row `seq_rows[t]`."""
    lib = _library()
    assert lib is not None, "CPU attention kernel unavailable"
    assert query.dtype == torch.float32 and key_cache.dtype == torch.float32
    query = query.contiguous()
    out = torch.empty_like(query)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    assert block_tables.dtype == seq_rows.dtype == ctx_lens.dtype == torch.int64
    assert block_tables.is_contiguous() and seq_rows.is_contiguous() and ctx_lens.is_contiguous()
    lib.paged_attention_decode_f32(
        query.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_rows.data_ptr(), ctx_lens.data_ptr(),
        num_tokens, num_heads, kv_heads, head_size, block_size, scale, torch.get_num_threads(),
    )
    return out
