"""The decode step's GEMM for a few rows, in Triton: the weight streamed once, by many programs.

At 1-64 rows a decode step's GEMMs are (nearly) matrix-vector products: their time is the weight's bytes
over the memory bandwidth. On the third H100 run (bench/results/gpu_check.md, part 2, batch 1) cuBLAS
streamed the gate/up weight at 2.9 TB/s but the o projection's (4096 x 4096) at 1.6 TB/s, and its
split-K variants (QKV and down) added a reduce kernel each: 0.12 ms of a 6.2 ms step. This kernel
cuts every weight into many row tiles (and, where that gives too few programs to keep every SM
streaming, into K splits), so each program streams one long, contiguous slab.

Layout:
  x      (M, K), M <= MAX_ROWS (64), any strides: the rows (tokens) of the step
  weight (N, K), any strides, x's dtype: the layer's (out, in) weight shard, read in place
  bias   (N,) or None
  out    (M, N), x's dtype, contiguous

Program (n, s) of the grid (cdiv(N, block_n), split_k) multiplies all M rows (padded to ``row_tile(M)``: 16,
the smallest ``tl.dot``, 32 or 64) with ``block_n`` weight rows over its K range, low to high in ``block_k``
steps, into one float32 accumulator (a config with ``dot=False``, for one row only: float32 multiply-adds on
the CUDA cores, each step's products summed along the weight's rows; the sweep times both). One split: it
adds the bias and rounds to the output dtype. Several: it stores float32 partials (split_k, M, N), and a
second kernel sums them in split order, adds the bias and rounds once (cuBLAS's split-K does the same with
its ``splitKreduce``).

Numerics: float32 accumulation; float32 inputs multiply in IEEE float32 (no TF32). An output element
depends on its row of x, its column of the weight, the config and the row tile, never on the other
rows: within one row tile (1-16, 17-32, 33-64 rows) a row has the same bits alone, in a batch or beside a
decode graph's padding rows. Not cuBLAS's bits (another
order): the fast numerics mode's choice, where ``PAT_SKINNY_GEMM`` asks for it (pat_engine/env.py; by
default the bfloat16 LM head on CUDA only, the one weight the fourth H100 run found it ahead of cuBLAS
on: bench/gpucheck/skinny_gemm.py, model/gpu_gemm.py). The config comes from N, K, the SM count and the
row tile alone (``config_for``), so one process computes one layer's batch the same way every step. Tested under
``TRITON_INTERPRET=1`` (tests/test_skinny_matmul.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pat_kernels.triton_support import INTERPRETED, dot_acc, round_to

MAX_ROWS = 64  # the most rows one program holds
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_BLOCK = 256  # output columns per program of the split-K reduce


@dataclass(frozen=True)
class SkinnyConfig:
    """How one (N, K) weight is cut: ``block_n`` rows per program, ``block_k`` per step of its K walk,
    ``split_k`` K ranges (each a multiple of ``block_k``), and the launch's warps and pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    dot: bool = True  # False: one row only, multiply-adds on the CUDA cores over the weight in its own order

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's tile), not {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, not {self.split_k}")

    def k_span(self, k: int) -> int:
        """K columns per split: K over the splits, rounded up to whole ``block_k`` steps."""
        steps = triton.cdiv(k, self.block_k)
        return triton.cdiv(steps, self.split_k) * self.block_k

    def programs(self, n: int) -> int:
        return triton.cdiv(n, self.block_n) * self.split_k


# Not tuned on a GPU yet (none was lent when this was written): two programs per SM at least, so
# every SM keeps two streams in flight, and at least MIN_STEPS K steps per split, so a split's
# software pipeline fills. bench/gpucheck/skinny_gemm.py sweeps the alternatives on the device.
PROGRAMS_PER_SM = 2
MIN_STEPS = 4


