"""SiLU-and-mul on the CPU: the kernel gives torch's formula's bits (``silu(gate) * up``) in float32 and
bfloat16, a row's bits do not depend on its batch, and float64 keeps the formula."""

from __future__ import annotations

import pytest
import torch

from pat_engine.model.layers import mlp
from pat_engine.model.layers.mlp import silu_and_mul, silu_formula
from pat_kernels import cpu_activation, cpu_extension
from thread_ranks import single_rank

# widths around every block size torch's loop uses (16 and 32 floats, 32 and 64 bfloat16s), and real ones
WIDTHS = (1, 7, 16, 24, 31, 32, 33, 48, 63, 64, 65, 100, 128, 512, 2048, 3000)


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.delenv(cpu_activation.ENV_SWITCH, raising=False)
    if not cpu_extension.load():
        pytest.skip(f"the CPU extension cannot be built: {cpu_extension._failed}")


@pytest.fixture
def one_thread():
    """torch's own loop on one thread runs each row whole: the case the kernel reproduces exactly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gate_up(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    # wide enough a spread that exp over- and underflows in some lanes
    return (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed)) * 6).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gives_the_formulas_bits(kernels, one_thread, dtype) -> None:
    for width in WIDTHS:
        for rows in (1, 3, 17):
            x = gate_up(rows, width, dtype, seed=width * 31 + rows)
            assert cpu_activation.usable(x)
            got = cpu_activation.silu_mul(x)
            assert got.shape == (rows, width) and got.dtype == dtype and got.is_contiguous()
            assert torch.equal(got, silu_formula(x)), (dtype, width, rows)


def test_kernel_handles_extremes_as_the_formula(kernels, one_thread) -> None:
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, float("inf"), float("-inf"),
                             float("nan"), 3.0, -3.0, 0.5, -0.5, 20.0] * 4)
    x = torch.cat([specials, torch.linspace(-5, 5, specials.numel())]).view(1, -1)
    assert torch.equal(cpu_activation.silu_mul(x).isnan(), silu_formula(x).isnan())
    torch.testing.assert_close(cpu_activation.silu_mul(x), silu_formula(x), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch(kernels, dtype) -> None:
    """Each row runs whole on one thread, at any batch and thread count (torch's loop may cut a row between
    two threads at some batch sizes; the kernel never does)."""
    x = gate_up(333, 2048, dtype, seed=5)
    batched = cpu_activation.silu_mul(x)
    for r in (0, 166, 332):
        assert torch.equal(cpu_activation.silu_mul(x[r:r + 1].clone())[0], batched[r])


def test_kernel_reads_strided_rows(kernels, one_thread) -> None:
    wide = gate_up(9, 80, torch.float32)
    x = wide[:, :64]  # rows 160 apart, 32 + 32 columns each
    assert not x.is_contiguous() and cpu_activation.usable(x)
    assert torch.equal(cpu_activation.silu_mul(x), silu_formula(x))


def test_kernel_refuses_what_it_does_not_serve(kernels) -> None:
    with pytest.raises(RuntimeError, match="rows, 2n"):
        cpu_activation.silu_mul(torch.randn(4, 7))
    assert not cpu_activation.usable(torch.randn(8, 4).t())  # columns not adjacent
    assert not cpu_activation.usable(torch.randn(4, 8, dtype=torch.float64))


def test_float64_and_the_off_switch_keep_the_formula(kernels, monkeypatch) -> None:
    calls = []
    real = cpu_activation.silu_mul
    monkeypatch.setattr(cpu_activation, "silu_mul", lambda x: calls.append(x.dtype) or real(x))
    x64 = gate_up(4, 64, torch.float64)
    assert torch.equal(silu_and_mul(x64), silu_formula(x64))  # float64: the formula itself, bit for bit
    x32 = gate_up(4, 64, torch.float32)
    silu_and_mul(x32)
    monkeypatch.setenv(cpu_activation.ENV_SWITCH, "torch")
    silu_and_mul(x32)
    assert calls == [torch.float32]


def test_the_mlp_runs_the_kernel(kernels, monkeypatch) -> None:
    layer = mlp.MLP(64, 96, 1, torch.float32, "cpu")
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1
    x = torch.randn(5, 64)
    calls = []
    real = cpu_activation.silu_mul
    monkeypatch.setattr(cpu_activation, "silu_mul", lambda g: calls.append(g.shape) or real(g))
    fused = layer(x, single_rank())
    monkeypatch.setenv(cpu_activation.ENV_SWITCH, "torch")
    assert torch.equal(layer(x, single_rank()), fused) and calls == [(5, 192)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_cpu_step_runs_the_mlp_in_row_chunks(monkeypatch, dtype) -> None:
    """A fast-mode CPU step whose gate/up output would pass ``cpu_gemm.MLP_CHUNK_BYTES`` runs the MLP in row
    chunks (each output row depends only on its own row): within rounding of one pass, and its residual stream
    (a norm before the MLP) still set; the invariant mode does not chunk."""
    from pat_engine.model import cpu_gemm
    from pat_engine.model.layers.gemm_input import NormedInput
    from pat_engine.model.layers.norm import RMSNorm

    layer = mlp.MLP(64, 96, 1, dtype, "cpu")
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1).to(dtype)
    x = torch.randn(50, 64).to(dtype)
    whole = layer(x, single_rank())
    rows_per_chunk = 16
    monkeypatch.setattr(cpu_gemm, "MLP_CHUNK_BYTES", rows_per_chunk * 192 * x.element_size())
    calls = []
    real = layer.gate_up_proj.forward
    monkeypatch.setattr(layer.gate_up_proj, "forward", lambda h: calls.append(h.shape[0]) or real(h))
    chunked = layer(x, single_rank())
    assert calls == [16, 16, 16, 2]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked, whole, **tol)
    normed = NormedInput(x, torch.ones_like(x), RMSNorm(64, 1e-6, dtype, "cpu"))
    layer(normed, single_rank())
    assert torch.equal(normed.summed, x + 1)
    invariant = mlp.MLP(64, 96, 1, dtype, "cpu", row_chunks=2)
    assert not invariant.chunked
