"""The routed experts of a fast-mode step on the CPU (``cpu/moe_experts.cpp``): each core takes whole experts
(gate/up GEMM, SiLU-mul, down GEMM, routing weight) through their oneDNN packs. Built by ``cpu_extension``;
``PAT_CPU_MOE=torch`` turns it off (for A/B runs: ``cpu_extension.switched_on``), and then each expert runs
through ``layers/linear.py`` in turn.
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_MOE"


def usable(rows: torch.Tensor) -> bool:
    """Whether the kernel serves these rows (a CPU tensor of a supported dtype, the switch on, the library built);
    the caller also needs every expert's packs."""
    return cpu_extension.serves(rows, DTYPES, ENV_SWITCH)


def experts(rows: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor], offsets: list[int],
            row_weights: torch.Tensor) -> torch.Tensor:
    """``(N, H)``: each row's routing weight times its expert's MLP of it, before the TP group's sum; rows
    ``offsets[i]:offsets[i + 1]`` go to the expert whose packs are ``gate_up[i]``, ``down[i]``. Call only where
    ``usable``."""
    return torch.ops.pat_kernels.moe_experts_cpu(rows.contiguous(), gate_up, down, offsets, row_weights.contiguous())
