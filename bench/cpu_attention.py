"""Decode attention alone on the CPU: the C++ paged kernel against the torch path (gather + SDPA).

    PYTHONPATH=.:profiler:integrations:csrc python bench/cpu_attention.py [--threads 1 2] [--repeats 41]

One "step" is ``paged_attention`` (KV write included, as in the engine) for the 4 layers of the
benchmark model: 8 heads / 4 KV heads, head_dim 64, block 16, float32. Each layer has its own pool
(sized for the batch plus a quarter spare), block tables hand out shuffled blocks, as after some
churn. Contexts: every row at 32, every row at 160, or rows spread evenly over 32..160. The two
paths alternate step by step (A, B, A, B, ...; ``PAT_CPU_ATTENTION`` switches them) and each
reports its median. The first-build time is measured in a subprocess with an empty extensions folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC, markdown_table, write_result  # noqa: E402
from pat_engine.model.layers.attention import AttentionMetadata, paged_attention  # noqa: E402
from pat_kernels import cpu_attention, cpu_extension  # noqa: E402

LAYERS, HEADS, KV_HEADS = PEER_SPEC.num_layers, PEER_SPEC.num_heads, PEER_SPEC.num_kv_heads
HEAD_DIM, BLOCK = PEER_SPEC.hidden_size // PEER_SPEC.num_heads, 16
CONTEXTS = {"32": lambda b: [32] * b, "160": lambda b: [160] * b,
            "32..160": lambda b: [32 + (128 * i) // max(b - 1, 1) for i in range(b)]}


def decode_inputs(lengths: list[int], dtype: torch.dtype, seed: int = 0):
    """Per-layer pools, the step's metadata, and q/k/v of the new tokens (one per row)."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(lengths), -(-max(lengths) // BLOCK)
    num_blocks = b * width + max(4, b * width // 4)
    tables = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width)
    lens = torch.tensor(lengths)
    pos = lens - 1
    slots = tables[torch.arange(b), pos // BLOCK] * BLOCK + pos % BLOCK
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, query_len=1, block_tables=tables,
                             context_lens=lens)  # the torch path derives its mask from the lengths
    pools = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(b, HEADS, HEAD_DIM, generator=g).to(dtype)
    kv = torch.randn(b, 2 * KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return pools, meta, q, kv[:, :KV_HEADS], kv[:, KV_HEADS:]


def step_ms(path: str, pools, meta, q, k, v) -> float:
    os.environ[cpu_attention.ENV_SWITCH] = path
    start = time.perf_counter()
    for pool in pools:
        paged_attention(q, k, v, pool, meta, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) * 1e3


def first_build_seconds() -> float | None:
    """A fresh build of the extension in a subprocess (empty TORCH_EXTENSIONS_DIR)."""
    code = ("from pat_kernels import cpu_extension as c; ok = c.load(); "
            "print(c.build_seconds if ok else 'failed: %s' % c._failed)")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TORCH_EXTENSIONS_DIR=tmp),
                             capture_output=True, text=True, timeout=900)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print("first build failed:", out.stdout, out.stderr, file=sys.stderr)
        return None


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, torch.get_num_threads()}))
    ap.add_argument("--repeats", type=int, default=41, help="timed steps per path and case")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--skip-build-time", action="store_true", help="do not time a fresh build")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    build_s = None if args.skip_build_time else first_build_seconds()
    if cpu_attention.load_kernel() is None:
        sys.exit(f"the kernel cannot be built: {cpu_extension._failed}")
    load_s = cpu_extension.build_seconds
    load_before = os.getloadavg()[0]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            for name, lengths in CONTEXTS.items():
                inputs = decode_inputs(lengths(batch), dtype)
                for _ in range(3):  # warm-up of both paths
                    step_ms("torch", *inputs), step_ms("kernel", *inputs)
                torch_ms, kernel_ms = [], []
                for _ in range(args.repeats):
                    torch_ms.append(step_ms("torch", *inputs))
                    kernel_ms.append(step_ms("kernel", *inputs))
                t, k = statistics.median(torch_ms), statistics.median(kernel_ms)
                rows.append([threads, batch, name, f"{t:.3f}", f"{k:.3f}", f"{t / k:.2f}x"])
    os.environ.pop(cpu_attention.ENV_SWITCH, None)
    load_after = os.getloadavg()[0]
    build = f"{build_s:.1f} s" if build_s is not None else "not measured"
    body = (
        f"`paged_attention` for one decode step of {LAYERS} layers ({HEADS} heads / {KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK}, {args.dtype}, KV write included), per torch thread count; "
        f"torch path (block gather + SDPA) and C++ kernel alternating, median of {args.repeats} steps each. "
        f"Load average (2 cores, shared) before / after: {load_before:.2f} / {load_after:.2f}.\n\n"
        f"First build of the extension (empty cache, `-O3`, flags {' '.join(cpu_extension.isa()[1]) or 'none'}): "
        f"{build}; loading it from the cache: {load_s:.2f} s.\n\n"
        + markdown_table(["threads", "batch", "context", "torch path ms", "kernel ms", "torch / kernel"], rows)
    )
    write_result("cpu_attention", "CPU decode attention: paged C++ kernel vs torch path", body)


if __name__ == "__main__":
    main()
