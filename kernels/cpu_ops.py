"""Fused float32 CPU ops of the decoder layer (`csrc_cpu_ops.c`): add +
RMSNorm, RoPE + KV-cache write, and SiLU-and-mul. Callers check `available()` and keep the
torch path for other dtypes and devices."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from rayvllm.kernels.cbuild import load_library
from rayvllm.kernels.cpu_isa import selected_isa

# No FMA contraction: the rotation then rounds exactly like torch's
# elementwise mul/sub, keeping the C path bit-identical to the torch one.
# No trapping math: without AVX-512's masked lanes GCC keeps a loop with a
# select around float arithmetic (SiLU's exp) scalar unless told that float
# ops raise no traps; values are unchanged, only FP exception flags differ.
_FLAGS = ["-ffp-contract=off", "-fno-trapping-math"]


@lru_cache(maxsize=None)
def _library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `isa` (default: the variant kernels/cpu_isa.py selects)."""
    lib = load_library("csrc_cpu_ops.c", _FLAGS, isa)
    if lib is None:
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.silu_and_mul_f32.argtypes = [ptr, ptr, i64, i64, i32]
    lib.apply_token_bitmask_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i32]
    lib.rope_and_cache_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr] + [i64] * 5 + [i32]
    return lib


def available(isa: str | None = None) -> bool:
    return _library(isa) is not None


def silu_and_mul_ahead(isa: str | None = None) -> bool:
    """Whether the C SiLU beats torch's on this variant. The portable build
    has no vector rounding or blend (x86-64 baseline), so its SiLU runs
    several times slower than torch's own vectorised one; the AVX2 and
    AVX-512 builds are ahead at every row count (docs/BENCHMARKS.md)."""
    return available(isa) and (isa or selected_isa()) != "portable"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, isa: str | None = None
) -> torch.Tensor:
    """`residual += x` in place (when given), then RMSNorm of it (or of x) times weight."""
    lib = _library(isa)
    assert lib is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, hidden = x.shape
    assert residual is None or residual.is_contiguous()
    lib.add_rms_norm_f32(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, hidden, eps, torch.get_num_threads(),
    )
    return out


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, H, D]`, k/v `[T, KVH, D]` (heads contiguous in each row, any
    row stride): returns rotated q and k, and writes rotated k and v to the
    cache (layouts of kernels/reference.py) at `slot_mapping` (-1 skipped)."""
    lib = _library(isa)
    assert lib is not None
    num_tokens, num_heads, head_size = q.shape
    kv_heads = k.shape[1]
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_size
    q_out = torch.empty(num_tokens, num_heads, head_size, dtype=q.dtype)
    k_out = torch.empty(num_tokens, kv_heads, head_size, dtype=k.dtype)
    lib.rope_and_cache_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        key_cache.data_ptr(), value_cache.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
        num_tokens, num_heads, kv_heads, head_size, value_cache.shape[1], torch.get_num_threads(),
    )
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """`silu(gate) * up` for rows `[gate | up]` of `gate_up` `[T, 2n]`: one
    pass instead of torch's two and their temporary. Not bit-identical to
    torch's SiLU (its own exp): within a few float32 ulps."""
    lib = _library(isa)
    assert lib is not None
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    lib.silu_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, isa: str | None = None
) -> None:
    """In place, float32 on the CPU: for each r in `rows`, `logits[r, t] =
    -inf` where row r of the int32 `bitmask` ([B, ceil(V / 32)], xgrammar's
    layout) clears bit t % 32 of word t // 32."""
    lib = _library(isa)
    assert lib is not None
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and rows.dtype == torch.int64
    lib.apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
        rows.data_ptr(), rows.shape[0], logits.shape[1], torch.get_num_threads(),
    )