def row_tile(m: int) -> int:
    """Rows a ``tl.dot`` program holds for an ``m``-row step: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


@functools.lru_cache(maxsize=256)
def config_for(n: int, k: int, sm_count: int, rows: int = 16) -> SkinnyConfig:
    """The rule: 32-row weight tiles, K steps of 256 (128 for row tiles past 16, whose input tile is larger
    in shared memory); split K in two while the tiles alone give fewer than ``PROGRAMS_PER_SM`` programs an
    SM and each split keeps ``MIN_STEPS`` steps."""
    base = SkinnyConfig(block_k=256 if row_tile(rows) <= 16 else 128)
    split = 1
    steps = triton.cdiv(k, base.block_k)
    while (base.programs(n) * split < PROGRAMS_PER_SM * sm_count and steps // (2 * split) >= MIN_STEPS):
        split *= 2
    return replace(base, split_k=split)


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, k_span,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os, stride_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
    RTNE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_span + tl.arange(0, BLOCK_K)  # this split's K range: [split * k_span, + k_span)
    if DOT:
        x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
        w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_span, BLOCK_K):
            in_k = (k + ks) < K
            a = tl.load(x_tile, mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
            b = tl.load(w_tile, mask=(cols[None, :] < N) & in_k[:, None], other=0.0)
            acc = dot_acc(a, b, acc, IEEE, EMULATE)
            x_tile += BLOCK_K * stride_xk
            w_tile += BLOCK_K * stride_wk
    else:  # one row (M == 1): float32 products summed along each weight row, in the weight's order
        x_row = x_ptr + ks * stride_xk
        w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk  # (BLOCK_N, BLOCK_K)
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, k_span, BLOCK_K):
            in_k = (k + ks) < K
            a = tl.load(x_row, mask=in_k, other=0.0).to(tl.float32)
            b = tl.load(w_tile, mask=(cols[:, None] < N) & in_k[None, :], other=0.0).to(tl.float32)
            acc1 += tl.sum(b * a[None, :], axis=1)
            x_row += BLOCK_K * stride_xk
            w_tile += BLOCK_K * stride_wk
        acc = acc1[None, :]  # (1, BLOCK_N): broadcast over the tile's rows, only row 0 is stored
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :], acc, mask=keep)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = round_to(acc, out_ptr.dtype.element_ty, RTNE)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=keep)


@triton.jit
def _skinny_reduce_kernel(part_ptr, bias_ptr, out_ptr, N, SPLITS, stride_ps, stride_pm, stride_om,
                          HAS_BIAS: tl.constexpr, RTNE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):  # split order: the sum's one order
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, round_to(acc, out_ptr.dtype.element_ty, RTNE), mask=ok)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 for the CPU interpreter (its grid is a loop)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most ``MAX_ROWS`` rows (module docstring).

    Args:
        x: (M, K), M <= MAX_ROWS. weight: (N, K), x's dtype. bias: (N,) or None.
        config: how to cut the weight; None: ``config_for(N, K, the device's SMs)``.
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    if M > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, not {M}")
    if config is not None and not config.dot and M > 1:
        raise ValueError(f"a config without tl.dot multiplies one row, not {M}")
    if x.dtype not in DTYPES:
        raise ValueError(f"skinny_matmul takes {', '.join(map(str, DTYPES))}, not {x.dtype}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match the weight's {N} output features")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = config or config_for(N, K, sm_count(x.device), row_tile(M))
    partial = cfg.split_k > 1
    dest = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device) if partial else out
    flags = dict(IEEE=x.dtype == torch.float32, EMULATE=INTERPRETED, RTNE=INTERPRETED)
    bias_arg = bias if bias is not None else x
    _skinny_matmul_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](
        x, weight, bias_arg, dest,
        M, N, K, cfg.k_span(K),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), dest.stride(0) if partial else 0,
        dest.stride(1) if partial else dest.stride(0),
        HAS_BIAS=bias is not None, PARTIAL=partial, DOT=cfg.dot, BLOCK_M=row_tile(M),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    if partial:
        _skinny_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](
            dest, bias_arg, out, N, cfg.split_k, dest.stride(0), dest.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, RTNE=INTERPRETED, BLOCK=REDUCE_BLOCK,
        )
    return out
