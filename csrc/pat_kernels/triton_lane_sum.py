"""The sampler's row sum Z in its eight-lane order, in Triton (pat_engine/sampling/inverse_cdf.py, ``lane_sum``).

Z of a row of weights ``e`` (float32, V of them): lane j (0-7) adds e_j, e_{j+8}, e_{j+16}, ... in order,
in float64, from 0.0; then ((0+1)+(2+3))+((4+5)+(6+7)). The order is the CPU kernel's SIMD order, and it
is sequential by definition: each lane is a chain of V/8 dependent float64 adds (16,032 for a 128,256-token
vocabulary), the same on every device, so a row's Z (and every log-prob) has the same bits everywhere.

On a GPU that chain is the whole cost, and what matters is that nothing else waits inside it. The torch
twin (a ``cumsum`` down dim 1 of a (rows, V/8, 8) view) runs in ATen's outer-dimension scan: one thread
per lane that loads, adds and stores each element in turn, so each add can wait for its own load (the
store may alias the next load). Here one program per row holds the eight lanes and reads ``UNROLL``
groups of eight per step with loads that no add or store depends on, then adds them in order: the
chain waits for its float64 adds, not for memory. One program per row: the rows' chains run side by side.

Bits: the additions of ``lane_sum``'s torch twin, in its order (0.0 pads a row whose length is not a
multiple of eight, as its ``F.pad`` does; adding 0.0 to a non-negative sum changes nothing); tested under
``TRITON_INTERPRET=1`` (tests/test_triton_lane_sum.py). Not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LANES = 8  # pat_engine.sampling.inverse_cdf.LANES
UNROLL = 64  # groups of eight read per step of the walk: 64 loads in flight before the first add waits


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


def lane_sum(e: torch.Tensor) -> torch.Tensor:
    """Z per row (float64 (rows,)) of float32 weights ``e`` (rows, V) with unit stride along V."""
    if e.dim() != 2 or e.dtype != torch.float32 or (e.shape[1] > 1 and e.stride(1) != 1):
        raise ValueError(f"lane_sum takes float32 (rows, V) with unit stride along V, not {e.dtype} "
                         f"{tuple(e.shape)} strides {e.stride()}")
    rows, vocab = e.shape
    out = torch.empty(rows, dtype=torch.float64, device=e.device)
    if rows:
        _lane_sum_kernel[(rows,)](e, out, vocab, e.stride(0), UNROLL=UNROLL, num_warps=1)
    return out
