"""The CPU paged decode attention kernel at RL decode shapes: this tree's against a base commit's.

One call is ``paged_decode_attention_cpu`` for one layer (block 16, shuffled blocks, every row at the
shape's context), on all of this machine's torch threads, as a TP1 worker runs it. Shapes: the long
tail (1 x 16K, 4 x 4K), mid-rollout batches (16 x 1K, 64 x 512, 96 x 128, 96 rows
spread over 32..1K tokens as in bench/peer_rollout.py's batches), for three head layouts (Qwen2-0.5B's 14 / 2
heads of 64, the h768 peer model's 12 / 2 of 64, Llama-3-8B's 32 / 8 of 128), in float32 and bfloat16.
*GB/s*: the K and V bytes the call reads over its time (beside it, what ``torch.sum`` reads over 256 MiB on
the same threads). Each round runs one process per tree (base, new, base, new, ...); the table
gives the median over ``--rounds`` of each round's median call. *error*: the largest absolute difference
from the torch path in float64 on the same inputs, per tree (both are roundings of the same sums).

    python bench/cpu_decode_attention_ab.py      # writes bench/results/cpu_decode_attention_ab.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common import alternating_rounds, markdown_table, tree_at, tree_comparison_args, write_result

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16
HEADS = {"14/2 x 64": (14, 2, 64), "12/2 x 64": (12, 2, 64), "32/8 x 128": (32, 8, 128)}
SHAPES = ((1, 16384), (4, 4096), (16, 1024), (64, 512), (96, 128), (96, -1024))  # (rows, context); -C: 32..C spread
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(rows * 7919 + context)
    width = -(-abs(context) // BLOCK)
    blocks = rows * width + 4
    tables = torch.randperm(blocks, generator=g)[: rows * width].view(rows, width)
    pool = torch.randn(2, blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    return q, pool, tables, context_lengths(rows, context)


def label(rows: int, context: int) -> str:
    return f"{rows} x {context}" if context > 0 else f"{rows} x 32..{-context}"


def context_lengths(rows: int, context: int) -> torch.Tensor:
    """Every row at ``context``, or (negative) rows spread evenly over 32..-context, as in a rollout's batch."""
    if context > 0:
        return torch.full((rows,), context)
    return torch.linspace(32, -context, rows).round().long()


def reference(q, pool, tables, lens) -> torch.Tensor:
    """The torch path (block gather + SDPA) in float64."""
    from pat_engine.model.layers.attention import AttentionMetadata, paged_attention

    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(0, dtype=torch.long), query_len=1,
                             block_tables=tables, context_lens=lens)
    q64 = q.double()
    os.environ["PAT_CPU_ATTENTION"] = "torch"
    try:
        return paged_attention(q64, q64[:0, : pool.shape[3]], q64[:0, : pool.shape[3]], pool.double(), meta,
                               q.shape[-1] ** -0.5)
    finally:
        del os.environ["PAT_CPU_ATTENTION"]


def measure(calls: int) -> dict:
    """One round in this process, with whichever ``pat_kernels`` its path gives: {row: [seconds, error]}."""
    from pat_kernels import cpu_attention

    kernel = cpu_attention.load_kernel()
    out = {}
    for dname, dtype in DTYPES.items():
        for hname, (heads, kv_heads, head_dim) in HEADS.items():
            for rows, context in SHAPES:
                q, pool, tables, lens = inputs(rows, context, heads, kv_heads, head_dim, dtype)
                scale = head_dim**-0.5
                got = kernel(q, pool, tables, lens, scale)  # warm-up, and the output checked below
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    kernel(q, pool, tables, lens, scale)
                    times.append(time.perf_counter() - start)
                error = (got.double() - reference(q, pool, tables, lens)).abs().max().item()
                out[f"{dname}|{hname}|{label(rows, context)}"] = [statistics.median(times), error]
    return out


def read_bandwidth() -> float:
    """Bytes per second ``torch.sum`` reads over a 256 MiB tensor (best of 5), on this process's threads."""
    x = torch.ones(64 << 20)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * x.element_size() / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ns = tree_comparison_args(__doc__, 9, "timed calls per row and round (the median counts)", "HEAD")
    if ns.measure:
        print(json.dumps(measure(ns.steps)))
        return
    trees = {"base": tree_at(ns.base, ["csrc", "pat_engine"]), "new": REPO}
    runs = alternating_rounds(__file__, trees, ns.rounds, ["--steps", str(ns.steps)])
    rows = []
    for key in runs["new"][0]:
        dname, hname, shape = key.split("|")
        rows_, context = next(s for s in SHAPES if label(*s) == shape)
        heads, kv_heads, head_dim = HEADS[hname]
        nbytes = int(context_lengths(rows_, context).sum()) * kv_heads * head_dim * 2 * DTYPES[dname].itemsize
        base, new = (statistics.median(r[key][0] for r in runs[label]) for label in ("base", "new"))
        err = {label: max(r[key][1] for r in runs[label]) for label in ("base", "new")}
        rows.append([dname, hname, shape, f"{base * 1e3:.3f}", f"{new * 1e3:.3f}", f"{nbytes / base / 1e9:.1f}",
                     f"{nbytes / new / 1e9:.1f}", f"{base / new:.2f}x", f"{err['base']:.1e}", f"{err['new']:.1e}"])
    body = (f"One layer's decode attention, {torch.get_num_threads()} torch threads, block {BLOCK}; this host's read "
            f"bandwidth (`torch.sum` over 256 MiB, best of 5): {read_bandwidth() / 1e9:.1f} GB/s. Median of "
            f"{ns.rounds} interleaved rounds (one process per tree and round), each the median of {ns.steps} calls. "
            f"`base`: the kernel at commit {ns.base}; `new`: this tree's. Heads: query / KV heads x head dim.\n\n"
            + markdown_table(["dtype", "heads", "rows x context", "base ms", "new ms", "base GB/s", "new GB/s",
                              "speed-up", "base error", "new error"], rows))
    write_result("cpu_decode_attention_ab", "CPU decode attention: this tree's kernel against a base commit's", body)


if __name__ == "__main__":
    sys.exit(main())
