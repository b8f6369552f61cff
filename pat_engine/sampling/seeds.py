"""The random numbers of sampling as pure functions of integers (no torch): SplitMix64 hashes.

A request's draw at a position depends only on ``(seed, position)``, and sample ``i`` of ``n``
on ``sample_seed(seed, i)``, so no layout, batch or recompute changes what is drawn. ``uniforms``,
the batch twin of ``uniform_for`` (numpy, on the host), gives the same bits for a step's rows: the
sampler gets them as one float64 vector, not as two dozen tiny device kernels of 64-bit hashing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed`` (sample 0 keeps ``seed``)."""
    if sample_index == 0:
        return seed
    return splitmix64((seed & MASK64) ^ splitmix64(sample_index)) >> 1


def request_seed(engine_seed: int, request_number: int) -> int:
    """The seed of a request that gives none: from the engine's seed and the request's number, so it
    too is the same under every layout."""
    return splitmix64(engine_seed * 1_000_003 + request_number) >> 1


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, position)."""
    return (splitmix64(splitmix64(seed & MASK64) ^ position) >> 11) * 2.0**-53


_GOLDEN, _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` of every element (uint64 arithmetic wraps modulo 2**64, as the masks do above)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """``uniform_for(seeds[i], positions[i])`` for every i at once, the same bits: float64 (n,)."""
    s = np.fromiter((x & MASK64 for x in seeds), dtype=np.uint64, count=len(seeds))
    bits = _splitmix64_array(_splitmix64_array(s) ^ np.asarray(positions, dtype=np.uint64)) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53  # < 2**53: exact
