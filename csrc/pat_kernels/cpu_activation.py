"""The CPU SiLU-and-mul kernel (``cpu/silu_mul.cpp``): ``silu(gate) * up`` of a gate/up projection's output
in one pass, with torch's formula's bits; float32 and bfloat16. Built by ``cpu_extension``.

float64 is left to the torch formula in ``pat_engine/model/layers/mlp.py`` (the exactness suite's dtype).
``PAT_CPU_ACTIVATION=torch`` turns the kernel off (for A/B runs: ``cpu_extension.switched_on``).
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_ACTIVATION"


def usable(gate_up: torch.Tensor) -> bool:
    """Whether the kernel serves ``gate_up``: a (rows, 2n) CPU tensor of a supported dtype with unit stride along
    a row, the switch on and the library built."""
    return gate_up.dim() == 2 and gate_up.stride(1) == 1 and cpu_extension.serves(gate_up, DTYPES, ENV_SWITCH)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``(rows, n)``: ``silu(gate_up[:, :n]) * gate_up[:, n:]``; call only where ``usable``."""
    return torch.ops.pat_kernels.silu_mul_cpu(gate_up)
