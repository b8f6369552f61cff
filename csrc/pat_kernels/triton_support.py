"""What the Triton kernels of this package need to know about how they run.

``INTERPRETED``: Triton's CPU interpreter (``TRITON_INTERPRET=1``, read when Triton decorates the
kernels, so it is read here once, at import). The interpreter runs each program in numpy, which
lacks some device paths: ``tl.dot`` on 16-bit floats gives garbage and on float32 rounds by the host's
BLAS (``dot_acc`` spells the product out),
``libdevice`` functions do not exist (numpy's own serve) and float32 -> bfloat16 casts truncate
instead of rounding to nearest even (``round_to`` rounds on the bits). Kernels take such choices
as compile-time flags set from this value, so the device build is never affected.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def exact_exp(x, LIBDEVICE: tl.constexpr):
    """``expf`` as CUDA's libm computes it (what torch's elementwise kernels call), not ``tl.exp``'s
    faster ``ex2.approx``; numpy's ``exp`` under the interpreter (``LIBDEVICE`` False)."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` to nearest, ties to even, as the device (and torch) rounds.
    The interpreter truncates float32 -> bfloat16; with ``EMULATE_RTNE`` the rounding is done on the
    bits first (finite values), so tests on the CPU see the device's bits."""
    if EMULATE_RTNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` through ``tl.dot``: float32 inputs in IEEE float32 (``IEEE``, no TF32).

    Under the interpreter (``EMULATE``) the product is spelled out as float32 products summed along K
    instead: the interpreter's ``tl.dot`` is numpy's matmul, whose BLAS rounds a row differently by its
    place in the tile on some CPUs (OpenBLAS's AVX2 kernels: a row's bits followed its neighbours, so the
    row-independence tests failed on such hosts), and whose 16-bit dot is wrong. A device build never
    takes this path."""
    if EMULATE:
        a, b = a.to(tl.float32), b.to(tl.float32)
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
