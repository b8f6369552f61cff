"""RMSNorm, computed in float32 as the reference implementation does.

Hugging Face's Llama/Qwen RMSNorm casts to float32 whatever the model dtype;
doing the same keeps float64 runs token-identical to ``transformers`` and is
the usual upcast for bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.parallel.shard_spec import replicated


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.shard_spec = replicated(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # nothing to cast: torch's fused kernel computes the same products
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
