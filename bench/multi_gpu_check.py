"""The live switch on 2-8 real GPUs, one rank per GPU, NCCL collectives and CUDA graphs at every TP (issue 32,
item 5): the ``switch`` part of bench/gpu_check.py at full size, where the co-located one-GPU run cannot go.

    python bench/multi_gpu_check.py                 # every GPU this machine shows (the largest power of two <= 8)
    python bench/multi_gpu_check.py --world 4       # four of them
    python bench/multi_gpu_check.py --smoke         # toy sizes, CPU worker processes (nothing measured)

Model: Llama-3.2-1B's shape, random bf16 (bench/gpucheck/shared.LLAMA32_1B, written once under
``--workdir``). For each target TP (2, and the world when larger): the switch part's long-tail batch at
TP1xDP<world>, merged to TP<t> at decode step 16 while every request runs, split back once only the tail is
left, over both KV paths after a warm-up batch; each switch by phase (drain, groups, weights, KV, graphs)
in seconds and bytes, the graphs phase's share, NCCL point-to-point GB/s, decode steps per layout and CUDA
memory per rank before and after. Writes bench/results/multi_gpu_check.md.

On a machine with fewer than 2 GPUs it says so and exits 2 without running anything (one GPU: the
``switch`` part of bench/gpu_check.py runs the same switch with the ranks sharing it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "bench", ROOT / "integrations", ROOT / "profiler", ROOT / "csrc", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MAX_WORLD = 8


def world_for(devices: int, asked: int | None) -> int | None:
    """The world to run: ``asked``, else the largest power of two <= min(devices, 8); None when < 2 GPUs."""
    if devices < 2:
        return None
    if asked is not None:
        if not 2 <= asked <= min(devices, MAX_WORLD) or asked & (asked - 1):
            raise SystemExit(f"--world must be a power of two from 2 to {min(devices, MAX_WORLD)} on this machine "
                             f"({devices} GPUs), got {asked}")
        return asked
    return 1 << (min(devices, MAX_WORLD).bit_length() - 1)


def targets(world: int) -> list[int]:
    """The TP degrees merged into: 2, and the whole world when it is larger."""
    return sorted({2, world})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, help="GPUs to use (default: the largest power of two <= min(GPUs, 8))")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU worker processes; writes nothing")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pat_gpu_check"))
    args = p.parse_args(argv)

    import torch

    from common import markdown_table, write_result
    from gpucheck.checkpoint import write_checkpoint
    from gpucheck.shared import LLAMA32_1B, SMOKE_SPEC
    from gpucheck.switch import PHASE_HEADERS, decode_ms, start, switch_rows, workload
    from pat_engine.model.arch import load_model_arch
    from pat_engine.parallel.devices import DevicePlacement

    devices = 2 if args.smoke else torch.cuda.device_count()
    world = world_for(devices, args.world)
    if world is None:
        print(f"this machine shows {devices} CUDA device(s): the multi-GPU check needs 2 to {MAX_WORLD}, so nothing "
              "was run. On one GPU, `python bench/gpu_check.py --only switch` runs the same switch with the ranks "
              "sharing it (collectives through the host, not NVLink).", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    placement = DevicePlacement(world, 0 if args.smoke else devices)
    spec = SMOKE_SPEC if args.smoke else LLAMA32_1B
    name = "llama_smoke" if args.smoke else "llama32_1b_shape_bf16"
    ckpt = write_checkpoint(Path(args.workdir) / name, spec, torch.bfloat16, device)
    vocab = load_model_arch(str(ckpt)).vocab_size
    w = workload(args.smoke)
    lines = [f"Placement: {placement.describe()}. Model: {'the smoke spec' if args.smoke else 'Llama-3.2-1B shape'}, "
             f"random bf16. Batch: {w.requests} requests of {w.prompt} prompt tokens, {w.requests - w.tail} of "
             f"{w.short} new tokens and {w.tail} of {w.long}; merged at decode step {w.merge_at}, split back at "
             f"{w.split_at}."]
    with start(ckpt, world, device, args.smoke) as engine:
        for high in targets(world):
            rows, events, steps, memory = switch_rows(engine, w, high, ("migrate", "recompute"), vocab,
                                                      f"TP1xDP{world}")
            lines += ["", f"**TP1xDP{world} -> TP{high}xDP{world // high} -> TP1xDP{world}**", "",
                      markdown_table(PHASE_HEADERS, rows), "",
                      "Decode steps: " + "; ".join(f"{k}: {v}" for k, v in decode_ms(steps).items())
                      + f". CUDA memory per rank after the measured batches less before: {memory['delta']}."]
        bandwidth = engine.measure_bandwidth(8 << 20 if args.smoke else 256 << 20)
    lines += ["", f"Point-to-point, every rank sending and receiving at once: {bandwidth / 1e9:.2f} GB/s per rank."]
    body = "\n".join(lines)
    if args.smoke:
        print("SMOKE RUN: toy sizes on CPU worker processes; these numbers measure nothing.\n\n" + body)
    else:
        write_result("multi_gpu_check", f"The live switch on {world} GPUs (NCCL, one rank per GPU)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
