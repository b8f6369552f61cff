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


@needs_triton
@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 1), pytest.param(torch.bfloat16, 3, marks=pytest.mark.slow),
                                        pytest.param(torch.float32, 1, marks=pytest.mark.slow),
                                        pytest.param(torch.float32, 3, marks=pytest.mark.slow)])
def test_the_norm_and_silu_prologues_give_the_bits_of_their_kernels_then_the_gemm(dtype, rows):
    """The prologue computes the layer kernel's values (the interpreter sums the norm's row in one order both
    ways, so bit for bit here): norm of x + residual (and the sum, stored once), norm of x alone, SiLU-mul;
    each with one split, three (a masked K step) and, at one row, the CUDA-core path. N = 40: a masked tile."""
    from pat_kernels import triton_activation, triton_norm

    sk = _kernel()
    x, w, b = gemm_data(rows, 40, 136, dtype, seed=7)
    residual, gate_up, _ = gemm_data(rows, 272, 136, dtype, seed=8)  # gate_up: (272, 136), transposed below
    norm_w = (torch.rand(136, generator=torch.Generator().manual_seed(9)) + 0.5).to(dtype).to(DEV)
    configs = [sk.SkinnyConfig(block_n=16, block_k=64), sk.SkinnyConfig(block_n=16, block_k=64, split_k=3)]
    configs += [sk.SkinnyConfig(block_n=16, block_k=64, split_k=2, dot=False)] if rows == 1 else []
    h, summed = triton_norm.add_rms_norm(x, residual, norm_w, 1e-5)
    gated = triton_activation.silu_and_mul(gate_up.T.contiguous()[:rows])
    for cfg in configs:
        out, got_sum = sk.skinny_norm_matmul(x, residual, norm_w, 1e-5, w, b, cfg)
        assert torch.equal(out, sk.skinny_matmul(h, w, b, cfg)) and torch.equal(got_sum, summed), cfg
        out, alone = sk.skinny_norm_matmul(x, None, norm_w, 1e-5, w, b, cfg)
        assert alone is x and torch.equal(out, sk.skinny_matmul(triton_norm.rms_norm(x, norm_w, 1e-5), w, b, cfg))
        got = sk.skinny_silu_matmul(gate_up.T.contiguous()[:rows], w, b, cfg)
        assert torch.equal(got, sk.skinny_matmul(gated, w, b, cfg)), cfg


