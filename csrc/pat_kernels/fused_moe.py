"""The routed experts of a fast-mode MoE layer in Triton, routed on the device: no host sync, so a CUDA
graph captures the layer.

Through torch each step reads which experts got tokens on the host (one sync a layer) and runs five
kernels an expert: a Qwen3-30B-A3B-shaped decode step of 48 layers and 128 experts is thousands of
launches, and no graph can capture it. Here a layer is the router, the routing (softmax, top-k, the
renormalisation: ``model/layers/moe.py``'s ``route``), a few torch ops that group the (token, expert)
rows by expert (``align``) and three kernels:

1. ``_gate_up_kernel``: program (block, column tile): one block's ``BLOCK_M`` rows, all of one expert,
   times that expert's gate and up rows of the tile (two float32 accumulators), each rounded to the model
   dtype, then ``silu(gate) * up`` as ``triton_activation.silu_mul`` rounds it, stored at the rows' padded
   positions;
2. ``_down_kernel``: program (block, column tile): those activations times the expert's down weight,
   rounded, times the row's routing weight (in the model dtype, as transformers weighs), rounded, stored
   at the row's own place ``token * k + j``;
3. ``_combine_kernel``: program (token, column tile): the token's ``k`` weighted outputs added in its
   experts' ascending order, each sum rounded to the model dtype: transformers' ``index_add_`` into zeros,
   expert by expert.

Layout:
  x            (T, H), unit stride along H; float32, bfloat16 or float16
  weights      (T, k) in x's dtype, experts (T, k) int64: each token's experts, ascending (``route``)
  gate_up_ptrs (E,) int64 on x's device: each expert's (2I, H) gate/up weight (gate rows, then up rows),
               contiguous, x's dtype; down_ptrs (E,): each expert's (H, I) down weight (``SparseMoE`` keeps
               them: ``refresh_tables``); an expert's weight is read with int32 offsets (2I x H < 2^31)
  out          (T, H) in x's dtype: this rank's share of the layer's output, before the TP group's sum

Every size is fixed by T, k and E alone (the padded rows ``align`` makes room for, the grid), so a graph
captured at a batch size replays any routing; a block beyond the step's last real one returns at once.

Tiles: ``block_m`` picks the rows per block from the step's average rows per expert (16 for decode, more
for prefill, where each block rereads its expert's weight); ``block_n`` the columns per program, narrower
where a decode step's few blocks would leave SMs without a program.

Numerics: the fast mode's; float32 accumulators, float32 inputs multiplied in IEEE float32 (no TF32). A
row's output depends on its token, its expert and the tiles, not on the other rows (its block's other rows
enter other lanes of the same ``tl.dot``): with the same tiles a token has the same bits alone or in any
batch. The tiles follow the step's size, and a device may multiply other tiles in another instruction
order, so across step sizes a token may round otherwise, as cuBLAS's kernels follow a GEMM's row count;
nor are these cuBLAS's bits (another order): a token may round differently than through the torch path.
Tested under ``TRITON_INTERPRET=1`` (tests/test_fused_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.skinny_matmul import sm_count
from pat_kernels.triton_activation import silu_mul
from pat_kernels.triton_support import INTERPRETED, dot_acc, round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 64  # the widest; narrower for a few blocks (block_n)
BLOCK_K = 64
PROGRAMS_PER_SM = 2  # block_n narrows a step's tiles until each streaming multiprocessor has this many
COMBINE_BLOCK = 256


def block_m(rows: int, num_experts: int) -> int:
    """Rows per block: 16 (``tl.dot``'s least) while experts average a few rows (decode), more for prefill,
    where each block rereads its expert's weight."""
    average = rows / max(num_experts, 1)
    return 16 if average <= 16 else 32 if average <= 64 else 64


def block_n(rows: int, num_experts: int, width: int, min_programs: int) -> int:
    """Output columns per program: 64, halved (down to 16, ``tl.dot``'s least) while the blocks that can hold
    rows (one an expert with rows, at most) times the column tiles of ``width`` give fewer than
    ``min_programs``: a decode step of one token has 8 blocks (Qwen3-30B-A3B) and 12 tiles of 64, and an
    H100 132 SMs. (The interpreter's grid is a loop: ``sm_count`` says 4, so it keeps wide tiles.)"""
    bn, blocks = BLOCK_N, min(num_experts, rows)
    while bn > 16 and blocks * triton.cdiv(width, bn) < min_programs:
        bn //= 2
    return bn


def padded_rows(rows: int, num_experts: int, bm: int) -> int:
    """Room for ``rows`` (token, expert) rows grouped by expert, each expert's group padded to whole blocks:
    at most ``min(E, rows)`` experts have rows, each wasting at most ``bm - 1``."""
    return triton.cdiv(rows + min(num_experts, rows) * (bm - 1), bm) * bm


def align(experts: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_rows, block_expert)``: the flat rows ``t * k + j`` grouped by expert (stable, so a token's
    rows keep their order), each expert's group starting on a block boundary, gaps holding ``T * k``; and
    each block's expert, -1 for blocks past the last group. Torch ops on the device whose sizes follow from
    the shapes alone: nothing is read on the host (the tests run it on the meta device)."""
    flat = experts.reshape(-1)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm  # each expert's group, in whole blocks
    block_ends = padded.cumsum(0)
    group_starts = block_ends - padded
    order = flat.argsort(stable=True)  # rows by expert
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first place in ``order``
    places = group_starts[by_expert] + torch.arange(n, device=device) - first[by_expert]
    total = padded_rows(n, num_experts, bm)
    sorted_rows = torch.full((total,), n, dtype=torch.int32, device=device)
    sorted_rows.index_put_((places,), order.to(torch.int32))
    starts = torch.arange(0, total, bm, device=device)
    owner = torch.searchsorted(block_ends, starts, right=True)  # the first group ending past the block
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_rows, block_expert


@triton.jit
def _block(block_expert_ptr, sorted_ptr, table_ptr, N_ROWS, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: past the last group), its padded slots, the rows there (``N_ROWS``:
    padding), which of them are real, and the expert's weight."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(sorted_ptr + slots)
    w_ptr = tl.load(table_ptr + tl.maximum(expert, 0)).to(tl.pointer_type(DTYPE))
    return expert, slots, row, row < N_ROWS, w_ptr


@triton.jit
def _gate_up_kernel(x_ptr, table_ptr, sorted_ptr, block_expert_ptr, act_ptr, H, I, N_ROWS, stride_x, stride_a,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, EMULATE: tl.constexpr, RTNE: tl.constexpr, LIBDEVICE: tl.constexpr):
    expert, slots, row, real, w_ptr = _block(block_expert_ptr, sorted_ptr, table_ptr, N_ROWS, x_ptr.dtype.element_ty,
                                             BLOCK_M)
    if expert < 0:
        return
    token = (row // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_cols = cols < I
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        kk = k + ks
        a = tl.load(x_ptr + token[:, None] * stride_x + kk[None, :], mask=real[:, None] & (kk[None, :] < H),
                    other=0.0)
        w_mask = in_cols[None, :] & (kk[:, None] < H)
        gate = tl.load(w_ptr + cols[None, :] * H + kk[:, None], mask=w_mask, other=0.0)  # one expert: int32 offsets
        up = tl.load(w_ptr + (I + cols[None, :]) * H + kk[:, None], mask=w_mask, other=0.0)
        acc_gate = dot_acc(a, gate, acc_gate, IEEE, EMULATE)
        acc_up = dot_acc(a, up, acc_up, IEEE, EMULATE)
    dtype = x_ptr.dtype.element_ty
    act = silu_mul(round_to(acc_gate, dtype, RTNE), round_to(acc_up, dtype, RTNE), LIBDEVICE, RTNE)
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_a + cols[None, :], act,
             mask=real[:, None] & in_cols[None, :])


@triton.jit
def _down_kernel(act_ptr, table_ptr, sorted_ptr, block_expert_ptr, weight_ptr, out_ptr, H, I, N_ROWS, stride_a,
                 stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, EMULATE: tl.constexpr, RTNE: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    expert, slots, row, real, w_ptr = _block(block_expert_ptr, sorted_ptr, table_ptr, N_ROWS, dtype, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_cols = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        kk = k + ks
        a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_a + kk[None, :],
                    mask=real[:, None] & (kk[None, :] < I), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * I + kk[:, None], mask=in_cols[None, :] & (kk[:, None] < I), other=0.0)
        acc = dot_acc(a, w, acc, IEEE, EMULATE)
    routing = tl.load(weight_ptr + row, mask=real, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, dtype, RTNE).to(tl.float32) * routing[:, None], dtype, RTNE)
    tl.store(out_ptr + row[:, None].to(tl.int64) * stride_o + cols[None, :], y, mask=real[:, None] & in_cols[None, :])


@triton.jit
def _combine_kernel(rows_ptr, out_ptr, H, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    RTNE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK,), dtype=dtype)
    for j in range(0, TOP_K):  # ascending experts, from zeros: transformers' index_add_
        share = tl.load(rows_ptr + (token * TOP_K + j) * stride_r + cols, mask=ok, other=0.0)
        total = round_to(total.to(tl.float32) + share.to(tl.float32), dtype, RTNE)
    tl.store(out_ptr + token * stride_o + cols, total, mask=ok)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up_ptrs: torch.Tensor,
                   down_ptrs: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``(T, H)``: each token's experts' MLPs of it, weighed and added (module docstring); ``intermediate``:
    this rank's share ``I`` of an expert's width."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be (T, H) with unit stride along H in one of {DTYPES}, not {tuple(x.shape)} "
                         f"{x.dtype}")
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts = gate_up_ptrs.numel()
    if experts.shape != (tokens, top_k) or weights.shape != experts.shape or down_ptrs.numel() != num_experts:
        raise ValueError(f"experts {tuple(experts.shape)} and weights {tuple(weights.shape)} must be (T, k) for "
                         f"x's {tokens} tokens, with one down pointer per gate/up pointer")
    if 2 * intermediate * hidden >= 2**31:
        raise ValueError(f"an expert's ({2 * intermediate}, {hidden}) gate/up weight is past the kernels' int32 offsets")
    out = torch.empty_like(x)
    if tokens == 0 or hidden == 0:
        return out
    n = tokens * top_k
    bm = block_m(n, num_experts)
    sorted_rows, block_expert = align(experts, num_experts, bm)
    act = torch.empty((sorted_rows.numel(), intermediate), dtype=x.dtype, device=x.device)
    shares = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    flags = dict(IEEE=x.dtype == torch.float32, EMULATE=INTERPRETED, RTNE=INTERPRETED)
    blocks = block_expert.numel()
    min_programs = PROGRAMS_PER_SM * sm_count(x.device)
    if intermediate:
        bn = block_n(n, num_experts, intermediate, min_programs)
        _gate_up_kernel[(blocks, triton.cdiv(intermediate, bn))](
            x, gate_up_ptrs, sorted_rows, block_expert, act, hidden, intermediate, n, x.stride(0), act.stride(0),
            TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, LIBDEVICE=not INTERPRETED,
            enable_fp_fusion=False, **flags)
    bn = block_n(n, num_experts, hidden, min_programs)
    _down_kernel[(blocks, triton.cdiv(hidden, bn))](
        act, down_ptrs, sorted_rows, block_expert, weights.reshape(-1).contiguous(), shares, hidden, intermediate, n,
        act.stride(0), shares.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, enable_fp_fusion=False,
        **flags)
    _combine_kernel[(tokens, triton.cdiv(hidden, COMBINE_BLOCK))](
        shares, out, hidden, shares.stride(0), out.stride(0), TOP_K=top_k, BLOCK=COMBINE_BLOCK, RTNE=INTERPRETED,
        enable_fp_fusion=False)
    return out
