"""SiLU-and-mul in Triton: ``silu(gate) * up`` of the fused gate/up projection, one pass.

Layout: ``gate_up`` (rows, 2 * n), unit stride in the last dim, gate the first n columns and up the
last n (the order of ``MLP.gate_up_proj``); out (rows, n). Float32, bfloat16, float16.

Numerics: torch's ``F.silu(gate) * up`` operation by operation: ``g / (1 + exp(-g))`` in float32
(IEEE division, the precise ``expf``), rounded to the model dtype, then times ``up`` and rounded.
Elementwise: no value depends on another row. Under Triton's interpreter, which has no libdevice,
``exp`` is numpy's. ``silu_mul`` is a jit function the skinny GEMM's prologue calls too
(``pat_kernels/skinny_matmul.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.dependent_launch import pdl_options, pdl_wait
from pat_kernels.triton_support import INTERPRETED, exact_exp, round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024


@triton.jit
def silu_mul(gate, up, LIBDEVICE: tl.constexpr, RTNE: tl.constexpr):
    """``F.silu(gate) * up`` elementwise, each step rounded to gate's dtype (module docstring)."""
    g = gate.to(tl.float32)
    silu = round_to(tl.math.div_rn(g, 1.0 + exact_exp(-g, LIBDEVICE)), gate.dtype, RTNE)
    return round_to(silu.to(tl.float32) * up.to(tl.float32), gate.dtype, RTNE)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n,
                     BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, RTNE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, LIBDEVICE, RTNE), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2n) -> (rows, n): ``silu(gate_up[:, :n]) * gate_up[:, n:]``."""
    rows, two_n = gate_up.shape
    assert two_n % 2 == 0 and gate_up.stride(-1) == 1 and gate_up.dtype in DTYPES
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), n,
            BLOCK=BLOCK, LIBDEVICE=not INTERPRETED, RTNE=INTERPRETED, num_warps=4, enable_fp_fusion=False,
            **pdl_options(gate_up.device),
        )
    return out