@needs_triton
def test_the_prologues_refuse_what_they_cannot_compute():
    sk = _kernel()
    x, w, _ = gemm_data(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="norm weight"):
        sk.skinny_norm_matmul(x, None, torch.ones(32, device=DEV), 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        sk.skinny_norm_matmul(x, x[:1], torch.ones(64, device=DEV), 1e-5, w)
    with pytest.raises(ValueError, match="at most 16384"):
        sk.skinny_norm_matmul(torch.zeros(1, 16400, device=DEV), None, torch.ones(16400, device=DEV), 1e-5,
                              torch.zeros(4, 16400, device=DEV))
    with pytest.raises(ValueError, match="2 x features"):
        sk.skinny_silu_matmul(x[:, :63], w)
    with pytest.raises(ValueError, match="does not match"):
        sk.skinny_silu_matmul(x, w)  # 64 columns: a gate and an up of 32, the weight takes 64


def test_the_tuned_table_serves_its_device_and_shapes_and_the_rule_the_rest(monkeypatch):
    """The committed table is what bench/skinny_tune.py writes from the committed gpu_check results (one
    home: the measurements), its labels parse back, and ``engine_config`` takes a tuned config only at its
    device, shape and rows bucket (1; then the row tile)."""
    import json
    import skinny_tune

    sk = _kernel()
    results = json.loads((skinny_tune.ROOT / "bench" / "results" / "gpu_check.json").read_text())
    device = skinny_tune.device_of(results["gemm"]["machine"])
    table = json.loads(sk.TUNED_FILE.read_text())
    assert table["devices"][device]["configs"] == skinny_tune.tuned_entries(results["gemm"])
    for entry in table["devices"][device]["configs"]:
        assert sk.SkinnyConfig.parse(entry["config"]).label == entry["config"]
    assert sk.SkinnyConfig.parse("16x256/4 fma") == sk.SkinnyConfig(block_n=16, block_k=256, split_k=4, dot=False)
    with pytest.raises(ValueError, match="not a skinny GEMM config"):
        sk.SkinnyConfig.parse("16x256")
    assert [sk.rows_bucket(m) for m in (1, 2, 16, 17, 33, 64)] == [1, 16, 16, 32, 64, 64]

    cpu = torch.device("cpu")
    monkeypatch.setattr(sk, "device_name", lambda d: device)  # this machine stands in for the tuned device
    tuned = sk.tuned_table()[device]
    assert sk.engine_config(6144, 4096, cpu, 1) == tuned[(6144, 4096, 1)] and not tuned[(6144, 4096, 1)].dot
    assert sk.engine_config(6144, 4096, cpu, 5) == tuned[(6144, 4096, 16)]
    assert sk.engine_config(6144, 4096, cpu, 20) == sk.config_for(6144, 4096, sk.sm_count(cpu), 32)  # no 32 entry
    assert sk.engine_config(6000, 4096, cpu, 1) == sk.config_for(6000, 4096, sk.sm_count(cpu), 16)
    monkeypatch.setattr(sk, "device_name", lambda d: "another GPU")
    assert sk.engine_config(6144, 4096, cpu, 1) == sk.config_for(6144, 4096, sk.sm_count(cpu), 16)


def test_layers_compute_a_deferred_input_in_the_prologue_only_for_the_rows_asked(monkeypatch):
    """``PAT_GEMM_PROLOGUE=fused``: up to 8 of the rows the skinny GEMM serves, where the Triton layer kernels
    serve; a deferred norm or SiLU-mul reaches the prologue GEMM for those steps and is computed as before
    for the others, its residual sum handed on either way."""
    from pat_engine.model import gpu_gemm
    from pat_engine.model.layers.gemm_input import GatedInput, NormedInput
    from pat_engine.model.layers.linear import linear
    from pat_engine.model.layers.norm import RMSNorm
    from pat_engine.model.layers.mlp import silu_and_mul

    monkeypatch.delenv("PAT_GEMM_PROLOGUE", raising=False)
    assert gpu_gemm.prologue_rows(64, True) == 0
    monkeypatch.setenv("PAT_GEMM_PROLOGUE", "fused")
    assert gpu_gemm.prologue_rows(64, True) == 8 and gpu_gemm.prologue_rows(4, True) == 4
    assert gpu_gemm.prologue_rows(0, True) == gpu_gemm.prologue_rows(64, False) == 0

    norm = RMSNorm(6, 1e-6, torch.float32, "cpu")
    norm.weight.data.uniform_(0.5, 1.5)
    fused = []

    def norm_matmul(x, r, nw, eps, w, b=None):
        fused.append(("norm", len(x)))
        summed = x if r is None else x + r
        return F.linear(norm(summed), w, b), summed

    monkeypatch.setattr(gpu_gemm, "skinny_norm_matmul", norm_matmul)
    monkeypatch.setattr(gpu_gemm, "skinny_silu_matmul",
                        lambda g, w, b=None: fused.append(("silu", len(g))) or F.linear(silu_and_mul(g), w, b))
    monkeypatch.setattr(gpu_gemm, "skinny_matmul", lambda x, w, b=None: F.linear(x, w, b))
    w = torch.randn(5, 6)
    for rows in (1, 8, 9):
        x, r = torch.randn(rows, 6), torch.randn(rows, 6)
        inp = NormedInput(x, r, norm)
        assert torch.equal(linear(inp, w, skinny_rows=16, prologue_rows=8), F.linear(norm(x + r), w))
        assert torch.equal(inp.summed, x + r)
        first = NormedInput(x, None, norm)  # the first layer: no residual yet
        assert torch.equal(linear(first, w, skinny_rows=16, prologue_rows=8), F.linear(norm(x), w))
        assert torch.equal(first.summed, x)
        gate_up, w_down = torch.randn(rows, 12), torch.randn(5, 6)
        got = linear(GatedInput(gate_up, silu_and_mul), w_down, skinny_rows=4, prologue_rows=8)
        assert torch.equal(got, F.linear(silu_and_mul(gate_up), w_down))
    assert fused == [("norm", 1), ("norm", 1), ("silu", 1), ("norm", 8), ("norm", 8)]


# ---- compiled ---------------------------------------------------------------------------------------------------

SHAPES_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # QKV, o, gate/up, down


@pytest.mark.gpu
@gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_is_cublas_within_rounding_at_the_8b_shapes(dtype):
    """The engine's configs (this device's tuned table, else the rule): one config for 2-16 rows, so a row
    has the same bits in any such batch; one row may take its own (a tuned one-row config)."""
    sk = _kernel()
    for n, k in SHAPES_8B:
        x, w, _ = gemm_data(64, n, k, dtype, seed=n + k)
        big = sk.skinny_matmul(x, w)
        torch.testing.assert_close(big.float(), F.linear(x.float(), w.float()), **gemm_tol(dtype, k))
        assert torch.equal(sk.skinny_matmul(x[:40], w), big[:40])
        full = sk.skinny_matmul(x[:16], w)
        torch.testing.assert_close(full.float(), F.linear(x[:16].float(), w.float()), **gemm_tol(dtype, k))
        assert torch.equal(sk.skinny_matmul(x[:2], w), full[:2])
        assert torch.equal(sk.skinny_matmul(x[:7], w), full[:7])
        cfg16 = sk.engine_config(n, k, x.device, 16)
        assert torch.equal(sk.skinny_matmul(x[:1], w, config=cfg16), full[:1])
        torch.testing.assert_close(sk.skinny_matmul(x[:1], w).float(), full[:1].float(), **gemm_tol(dtype, k))
        one = sk.skinny_matmul(x[:1], w, config=sk.SkinnyConfig(dot=False))
        torch.testing.assert_close(one.float(), full[:1].float(), **gemm_tol(dtype, k))


@pytest.mark.gpu
@gpu
@needs_triton
def test_gpu_prologues_give_their_kernels_values_at_the_8b_shapes():
    """bf16, the engine's configs at 1 and 8 rows: SiLU-mul in the down projection's prologue gives the bits of
    its kernel then the GEMM (the same elementwise roundings; a tl.dot config, whose products no FMA setting
    touches); the norm in QKV's and gate/up's prologue gives the residual sum's bits and the norm's values
    within bf16 rounding (its float32 sum of squares runs in the GEMM kernel's layout, not the norm
    kernel's)."""
    from pat_kernels import triton_activation, triton_norm

    sk = _kernel()
    dtype = torch.bfloat16
    for rows in (1, 8):
        x, residual = (gemm_data(rows, 1, 4096, dtype, seed=rows + s)[0] for s in (0, 100))
        norm_w = torch.rand(4096, device=DEV).to(dtype) + 0.5
        for n in (6144, 28672):
            _, w, _ = gemm_data(1, n, 4096, dtype, seed=n)
            h, summed = triton_norm.add_rms_norm(x, residual, norm_w, 1e-5)
            out, got_sum = sk.skinny_norm_matmul(x, residual, norm_w, 1e-5, w)
            assert torch.equal(got_sum, summed)
            torch.testing.assert_close(out.float(), sk.skinny_matmul(h, w).float(), **gemm_tol(dtype, 4096))
        gate_up, w, _ = gemm_data(rows, 4096, 2 * 14336, dtype, seed=3)
        w = w[:, :14336].contiguous()
        cfg = sk.engine_config(4096, 14336, w.device, rows)
        cfg = cfg if cfg.dot else sk.engine_config(4096, 14336, w.device, 16)
        assert torch.equal(sk.skinny_silu_matmul(gate_up, w, config=cfg),
                           sk.skinny_matmul(triton_activation.silu_and_mul(gate_up), w, config=cfg))
