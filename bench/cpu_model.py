"""The CPU benchmark model: Llama-shaped, random weights, big enough that splitting one request's
matmuls over two worker processes beats the gloo collectives it adds (hidden 2048, 4 layers).

Written once to .pat-cache/ (git-ignored); the same spec always gives the same weights, so the
committed profile in bench/profiles/ matches it (the table checks the model fingerprint).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from longtail.workload import LongTail
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

SPEC = TinyModelSpec(arch="llama", vocab_size=2048, hidden_size=2048, intermediate_size=6144, num_layers=4,
                     num_heads=8, num_kv_heads=4, max_position=1024, seed=7)
ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "bench" / "profiles" / "cpu_llama_h2048_l4_w2_f64.json"
WORLD, DTYPE = 2, "float64"


def model_path() -> str:
    path = ROOT / ".pat-cache" / "bench_llama_h2048_l4"
    if not (path / "model.safetensors").is_file():
        write_tiny_model(path, SPEC)
    return str(path)


def long_tail_batch(n: int, cap: int, seed: int, prompt_lens: tuple[int, int] = (32, 97),
                    straggler: bool = False) -> tuple[list[list[int]], list[int]]:
    """Random-token prompts and long-tail response lengths (bench/longtail/workload.py scaled to ``cap``);
    with ``straggler`` the longest is set to the cap (the tail the paper targets)."""
    rng = np.random.default_rng(seed)
    lengths = LongTail.fit(scale=cap / 16384).sample(rng, max(n // 8, 1), 8, cap)[:n]
    if straggler:
        lengths[int(np.argmax(lengths))] = cap
    prompts = [rng.integers(16, 2000, int(rng.integers(*prompt_lens))).tolist() for _ in range(n)]
    return prompts, [int(x) for x in lengths]
