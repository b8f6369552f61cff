"""The routed experts of a fast-mode step on the CPU (``cpu/moe_experts.cpp``): each core takes whole experts
(gate/up GEMM, SiLU-mul, down GEMM, routing weight) through their oneDNN packs, then adds each token's shares.
Built by ``cpu_extension``; ``PAT_CPU_MOE=torch`` turns it off (for A/B runs: ``cpu_extension.switched_on``), and
then each expert runs through ``layers/linear.py`` in turn.
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_MOE"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel serves these tokens (a CPU tensor of a supported dtype, the switch on, the library
    built); the caller also needs every expert's packs."""
    return cpu_extension.serves(x, DTYPES, ENV_SWITCH)


def experts(x: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, gate_up: list[torch.Tensor],
            down: list[torch.Tensor], offsets: list[int], gemm_rows: list[int] | None = None) -> torch.Tensor:
    """``(T, H)``: each token's routed experts' MLPs of it, weighted and added in ascending expert order, before
    the TP group's sum. ``order`` (T * k,): the (token, choice) rows grouped by expert (choice ``order[r]`` is
    token ``order[r] // k``'s); grouped rows ``offsets[i]:offsets[i + 1]`` go to the expert whose packs are
    ``gate_up[i]``, ``down[i]``; ``weights`` (T, k) in x's dtype. ``gemm_rows[i]`` (default: its own rows): how
    many rows expert i's GEMMs run with, zeros after its own. Call only where ``usable``."""
    if gemm_rows is None:
        gemm_rows = [b - a for a, b in zip(offsets, offsets[1:])]
    return torch.ops.pat_kernels.moe_experts_cpu(x.contiguous(), order.contiguous(), weights.contiguous(), gate_up,
                                                 down, offsets, gemm_rows)
