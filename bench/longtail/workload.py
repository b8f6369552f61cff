"""Rollout batches with long-tail response lengths.

Lengths are lognormal, fitted to the two published tail points of
LLaMA3.1-8B on DeepScaleR (PAT paper Sec. 2.3, Fig. 3b): P(L > 8192) = 10.85%
and P(L > 16384) = 2.18%. Two quantiles fix the two parameters:

    sigma = ln 2 / (z(0.0218) - z(0.1085)) = 0.885,  mu = ln 8192 - z(0.1085) * sigma = 7.919

(z = standard normal upper quantile): median 2748 tokens, mean 4064 before
the cap. Samples of one prompt share part of their log-length (correlation
``prompt_corr``, default 0.5: harder prompts think longer), which keeps the
marginal fit. Lengths are cut at the cap (``max_new_tokens``): at a 16K cap
2.18% of responses hit it (2.8 per 128), at 24K 0.66%. ``scale`` shrinks the
whole distribution for small models (scale = cap / 16384 keeps the 16K shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm


@dataclass(frozen=True)
class LongTail:
    mu: float
    sigma: float
    prompt_corr: float = 0.5
    scale: float = 1.0

    @classmethod
    def fit(cls, p_over_8k: float = 0.1085, p_over_16k: float = 0.0218, prompt_corr: float = 0.5,
            scale: float = 1.0) -> "LongTail":
        z1, z2 = norm.isf(p_over_8k), norm.isf(p_over_16k)
        sigma = math.log(2) / (z2 - z1)
        return cls(math.log(8192) - z1 * sigma, sigma, prompt_corr, scale)

    def sample(self, rng: np.random.Generator, prompts: int, per_prompt: int, cap: int) -> np.ndarray:
        """(prompts * per_prompt,) response lengths in [1, cap], samples of a prompt adjacent."""
        zp = np.repeat(rng.standard_normal(prompts), per_prompt)
        zs = rng.standard_normal(prompts * per_prompt)
        z = math.sqrt(self.prompt_corr) * zp + math.sqrt(1 - self.prompt_corr) * zs
        lengths = np.exp(self.mu + self.sigma * z) * self.scale
        return np.clip(np.round(lengths), 1, cap).astype(np.int64)

    def describe(self) -> str:
        return (f"lognormal mu={self.mu:.3f} sigma={self.sigma:.3f} (P>8K=10.85%, P>16K=2.18%), "
                f"prompt correlation {self.prompt_corr}, scale {self.scale:g}")


@dataclass(frozen=True)
class Batch:
    prompt_lens: np.ndarray  # (n,)
    lengths: np.ndarray  # (n,) true response lengths (what the oracle knows)
    cap: int


def make_batch(dist: LongTail, rng: np.random.Generator, prompts: int, per_prompt: int, cap: int,
               prompt_range: tuple[int, int]) -> Batch:
    plen = np.repeat(rng.integers(prompt_range[0], prompt_range[1] + 1, prompts), per_prompt)
    return Batch(plen, dist.sample(rng, prompts, per_prompt, cap), cap)
