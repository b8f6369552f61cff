"""RMSNorm: the CPU kernels (plain and fused with the residual add) give what the reference
formula (Hugging Face's) gives; float64 keeps the formula itself."""

from __future__ import annotations

import pytest
import torch

from pat_engine.model.layers.norm import RMSNorm
from pat_kernels import cpu_extension, cpu_norm


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def make_norm(width: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(width, 1e-6, dtype, "cpu")
    norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return norm


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.delenv(cpu_norm.ENV_SWITCH, raising=False)
    if not cpu_extension.load():
        pytest.skip(f"the CPU extension cannot be built: {cpu_extension._failed}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_kernel_matches_the_reference_formula(kernels, dtype, tol) -> None:
    g = torch.Generator().manual_seed(1)
    norm = make_norm(96, dtype)
    for rows in (1, 7, 64, 700):  # 700 rows: over the serial threshold, so the rows are shared out
        x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
        residual = torch.randn(rows, 96, generator=g).to(dtype)
        assert cpu_norm.usable(x)
        torch.testing.assert_close(norm(x), reference(x, norm.weight, 1e-6), rtol=tol, atol=tol)
        normed, summed = norm.add_forward(x, residual)
        assert torch.equal(summed, x + residual)  # the residual stream itself is bit-exact
        torch.testing.assert_close(normed, reference(x + residual, norm.weight, 1e-6), rtol=tol, atol=tol)


def test_kernel_reads_strided_rows(kernels) -> None:
    """Rows taken out of a wider tensor (a split of a fused projection) are read in place."""
    norm = make_norm(64, torch.float32)
    wide = torch.randn(9, 200)
    x = wide[:, 10:74]
    assert x.stride(0) == 200
    torch.testing.assert_close(norm(x), reference(x, norm.weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_kernel_rejects_mismatched_shapes(kernels) -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_norm.rms_norm(torch.randn(4, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        cpu_norm.add_rms_norm(torch.randn(4, 8), torch.randn(4, 9), torch.ones(8), 1e-6)


def test_float64_keeps_the_formula_bit_for_bit(kernels) -> None:
    """The exactness suite's dtype: the same operations as transformers, so the same bits."""
    norm = make_norm(48, torch.float64)
    x, residual = torch.randn(5, 48, dtype=torch.float64), torch.randn(5, 48, dtype=torch.float64)
    assert not cpu_norm.usable(x)
    assert torch.equal(norm(x), reference(x, norm.weight, 1e-6))
    normed, summed = norm.add_forward(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, reference(x + residual, norm.weight, 1e-6))


def test_off_switch_uses_the_formula(kernels, monkeypatch) -> None:
    norm = make_norm(96, torch.float32)
    x = torch.randn(3, 96)
    monkeypatch.setenv(cpu_norm.ENV_SWITCH, "torch")
    assert not cpu_norm.usable(x)
    assert torch.equal(norm(x), reference(x, norm.weight, 1e-6))


def test_decoder_uses_the_fused_add(kernels, tmp_path, monkeypatch) -> None:
    """A float32 model's forward goes through the kernels, and its output stays within float32
    rounding of the formula's."""
    from pat_engine.model.arch import load_model_arch
    from pat_engine.model.llama import CausalLM
    from pat_engine.parallel.comm import TPGroup
    from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

    write_tiny_model(tmp_path / "m", TinyModelSpec(arch="llama", num_layers=3))
    arch = load_model_arch(str(tmp_path / "m"))
    model = CausalLM(arch, 1, torch.float32, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    calls = []
    real = cpu_norm.add_rms_norm
    monkeypatch.setattr(cpu_norm, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(5, arch.hidden_size)

    def residual_stream(use_kernel: bool) -> torch.Tensor:
        monkeypatch.setenv(cpu_norm.ENV_SWITCH, "kernel" if use_kernel else "torch")
        h, residual = x, None
        for layer in model.layers:  # the MLP and norms only: attention needs a KV context
            h, residual = (h, h) if residual is None else layer.input_layernorm.add_forward(h, residual)
            h, residual = layer.post_attention_layernorm.add_forward(h, residual)
            h = layer.mlp(h, TPGroup(rank=0, size=1, ranks=(0,)))
        return model.norm.add_forward(h, residual)[0]

    with torch.no_grad():
        fused, formula = residual_stream(True), residual_stream(False)
    assert len(calls) == 2 * len(model.layers)  # every add went through the fused kernel
    torch.testing.assert_close(fused, formula, rtol=1e-5, atol=1e-5)
