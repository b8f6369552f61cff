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

Prologues: ``skinny_norm_matmul`` and ``skinny_silu_matmul`` compute the input from the layer's tensors as
they load it, so the RMSNorm (with its residual add) before the QKV and gate/up projections and the
SiLU-mul before the down projection need no kernel of their own: the same jit functions as those kernels
(``triton_norm``, ``triton_activation``), rounding each operation on its own (no FMA). The norm needs its
row's mean square first: every program computes it over the whole row (``_row_inv_rms``), so the input is
read once per program, which pays for a few rows only (the layers ask for at most 8). At one row the
prologue runs on that row alone, not on the tile's 15 padding rows.

Configs: ``engine_config``: the device's tuned config for the shape and rows bucket (``skinny_tuned.json``,
written from a GPU run's sweep by ``bench/skinny_tune.py``), else the rule ``config_for`` (N, K, the SM
count, the row tile). One config per (shape, bucket), so one process multiplies a layer's batch the same way
every step.

Numerics: float32 accumulation; float32 inputs multiply in IEEE float32 (no TF32). An output element
depends on its row of x, its column of the weight and the config, never on the other rows: with one
config, a row has the same bits alone, in a batch or beside a decode graph's padding rows; the engine's
configs are one per rows bucket (1; 2-16; 17-32; 33-64), so within a bucket too. Not cuBLAS's bits
(another order): the fast numerics mode's choice, where ``PAT_SKINNY_GEMM`` asks for it (pat_engine/env.py;
by default the bfloat16 LM head on CUDA only, the one weight the fourth H100 run found it ahead of cuBLAS
on: bench/gpucheck/skinny_gemm.py, model/gpu_gemm.py). The norm prologue's float32 sum of squares runs in
this kernel's layout, so on a device its order may differ from the norm kernel's (each is one fixed order;
the interpreter's is numpy's for both). Tested under ``TRITON_INTERPRET=1`` (tests/test_skinny_matmul.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from pat_kernels.dependent_launch import pdl_options, pdl_wait, prefetch_l2
from pat_kernels.triton_activation import silu_mul
from pat_kernels.triton_norm import inv_rms, residual_add, scaled
from pat_kernels.triton_support import INTERPRETED, dot_acc, round_to

MAX_ROWS = 64  # the most rows one program holds
MAX_NORM_WIDTH = 16384  # the norm prologue holds a whole row in one block
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_BLOCK = 256  # output columns per program of the split-K reduce
PREFETCH_STEPS = 2  # with PDL: K steps of its weight slab a program asks L2 for before the kernel ahead ends


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

    @property
    def label(self) -> str:
        """``R x K / S`` (`` fma`` without tl.dot): how the sweep's tables and the tuned table name it."""
        return f"{self.block_n}x{self.block_k}/{self.split_k}{'' if self.dot else ' fma'}"

    @classmethod
    def parse(cls, label: str) -> SkinnyConfig:
        """The config a ``label`` names (warps and stages the defaults)."""
        found = re.fullmatch(r"(\d+)x(\d+)/(\d+)( fma)?", label.strip())
        if not found:
            raise ValueError(f"not a skinny GEMM config: {label!r} (R x K / S, optionally ' fma')")
        return cls(block_n=int(found[1]), block_k=int(found[2]), split_k=int(found[3]), dot=not found[4])


# The rule for shapes no GPU run has tuned: two programs per SM at least, so
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


# The device's measured best config per (N, K, rows), where a GPU run swept them (bench/skinny_tune.py writes
# it from the gemm part's sweep): at these shapes a config tuned on the device, elsewhere the rule above.
TUNED_FILE = Path(__file__).with_name("skinny_tuned.json")


def rows_bucket(m: int) -> int:
    """The rows a tuned config serves: 1 (the one-row configs without tl.dot are allowed there) or the
    row tile (16, 32, 64)."""
    return 1 if m == 1 else row_tile(m)


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict[str, dict[tuple[int, int, int], SkinnyConfig]]:
    """Per device name, {(N, K, rows bucket): config} from ``TUNED_FILE``."""
    if not TUNED_FILE.exists():
        return {}
    table = {}
    for device, entry in json.loads(TUNED_FILE.read_text())["devices"].items():
        table[device] = {(c["n"], c["k"], rows_bucket(c["rows"])): SkinnyConfig.parse(c["config"])
                         for c in entry["configs"]}
    return table


@functools.lru_cache(maxsize=8)
def device_name(device: torch.device) -> str:
    """The name the tuned table files configs under (``torch.cuda.get_device_name``); "cpu" for the interpreter."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def engine_config(n: int, k: int, device: torch.device, rows: int) -> SkinnyConfig:
    """The config the engine multiplies an (n, k) weight with at ``rows`` rows on ``device``: the device's tuned
    one where its table has the shape, else the rule. One config per (shape, rows bucket), so a step of
    one batch size always takes the same path."""
    tuned = tuned_table().get(device_name(device), {}).get((n, k, rows_bucket(rows)))
    return tuned or config_for(n, k, sm_count(device), row_tile(rows))


@triton.jit
def _row_inv_rms(x_ptr, r_ptr, stride_xm, stride_xk, stride_rm, M, K, eps, inv_n,
                 ADD: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr, RTNE: tl.constexpr):
    """The norm prologue's per-row ``rsqrt(mean + eps)`` over the whole row (x + residual with ``ADD``), row by
    row as the norm kernel computes it (one block of the row, one sum); rows past M 0."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, ROW_BLOCK)
    ok = cols < K
    inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for m in range(0, M):
        x = tl.load(x_ptr + m * stride_xm + cols * stride_xk, mask=ok, other=0.0)
        if ADD:
            x = residual_add(x, tl.load(r_ptr + m * stride_rm + cols, mask=ok, other=0.0), RTNE)
        inv = tl.where(rows == m, inv_rms(x, inv_n, eps), inv)
    return inv


@triton.jit
def _prologue(x_ptr, r_ptr, nw_ptr, sum_ptr, x_offs, r_offs, s_offs, kk, mask, inv, up_offset, sum_mask,
              NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, LIBDEVICE: tl.constexpr,
              RTNE: tl.constexpr):
    """One step's input tile as the layer's kernel before the GEMM would have left it in memory: the norm of
    x (+ residual, whose sum the programs of the first weight tile store: ``sum_mask``), or SiLU-mul of the
    gate half and the up half ``up_offset`` further on."""
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if SILU:
        x = silu_mul(x, tl.load(x_ptr + x_offs + up_offset, mask=mask, other=0.0), LIBDEVICE, RTNE)
    if NORM:
        if ADD:
            x = residual_add(x, tl.load(r_ptr + r_offs, mask=mask, other=0.0), RTNE)
            tl.store(sum_ptr + s_offs, x, mask=sum_mask)
        x = scaled(x, inv, tl.load(nw_ptr + kk, mask=mask, other=0.0), RTNE)
    return x


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, r_ptr, nw_ptr, sum_ptr,
    M, N, K, k_span, eps, inv_n,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os, stride_om, stride_rm, stride_sm,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
    RTNE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PLAIN: tl.constexpr, ONE_ROW: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
    ROW_BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    SECTOR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_span + tl.arange(0, BLOCK_K)  # this split's K range: [split * k_span, + k_span)
    if PDL:  # the first PREFETCH columns of this program's weight slab into L2 while the kernel ahead ends
        pf = split * k_span + tl.arange(0, PREFETCH // SECTOR) * SECTOR  # a pointer per 32-byte sector
        prefetch_l2(w_ptr + cols[:, None].to(tl.int64) * stride_wn + pf[None, :] * stride_wk,
                    (cols[:, None] < N) & (pf[None, :] < K))
    pdl_wait(PDL)  # x, the residual and every output: only after the kernel ahead has finished
    up_offset = K * stride_xk  # SILU: x is (M, 2K), the up half K columns on
    sum_rows = tl.where(pid_n == 0, M, 0)  # ADD: the programs of the first weight tile store x + residual
    inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        inv = _row_inv_rms(x_ptr, r_ptr, stride_xm, stride_xk, stride_rm, M, K, eps, inv_n,
                           ADD, BLOCK_M, ROW_BLOCK, RTNE)
    inv0 = tl.sum(tl.where(rows == 0, inv, 0.0), axis=0)  # ONE_ROW: the row's own
    if DOT:
        x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
        w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_span, BLOCK_K):
            in_k = (k + ks) < K
            in_x = (rows[:, None] < M) & in_k[None, :]
            if PLAIN:
                a = tl.load(x_tile, mask=in_x, other=0.0)
            elif ONE_ROW:  # the prologue on the one row, not on the tile's padding rows
                kk = k + ks
                a1 = _prologue(x_ptr, r_ptr, nw_ptr, sum_ptr, kk * stride_xk, kk, kk, kk, in_k, inv0, up_offset,
                               in_k & (kk * 0 < sum_rows), NORM, ADD, SILU, LIBDEVICE, RTNE)
                a = tl.where(rows[:, None] == 0, a1[None, :], 0.0).to(a1.dtype)
            else:
                kk = (k + ks)[None, :]
                a = _prologue(x_ptr, r_ptr, nw_ptr, sum_ptr, rows[:, None] * stride_xm + kk * stride_xk,
                              rows[:, None] * stride_rm + kk, rows[:, None] * stride_sm + kk, kk, in_x,
                              inv[:, None], up_offset, in_x & (rows[:, None] < sum_rows), NORM, ADD, SILU,
                              LIBDEVICE, RTNE)
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
            if PLAIN:
                a = tl.load(x_row, mask=in_k, other=0.0).to(tl.float32)
            else:
                kk = k + ks
                a = _prologue(x_ptr, r_ptr, nw_ptr, sum_ptr, kk * stride_xk, kk, kk, kk, in_k, inv0, up_offset,
                              in_k & (kk * 0 < sum_rows), NORM, ADD, SILU, LIBDEVICE, RTNE).to(tl.float32)
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
                          HAS_BIAS: tl.constexpr, RTNE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
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


@dataclass(frozen=True)
class Prologue:
    """What the kernel computes from its input before multiplying, in place of a kernel of its own ahead of
    the GEMM. ``norm``: RMSNorm of x (of x + ``residual`` when given; programs of the first weight tile store
    that sum in ``summed``) by ``norm_weight`` and ``eps``, as ``pat_kernels/triton_norm.py`` computes it. ``silu``:
    x is the (M, 2K) gate/up output and the input its SiLU-mul (``pat_kernels/triton_activation.py``)."""

    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    summed: torch.Tensor | None = None
    silu: bool = False


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most ``MAX_ROWS`` rows (module docstring).

    Args:
        x: (M, K), M <= MAX_ROWS. weight: (N, K), x's dtype. bias: (N,) or None.
        config: how to cut the weight; None: ``engine_config`` (the device's tuned table, else the rule).
    """
    return _launch(x, weight, bias, config, x.shape[1], None)


def skinny_norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T (+ bias), x + residual): the norm in the GEMM's prologue, its values
    those of ``triton_norm.add_rms_norm`` (``residual`` None: of ``rms_norm``, and the second value is x). Every
    program computes its rows' norm statistic itself, so the input is read once per program: for a few
    rows (``PROLOGUE_MOST_ROWS``)."""
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match x's {x.shape[-1]} features")
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"the norm prologue holds a row of at most {MAX_NORM_WIDTH} features, not {x.shape[-1]}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype} (or its last dim is strided)")
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    prologue = Prologue(norm_weight=norm_weight, eps=eps, residual=residual, summed=summed)
    return _launch(x, weight, bias, config, x.shape[1], prologue), summed


def skinny_silu_matmul(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None) -> torch.Tensor:
    """``silu_and_mul(gate_up) @ weight.T (+ bias)``: SiLU-mul in the GEMM's prologue, its values those of
    ``triton_activation.silu_and_mul``. gate_up: (M, 2K), the gate the first K columns."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (rows, 2 x features), not {tuple(gate_up.shape)}")
    return _launch(gate_up, weight, bias, config, gate_up.shape[1] // 2, Prologue(silu=True))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig | None,
            K: int, prologue: Prologue | None) -> torch.Tensor:
    M = x.shape[0]
    N = weight.shape[0]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != K or weight.dtype != x.dtype:
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
    cfg = config or engine_config(N, K, x.device, M)
    partial = cfg.split_k > 1
    dest = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device) if partial else out
    flags = dict(IEEE=x.dtype == torch.float32, EMULATE=INTERPRETED, RTNE=INTERPRETED)
    bias_arg = bias if bias is not None else x
    p = prologue or Prologue()
    norm = p.norm_weight is not None
    residual = p.residual if p.residual is not None else x
    summed = p.summed if p.summed is not None else x
    pdl = pdl_options(x.device)
    sector = max(1, 32 // weight.element_size())
    _skinny_matmul_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](
        x, weight, bias_arg, dest, residual, p.norm_weight if norm else x, summed,
        M, N, K, cfg.k_span(K), p.eps, float(np.float32(1.0) / np.float32(K)),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), dest.stride(0) if partial else 0,
        dest.stride(1) if partial else dest.stride(0), residual.stride(0), summed.stride(0),
        HAS_BIAS=bias is not None, PARTIAL=partial, DOT=cfg.dot, BLOCK_M=row_tile(M),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PLAIN=prologue is None, ONE_ROW=prologue is not None and M == 1,
        NORM=norm, ADD=p.residual is not None, SILU=p.silu, ROW_BLOCK=triton.next_power_of_2(K) if norm else 16,
        LIBDEVICE=not INTERPRETED, PREFETCH=max(PREFETCH_STEPS * cfg.block_k, sector), SECTOR=sector,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # a prologue rounds each operation on its own, as the layer kernels it replaces do (no FMA)
        enable_fp_fusion=prologue is None, **flags, **pdl,
    )
    if partial:
        _skinny_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](
            dest, bias_arg, out, N, cfg.split_k, dest.stride(0), dest.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, RTNE=INTERPRETED, BLOCK=REDUCE_BLOCK, **pdl,
        )
    return out
