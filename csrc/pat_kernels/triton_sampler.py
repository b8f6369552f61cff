"""The sampler's arithmetic on a GPU, in Triton: each row's weights and its sum Z, with the bits of the
torch twin in pat_engine/sampling/inverse_cdf.py (which has the rule; the CPU's C++ kernel computes it too).

For a row of logits x, an inverse temperature ``it`` and a floor:

- ``weights``: m = max float32(x); z = (float32(x) - m) * it; e = pexp(z) if z >= floor else 0, with
  pexp the fixed polynomial exp (Cephes' expf), every operation rounded on its own as torch's separate
  kernels round them (FMA contraction off). One program per row: a pass for the max (exact in any
  order), a pass that writes e. The torch twin runs some thirty elementwise kernels over (rows, vocab)
  for the same values.
- ``lane_sum``: Z, lane j (0-7) adding e_j, e_{j+8}, e_{j+16}, ... in order, in float64, from 0.0, then
  ((0+1)+(2+3))+((4+5)+(6+7)). Sequential by definition (the CPU kernel's SIMD order, shared by every
  device so a log-prob has the same bits everywhere): each lane is a chain of vocab/8 dependent float64
  adds (16,032 for a 128,256-token vocabulary). The torch twin runs the chain in ATen's
  outer-dimension scan, one thread per lane that loads, adds and stores each element in turn (each add
  may wait for its own load: the store may alias the next load). Here one program per row holds the
  eight lanes and reads ``UNROLL`` groups of eight a step with loads no add waits on, then adds them in
  order: the chain waits for its adds, not for memory. Rows run side by side.

Bits: the twin's operations in the twin's order (0.0 pads a row whose length is not a multiple of eight,
as its ``F.pad`` does; adding 0.0 to a non-negative sum changes nothing). Tested under
``TRITON_INTERPRET=1`` (tests/test_triton_sampler.py). Used on CUDA when ``PAT_TRITON_SAMPLER=on``; not run
on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

UNROLL = 64  # groups of eight read per step of the lane walk: 64 loads in flight before the first add waits
BLOCK = 1024  # logits per step of the weight passes


@triton.jit
def _pexp(z):
    """Cephes' expf for float32 ``z <= 0``, as inverse_cdf.pexp computes it, operation by operation (its
    constants, EXP_MIN = -87.33654 among them, written out: a kernel reads no Python globals)."""
    zc = tl.maximum(z, -87.33654)
    n = tl.floor(zc * 1.44269504088896341 + 0.5)
    r = zc - n * 0.693359375
    r = r - n * -2.12194440e-4
    r2 = r * r
    p = tl.full(z.shape, 1.9875691500e-4, tl.float32)
    p = p * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    y = p * r2 + r + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(z >= -87.33654, y * scale, 0.0)


@triton.jit
def _weights_kernel(x_ptr, it_ptr, floor_ptr, e_ptr, m_ptr, V, stride_x, stride_e, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    xs = x_ptr + row * stride_x
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    nans = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        x = tl.load(xs + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
        nans += (x != x).to(tl.int32)
    m = tl.where(tl.sum(nans, axis=0) > 0, float("nan"), tl.max(top, axis=0))  # torch's max: NaN wins
    it = tl.load(it_ptr + row)
    floor = tl.load(floor_ptr + row)
    for start in range(0, V, BLOCK):
        ok = start + cols < V
        z = (tl.load(xs + start + cols, mask=ok, other=0.0).to(tl.float32) - m) * it
        tl.store(e_ptr + row * stride_e + start + cols, tl.where(z >= floor, _pexp(z), 0.0), mask=ok)
    tl.store(m_ptr + row, m)


@triton.jit
def _lane(acc, lanes, j: tl.constexpr):
    """Lane ``j`` of ``acc`` exactly: a sum of it and seven zeros."""
    return tl.sum(tl.where(lanes == j, acc, 0.0), axis=0)


@triton.jit
def _lane_sum_kernel(e_ptr, out_ptr, V, stride_row, UNROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, 8)
    base = e_ptr + row * stride_row
    acc = tl.zeros((8,), dtype=tl.float64)
    for start in range(0, V, 8 * UNROLL):
        for u in tl.static_range(UNROLL):
            idx = start + u * 8 + lanes
            acc += tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float64)
    left = (_lane(acc, lanes, 0) + _lane(acc, lanes, 1)) + (_lane(acc, lanes, 2) + _lane(acc, lanes, 3))
    right = (_lane(acc, lanes, 4) + _lane(acc, lanes, 5)) + (_lane(acc, lanes, 6) + _lane(acc, lanes, 7))
    tl.store(out_ptr + row, left + right)


def _check_rows(t: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 2 or t.dtype not in dtypes or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{what} takes {', '.join(map(str, dtypes))} (rows, V) with unit stride along V, not "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e float32 (rows, V), m float32 (rows, 1)) of logits ``x`` (any float dtype), ``inv_temp`` and ``floor``
    float32 (rows,)."""
    _check_rows(x, "weights", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    rows, vocab = x.shape
    e = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    m = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and vocab:
        _weights_kernel[(rows,)](x, inv_temp.to(torch.float32).contiguous(), floor.to(torch.float32).contiguous(),
                                 e, m, vocab, x.stride(0), e.stride(0), BLOCK=BLOCK, num_warps=4,
                                 enable_fp_fusion=False)
    return e, m.unsqueeze(1)


def lane_sum(e: torch.Tensor) -> torch.Tensor:
    """Z per row (float64 (rows,)) of float32 weights ``e`` (rows, V) with unit stride along V."""
    _check_rows(e, "lane_sum", (torch.float32,))
    rows, vocab = e.shape
    out = torch.empty(rows, dtype=torch.float64, device=e.device)
    if rows:
        _lane_sum_kernel[(rows,)](e, out, vocab, e.stride(0), UNROLL=UNROLL, num_warps=1)
    return out
