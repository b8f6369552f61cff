"""A GEMM's input not yet computed: the norm before the QKV and gate/up projections, SiLU-mul before down.

A layer hands one of these to the linear layer after it instead of the tensor. Where that layer's skinny
GEMM computes the input in its prologue (``PAT_GEMM_PROLOGUE=fused``, few rows: model/gpu_gemm.py) the
norm or SiLU-mul costs no kernel of its own; elsewhere ``computed`` runs the kernel (or formula) the layer
ran before. Either way the values are the same operations with the same roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pat_engine.model import gpu_gemm

if TYPE_CHECKING:  # norm.py's layer; imported for the annotation only
    from pat_engine.model.layers.norm import RMSNorm


@dataclass
class NormedInput:
    """``norm(x + residual)`` (``norm(x)`` without a residual). ``summed``, the residual stream the layer
    carries on (x + residual, or x), is set by whichever of ``computed`` or ``matmul`` runs."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: RMSNorm  # its weight and eps, and its kernels where no prologue computes it
    summed: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.x.shape[0] if self.x.dim() == 2 else -1

    def computed(self) -> torch.Tensor:
        if self.residual is None:
            self.summed = self.x
            return self.norm(self.x)
        h, self.summed = self.norm.add_forward(self.x, self.residual)
        return h

    def matmul(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out, self.summed = gpu_gemm.skinny_norm_matmul(self.x, self.residual, self.norm.weight, self.norm.eps,
                                                       weight, bias)
        return out


@dataclass
class GatedInput:
    """``silu(gate) * up`` of the gate/up projection's output (gate the first half of its columns), which
    ``act`` computes where no prologue does (the Triton kernel or torch's formula)."""

    gate_up: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]

    @property
    def rows(self) -> int:
        return self.gate_up.shape[0] if self.gate_up.dim() == 2 else -1

    def computed(self) -> torch.Tensor:
        return self.act(self.gate_up)

    def matmul(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gpu_gemm.skinny_silu_matmul(self.gate_up, weight, bias)


GemmInput = torch.Tensor | NormedInput | GatedInput
