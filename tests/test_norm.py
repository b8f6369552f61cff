"""RMSNorm: the float32 fused path gives what the reference formula (Hugging Face's) gives."""

import torch

from pat_engine.model.layers.norm import RMSNorm


def test_float32_fused_rms_norm_matches_the_reference_formula() -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6, torch.float32, "cpu")
    norm.weight.data = torch.randn(96, generator=g)
    for rows in (1, 7, 64):
        x = 3 * torch.randn(rows, 96, generator=g)
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(norm(x), want, rtol=2e-6, atol=1e-6)
