"""The CPU kernel of the invariant mode's row-parallel product (``cpu/chunk_gemm.cpp``): a rank's node of
the reduction tree in one call, each output element in one fixed order (see the .cpp's contract).
Built by ``cpu_extension``.

The weight is read as ``panels``: its ``(n, K)`` shard transposed into blocks of 16 output columns in
the weight's own dtype, zero past n (bfloat16 keeps k in pairs, as AVX512-BF16's dot product reads
them); ``pat_engine/model/chunk_weights.py`` keeps them as derived state. ``PAT_CPU_CHUNK_GEMM=torch``
turns the kernel off (for A/B runs: ``cpu_extension.switched_on``): the chunks then go through oneDNN one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
ENV_SWITCH = "PAT_CPU_CHUNK_GEMM"
COLS = 16  # output columns per panel (kCols in the .cpp)


def usable(weight: torch.Tensor, width: int) -> bool:
    """Whether the kernel serves ``weight`` cut in chunks ``width`` wide: a CPU tensor of a supported dtype
    (bfloat16: even widths), the switch on, the library built."""
    even = weight.dtype != torch.bfloat16 or width % 2 == 0
    return even and cpu_extension.serves(weight, DTYPES, ENV_SWITCH)


def panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, K) as the kernel reads it: (P, K, 16) with P = ceil(n / 16), bfloat16 (P, K / 2, 32)."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % COLS))  # (16 P, K)
    if weight.dtype != torch.bfloat16:
        return padded.view(-1, COLS, k).transpose(1, 2).contiguous()
    return padded.view(-1, COLS, k // 2, 2).permute(0, 2, 1, 3).reshape(-1, k // 2, 2 * COLS)


def node(x: torch.Tensor, panels: torch.Tensor, n: int, chunks: int) -> torch.Tensor:
    """(M, n) in float32 (float64 for float64): ``x`` (M, K, the weight's dtype) times the weight, summed over
    ``chunks`` equal chunks of K as the reduction tree sums them; call only where ``usable``."""
    return torch.ops.pat_kernels.chunk_gemm_cpu(x.contiguous(), panels, n, chunks)
