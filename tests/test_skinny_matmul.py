"""The fast mode's few-row GEMM (``pat_kernels/skinny_matmul.py``), run by Triton's CPU interpreter.

Its values equal torch's GEMM within float32 accumulation; a row's bits do not depend on the other rows
(how many, which, padding rows of any content); a split-K result is its splits' float32 partials summed
in split order, then the bias, then one rounding; the config rule gives every SM programs to run. The
layers route only steps of at most the rows ``PAT_SKINNY_GEMM`` asks for (``on``: 16; by default the
bfloat16 LM head on CUDA, 64) through it, and never in the invariant numerics mode. The ``gpu`` tests repeat the kernel compiled at the 8B shapes, beside cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_markers import DEV, gemm_data, gemm_tol, gpu, needs_triton

DTYPES = [torch.float32, torch.bfloat16]


def _kernel():
    from pat_kernels import skinny_matmul

    return skinny_matmul


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_values_are_torchs_and_a_row_has_the_same_bits_whatever_the_rows_around_it(dtype, split):
    """Within a row tile (1-16 rows, 17-32, 33-64); the interpreter's dot makes the tiles agree too, a
    device need not."""
    sk = _kernel()
    cfg = sk.SkinnyConfig(block_n=16, block_k=64, split_k=split)
    x, w, b = gemm_data(64, 70, 200, dtype)  # N = 70: a masked row tile; K = 200: a masked K step in the last split
    big = sk.skinny_matmul(x, w, b, cfg)
    torch.testing.assert_close(big.float(), F.linear(x.float(), w.float(), b.float()), **gemm_tol(dtype))
    assert torch.equal(sk.skinny_matmul(x[:40], w, b, cfg), big[:40])
    x = x[:16]
    full = sk.skinny_matmul(x, w, b, cfg)
    assert full.dtype == dtype and full.shape == (16, 70)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()), **gemm_tol(dtype))
    for m in (1, 2, 5, 15):
        assert torch.equal(sk.skinny_matmul(x[:m], w, b, cfg), full[:m]), m
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1)).to(DEV)
    assert torch.equal(sk.skinny_matmul(x[perm], w, b, cfg), full[perm])
    padded = torch.cat([x[:3], torch.full((5, 200), 7.0, dtype=dtype, device=DEV)])  # graph padding rows
    assert torch.equal(sk.skinny_matmul(padded, w, b, cfg)[:3], full[:3])
    strided = torch.zeros(16, 400, dtype=dtype, device=DEV)[:, ::2]  # a view with a column stride of 2
    strided.copy_(x)
    assert torch.equal(sk.skinny_matmul(strided, w, b, cfg), full)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_row_on_the_cuda_cores_is_torchs_within_rounding(dtype):
    """``dot=False`` (a config the sweep times at one row): the same values, its own order; refused for two rows."""
    sk = _kernel()
    x, w, b = gemm_data(2, 70, 200, dtype, seed=5)
    for split in (1, 3):
        got = sk.skinny_matmul(x[:1], w, b, sk.SkinnyConfig(block_n=16, block_k=64, split_k=split, dot=False))
        torch.testing.assert_close(got.float(), F.linear(x[:1].float(), w.float(), b.float()), **gemm_tol(dtype))
    with pytest.raises(ValueError, match="one row"):
        sk.skinny_matmul(x, w, b, sk.SkinnyConfig(dot=False))


@needs_triton
def test_split_k_sums_the_float32_partials_in_split_order_then_the_bias():
    """float32: each split alone (no bias, one split) is its partial exactly; the split-K result is their
    left-to-right float32 sum plus the bias, bit for bit."""
    sk = _kernel()
    x, w, b = gemm_data(4, 40, 384, torch.float32, seed=3)  # three splits of two 64-column steps each
    parts = [sk.skinny_matmul(x[:, i * 128:(i + 1) * 128], w[:, i * 128:(i + 1) * 128], None,
                              sk.SkinnyConfig(block_n=16, block_k=64)) for i in range(3)]
    got = sk.skinny_matmul(x, w, b, sk.SkinnyConfig(block_n=16, block_k=64, split_k=3))
    assert torch.equal(got, ((parts[0] + parts[1]) + parts[2]) + b)
    assert not torch.equal(got, (parts[0] + (parts[1] + parts[2])) + b)  # the order is visible in these bits


def test_the_rule_gives_every_sm_two_programs_where_k_allows():
    sk = _kernel()
    sms = 132  # an H100's
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (1024, 512)):
        cfg = sk.config_for(n, k, sms)
        steps_per_split = -(-k // cfg.block_k) // cfg.split_k
        assert cfg.programs(n) >= sk.PROGRAMS_PER_SM * sms or steps_per_split < 2 * sk.MIN_STEPS, (n, k, cfg)
        assert steps_per_split >= sk.MIN_STEPS or cfg.split_k == 1, (n, k, cfg)
    assert sk.config_for(4096, 4096, sms).split_k == 4  # o projection: 128 row tiles alone
    assert sk.config_for(28672, 4096, sms).split_k == 1  # gate/up: 896 row tiles
    assert sk.config_for(1024, 512, sms).split_k == 1  # two K steps: nothing to split
    assert sk.config_for(4096, 4096, sms, 64).block_k == 128  # a 64-row input tile: smaller K steps
    from pat_engine import env

    from pat_engine.model import gpu_gemm

    assert env.SKINNY_MOST_ROWS == sk.MAX_ROWS  # the switch's limit is the kernel's
    assert set(gpu_gemm.SKINNY_DTYPES) == set(sk.DTYPES)  # and the layers offer it the kernel's dtypes
    assert [sk.row_tile(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    for bad in (dict(block_n=24), dict(block_k=8), dict(split_k=0)):
        with pytest.raises(ValueError):
            sk.SkinnyConfig(**bad)


@needs_triton
def test_bad_arguments_are_refused():
    sk = _kernel()
    x, w, b = gemm_data(65, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        sk.skinny_matmul(x, w)
    with pytest.raises(ValueError, match="does not match"):
        sk.skinny_matmul(x[:2], w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not match"):
        sk.skinny_matmul(x[:2, :32], w)
    with pytest.raises(ValueError, match="float64"):
        sk.skinny_matmul(x[:2].double(), w.double())
    with pytest.raises(ValueError, match="bias"):
        sk.skinny_matmul(x[:2], w, b[:8])
    assert sk.skinny_matmul(x[:0], w).shape == (0, 32)


def test_layers_take_it_for_the_rows_asked_and_never_in_the_invariant_mode(monkeypatch):
    from pat_engine.model import gpu_gemm
    from pat_engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear, linear
    from pat_engine.parallel.shard_spec import Component

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PAT_SKINNY_GEMM", raising=False)
    # auto: the bfloat16 LM head on CUDA, where the fourth H100 run measured it ahead; nothing else
    assert gpu_gemm.skinny_rows("cuda", torch.bfloat16, lm_head=True) == 64
    for device, dtype in (("cuda", torch.float32), ("cuda", torch.float16), ("cpu", torch.bfloat16)):
        assert gpu_gemm.skinny_rows(device, dtype, lm_head=True) == 0, (device, dtype)
    assert gpu_gemm.skinny_rows("cpu", torch.float32) == gpu_gemm.skinny_rows("cuda", torch.bfloat16) == 0
    for value, rows, head_rows in (("on", 16, 16), ("64", 64, 64), ("500", 64, 64), ("4", 4, 4), ("0", 0, 0),
                                   ("off", 0, 0), ("auto", 0, 64), ("yes", 0, 64)):
        monkeypatch.setenv("PAT_SKINNY_GEMM", value)
        assert gpu_gemm.skinny_rows("cuda", torch.bfloat16) == rows, value
        assert gpu_gemm.skinny_rows("cuda", torch.bfloat16, lm_head=True) == head_rows, value
    monkeypatch.setenv("PAT_SKINNY_GEMM", "on")
    assert gpu_gemm.skinny_rows("cpu", torch.float32) == 16 and gpu_gemm.skinny_rows("cpu", torch.float64) == 0
    comps = (Component(32),)
    assert ColumnParallelLinear(64, comps, False, 1, torch.float32, "cpu").skinny_rows == 16
    assert ColumnParallelLinear(64, comps, False, 1, torch.float32, "cpu", invariant=True).skinny_rows == 0
    assert RowParallelLinear(64, 32, 1, 1, torch.float32, "cpu").skinny_rows == 16
    assert RowParallelLinear(64, 32, 1, 1, torch.float32, "cpu", chunks=2).skinny_rows == 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gpu_gemm.skinny_rows("cpu", torch.float32) == 0  # a CPU tensor enters a kernel only interpreted

    from pat_engine.model.layers.embedding import ParallelLMHead

    asked = []  # the LM head asks as the LM head (auto's one layer), the others as layers
    monkeypatch.setattr(gpu_gemm, "skinny_rows", lambda d, t, lm_head=False: asked.append(lm_head) or 0)
    ParallelLMHead(64, 32, 1, torch.float32, "cpu")
    ColumnParallelLinear(64, comps, False, 1, torch.float32, "cpu")
    assert asked == [True, False]

    calls = []
    monkeypatch.setattr(gpu_gemm, "skinny_matmul", lambda x, w, b=None: calls.append(len(x)) or F.linear(x, w, b))
    w = torch.randn(8, 4)
    for rows in (1, 16, 17):
        linear(torch.randn(rows, 4), w, skinny_rows=16)
    linear(torch.randn(3, 4), w)
    linear(torch.randn(40, 4), w, skinny_rows=64)
    assert calls == [1, 16, 40]


# ---- compiled ---------------------------------------------------------------------------------------------------

SHAPES_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # QKV, o, gate/up, down


@pytest.mark.gpu
@gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_is_cublas_within_rounding_at_the_8b_shapes(dtype):
    sk = _kernel()
    for n, k in SHAPES_8B:
        x, w, _ = gemm_data(64, n, k, dtype, seed=n + k)
        big = sk.skinny_matmul(x, w)
        torch.testing.assert_close(big.float(), F.linear(x.float(), w.float()), **gemm_tol(dtype, k))
        assert torch.equal(sk.skinny_matmul(x[:40], w), big[:40])
        full = sk.skinny_matmul(x[:16], w)
        torch.testing.assert_close(full.float(), F.linear(x[:16].float(), w.float()), **gemm_tol(dtype, k))
        assert torch.equal(sk.skinny_matmul(x[:1], w), full[:1])
        assert torch.equal(sk.skinny_matmul(x[:7], w), full[:7])
        one = sk.skinny_matmul(x[:1], w, config=sk.SkinnyConfig(dot=False))
        torch.testing.assert_close(one.float(), full[:1].float(), **gemm_tol(dtype, k))
