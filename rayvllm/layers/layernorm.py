"""RMSNorm with HF's arithmetic (normalise in float32, scale in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from rayvllm.kernels import cpu_ops


class RMSNorm(nn.Module):
    """`use_c_kernel` (the CPU's) and `use_triton_kernel` (a GPU's, half
    precision) are set by the model once it knows its device and dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_c_kernel = False
        self.use_triton_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton_kernel:
            from rayvllm.kernels import triton_fused

            return triton_fused.add_rms_norm(x, None, self.weight, self.eps)[0]
        if self.use_c_kernel:
            shape = x.shape
            return cpu_ops.add_rms_norm(x.reshape(-1, shape[-1]), None, self.weight, self.eps).view(shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the decoder's pre-norm
        pattern; with no residual yet (the first layer), (norm(x), x). The
        C kernel updates `residual` in place and returns it."""
        if residual is None:
            return self.forward(x), x
        if self.use_triton_kernel:
            from rayvllm.kernels import triton_fused

            return triton_fused.add_rms_norm(x, residual, self.weight, self.eps)
        if self.use_c_kernel:
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual
