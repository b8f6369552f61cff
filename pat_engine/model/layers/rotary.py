"""Rotary position embedding (default and llama3-scaled).

cos/sin are computed in float32 from ``positions * inv_freq`` exactly as the
reference does, then cast to the model dtype.
"""

from __future__ import annotations

import math

import torch

from pat_engine.model.arch import RopeSpec

try:  # the kernels package ships with the engine; its absence only costs speed
    from pat_kernels import cpu_rotary
except ImportError:  # pragma: no cover
    cpu_rotary = None


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv
    # llama3: stretch low frequencies by `factor`, keep high ones, blend in between.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin rows for every position up to the model's context, built once at load.

    Each row is computed in float32 exactly as the reference does, then cast, so looking rows up
    changes no bit; a step only gathers (no host sync on the positions, no per-step math).
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_position: int, dtype: torch.dtype, device):
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        freqs = torch.arange(max_position, device=device)[:, None].float() * inv_freq  # (L, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, hd)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, hd) cos and sin for the given positions."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd), cos/sin: (T, 1, hd); rotate-half convention. On the CPU the kernel
    rotates ``x`` in place (the same bits as the formula below); use the returned tensor."""
    if cpu_rotary is not None and x.dim() == 3 and x.stride(1) == x.shape[-1] and x.stride(2) == 1 and cpu_rotary.usable(x):
        return cpu_rotary.rotate_(x, cos.squeeze(1), sin.squeeze(1))
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
