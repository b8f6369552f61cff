"""The CPU rotary kernel rotates q and k in place with exactly the torch formula's bits, in every dtype."""

from __future__ import annotations

import pytest
import torch

from pat_engine.model.layers.rotary import apply_rotary
from pat_kernels import cpu_extension, cpu_rotary


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv(cpu_rotary.ENV_SWITCH, raising=False)
    if not cpu_extension.load():
        pytest.skip(f"the CPU extension cannot be built: {cpu_extension._failed}")


def formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv(cpu_rotary.ENV_SWITCH, "torch")
        return apply_rotary(x.clone(), cos, sin)


def fused_projection(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q and k as the model sees them: the first heads + kv_heads heads of a (T, (h + 2 kvh) * hd) projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = (4 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g, dtype=torch.float64)).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.randn(tokens, head_dim, generator=g, dtype=torch.float64) * 50
    return qkv, qk, angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 700])  # 700: over the serial threshold, tokens shared out
def test_kernel_gives_the_formulas_bits_in_place(kernel, dtype, tokens, monkeypatch):
    qkv, qk, cos, sin = fused_projection(tokens, 8, 4, 64, dtype)
    v_before = qkv[:, 12 * 64:].clone()
    want = formula(qk, cos, sin, monkeypatch)
    assert cpu_rotary.usable(qk)
    got = apply_rotary(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # rotated where it lies, inside the projection
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # the v heads beside it are untouched


def test_odd_head_dims_and_one_head(kernel, monkeypatch):
    for heads, head_dim in ((1, 2), (3, 24), (5, 128)):
        _, qk, cos, sin = fused_projection(4, heads, 1, head_dim, torch.float64, seed=heads)
        want = formula(qk, cos, sin, monkeypatch)
        assert torch.equal(apply_rotary(qk, cos, sin), want)


def test_layouts_the_kernel_cannot_take_use_the_formula(kernel, monkeypatch):
    """A head that is not head_dim after the previous one (here: every other head) goes the torch way."""
    x = torch.randn(3, 8, 16, dtype=torch.float64)[:, ::2]
    cos, sin = torch.ones(3, 1, 16, dtype=torch.float64), torch.zeros(3, 1, 16, dtype=torch.float64)
    want = formula(x, cos, sin, monkeypatch)
    assert torch.equal(apply_rotary(x, cos, sin), want)
    with pytest.raises(RuntimeError, match="heads head_dim apart"):
        cpu_rotary.rotate_(x, cos.squeeze(1), sin.squeeze(1))
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        cpu_rotary.rotate_(torch.randn(3, 2, 16, dtype=torch.float64), cos.squeeze(1)[:2], sin.squeeze(1)[:2])


def test_off_switch(kernel, monkeypatch):
    monkeypatch.setenv(cpu_rotary.ENV_SWITCH, "torch")
    assert not cpu_rotary.usable(torch.zeros(1, 1, 2))
