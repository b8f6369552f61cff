"""RMSNorm, computed in float32 as the reference implementation does.

Hugging Face's Llama/Qwen RMSNorm casts to float32 whatever the model dtype;
doing the same keeps float64 runs token-identical to ``transformers`` and is
the usual upcast for bf16. One pass per row, fused with the residual add before it
where the layer has one: on a GPU the Triton kernel (``pat_kernels.triton_norm``, chosen
when the layer is built: ``triton_ops``), on the CPU the C++ kernel (``pat_kernels.cpu_norm``)
for float32 and bfloat16 rows; float64 keeps the formula below.
"""

from __future__ import annotations

import torch
from torch import nn

from pat_engine.model.layers import triton_ops
from pat_engine.parallel.shard_spec import replicated

try:  # the kernels package ships with the engine; its absence only costs speed
    from pat_kernels import cpu_norm
except ImportError:  # pragma: no cover
    cpu_norm = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.shard_spec = replicated(size)
        self.triton = triton_ops.kernels_for(device, dtype)  # None: the CPU kernel or the formula

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton is not None and x.dim() == 2:
            return self.triton.rms_norm(x, self.weight, self.eps)
        if self._kernel_serves(x):
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        return self._formula(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the next norm in one pass."""
        if self.triton is not None and x.dim() == 2:
            return self.triton.add_rms_norm(x, residual, self.weight, self.eps)
        if self._kernel_serves(x):
            return cpu_norm.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self._formula(summed), summed

    def _kernel_serves(self, x: torch.Tensor) -> bool:
        return cpu_norm is not None and x.dim() == 2 and cpu_norm.usable(x)

    def _formula(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
