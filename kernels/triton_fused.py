"""Triton kernels fusing a decoder layer's small elementwise ops on a GPU:
residual add + RMSNorm, per-head RMSNorm + RoPE on q and k, SiLU-and-mul.

Eager torch runs each of these as several kernels of a few microseconds
(about fifty per layer), which a CUDA graph still launches one by one; on a
decode step they cost more device time than the weight GEMMs (see
docs/BENCHMARKS.md, the first H100 run's profile). Each kernel here rounds
to the tensor dtype wherever torch's op-by-op arithmetic (and hence
transformers') rounds, so in float32 the results are torch's up to the order
of a reduction, and in half precision they differ from torch's only where
an intermediate lands on a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: s = x (+ residual, rounded to the dtype as
    torch's add rounds), stored to residual_out; out = weight * (s
    normalised in float32, rounded to the dtype), rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual `[..., N]` (last dim contiguous) -> (norm(x + residual),
    x + residual); without a residual, (norm(x), x). New tensors: the
    inputs are never written (a graph's static buffers may be among them)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        r2, r_out = x2, x2
    else:
        r2 = residual.reshape(-1, n)
        r_out = torch.empty_like(out)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, r_out, weight, out, x2.stride(0), r2.stride(0), r_out.stride(0), out.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
        )
    new_residual = x if residual is None else r_out.view(shape)
    return out.view(shape), new_residual


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    weight_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    half,
    eps,
    HAS_NORM: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    """One program per (token, head): the head's vector, RMS-normalised
    with `weight` when HAS_NORM (Qwen3's q/k norm), then rotated by its
    position (rotate-half layout): (x1 c - x2 s, x2 c + x1 s), each product
    and sum rounded to the dtype as torch's ops round."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, HALF_PADDED)
    mask = offs < half
    src = x_ptr + token * stride_xt + head * stride_xh
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        variance = (tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * half)
        inv = 1.0 / tl.sqrt(variance + eps)
        w1 = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (a * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * inv).to(dtype).to(tl.float32)).to(dtype)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    o1 = ((f1 * c).to(dtype).to(tl.float32) - (f2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((f2 * c).to(dtype).to(tl.float32) + (f1 * s).to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + token * stride_ot + head * stride_oh
    tl.store(dst + offs, o1, mask=mask)
    tl.store(dst + half + offs, o2, mask=mask)


def norm_rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    weight: torch.Tensor | None, eps: float,
) -> torch.Tensor:
    """x `[T, H, D]` (a view into the fused QKV output is fine: any token
    and head strides, contiguous dim) -> a new `[T, H, D]`, normalised per
    head when `weight` is given, then rotated; cos/sin `[max_pos, D/2]`."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        half = dim // 2
        _norm_rope_kernel[(tokens, heads)](
            x, out, positions, cos, sin, weight if weight is not None else cos, x.stride(0), x.stride(1),
            out.stride(0), out.stride(1), cos.stride(0), half, eps,
            HAS_NORM=weight is not None, HALF_PADDED=triton.next_power_of_2(half),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr,
):
    """Program (row, chunk): out = silu(gate) * up over BLOCK columns, with
    silu's result rounded to the dtype before the product, as torch's two
    ops round."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[T, 2I]` (gate then up) -> `[T, I]`."""
    tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block,
        )
    return out
