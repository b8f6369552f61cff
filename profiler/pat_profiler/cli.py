"""``pat-profile``: write the latency table the switch controller reads.

    pat-profile --model ./my-model --world 4 --tp 1 2 4 --dtype float32 --output profile.json
    pat-profile ... --resume                      # continue an interrupted run
    pat-profile ... --emulate-world 8 --device cuda --link-bandwidth 150e9 --link-latency 8e-6
    pat-profile ... --emulate-world 2 --graph-backend standin   # the CPU with the graphs' stand-in

Decode steps run as the engine runs them: its decode graphs (``--graph-backend``, ``--enforce-eager``),
its attention backend; each point keeps the median step of its window.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time

from tqdm.auto import tqdm

from pat_engine.config import GRAPH_BACKENDS
from pat_profiler.draws import DRAWS
from pat_profiler.grid import DEFAULT_BATCHES, DEFAULT_CONTEXTS, build_grid


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pat-profile", description=__doc__.split("\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--world", type=int, help="devices (CPU: worker processes) of the deployment")
    p.add_argument("--tp", type=int, nargs="+", help="candidate TP degrees (default: every valid power of two)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="per DP group")
    p.add_argument("--context-lens", type=int, nargs="+", default=list(DEFAULT_CONTEXTS))
    p.add_argument("--kv-budget-tokens", type=int, default=65536,
                   help="keep points with batch * (context + window) <= this, per DP group")
    p.add_argument("--decode-window", type=int, default=60, help="decode steps averaged per point (paper: 60)")
    p.add_argument("--passes", type=int, default=1,
                   help="measure the grid this many times and average (steadier tables on a shared host)")
    p.add_argument("--output", default="profile.json")
    p.add_argument("--resume", action="store_true", help="continue the table at --output")
    p.add_argument("--threads-per-worker", type=int, help="CPU: torch threads per worker (default cores // world)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--emulate-world", type=int, metavar="N",
                   help="time each TP degree's rank-0 shard in this process and add the collective model")
    p.add_argument("--link-bandwidth", type=float, default=150e9, help="emulation: per-rank link bytes/s")
    p.add_argument("--link-latency", type=float, default=8e-6, help="emulation: seconds per ring hop")
    p.add_argument("--graph-backend", default="auto", choices=GRAPH_BACKENDS,
                   help="decode graphs as the engine takes them: auto (CUDA graphs on a GPU, none on the CPU) or "
                        "standin (the CPU's eager replays over the graphs' buffers)")
    p.add_argument("--enforce-eager", action="store_true", help="time decode steps without graphs")
    p.add_argument("--draw", default="greedy", choices=sorted(DRAWS),
                   help="how each decode step samples: greedy (the argmax), or rl (temperature 1 with each token's "
                        "log-prob, as an RL rollout draws; the draw is TP rank 0's alone and does not shrink with "
                        "TP, so profile an RL deployment with it)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="time decode steps as an engine with async_scheduling runs them (each sent before the "
                        "one in flight is answered); real runs only (default: the engine's, on for CUDA)")
    args = p.parse_args(argv)
    if args.emulate_world is None and args.world is None:
        p.error("--world is required (or --emulate-world N)")
    if args.emulate_world is not None and args.resume:
        p.error("--resume applies to real runs; an emulated profile is one pass")
    if args.emulate_world is not None and args.async_scheduling:
        p.error("--async-scheduling applies to real runs: an emulated profile times one rank's steps in process, "
                "with no driver to overlap")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = "pat-profile " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    if args.emulate_world is not None:
        table = _emulate(args, command)
    else:
        from pat_profiler.profile import ProfileOptions, run_profile

        opts = ProfileOptions(
            model=args.model, world=args.world, tps=tuple(args.tp) if args.tp else None, dtype=args.dtype,
            device=args.device, batches=tuple(args.batch_sizes), contexts=tuple(args.context_lens),
            budget_tokens=args.kv_budget_tokens, window=args.decode_window, output=args.output, resume=args.resume,
            seed=args.seed, threads_per_worker=args.threads_per_worker, block_size=args.block_size,
            passes=args.passes, engine_kwargs=decode_kwargs(args), draw=args.draw)
        table = run_profile(opts, command)
    print(summary(table, time.perf_counter() - started, args.output))
    return 0


def decode_kwargs(args: argparse.Namespace) -> dict:
    """How decode steps run (graphs, async scheduling) as ``Engine`` / ``EngineConfig`` keywords (empty:
    the engine's defaults)."""
    out = {}
    if args.graph_backend != "auto":
        out["graph_backend"] = args.graph_backend
    if args.enforce_eager:
        out["enforce_eager"] = True
    if args.async_scheduling is not None:
        out["async_scheduling"] = args.async_scheduling
    return out


def _emulate(args: argparse.Namespace, command: str):
    from pat_engine.model.arch import load_model_arch
    from pat_profiler.emulate import CollectiveModel, emulate_profile

    world = args.emulate_world
    arch = load_model_arch(args.model)
    tps = sorted(args.tp or (layout.tp for layout in arch.valid_layouts(world)))
    grid = build_grid(tps, args.batch_sizes, args.context_lens, args.decode_window, args.kv_budget_tokens,
                      arch.max_position, max_num_seqs=max(args.batch_sizes))
    bar = tqdm(total=len(grid), desc="pat-profile (emulated)", unit="pt", dynamic_ncols=True)
    table = emulate_profile(args.model, world, tps, args.dtype, args.device, grid, args.decode_window,
                            CollectiveModel(args.link_bandwidth, args.link_latency), args.block_size, args.seed,
                            progress=lambda p: bar.update(1), draw=args.draw, **decode_kwargs(args))
    bar.close()
    table.meta["command"] = command
    table.save(args.output)
    return table


def summary(table, seconds: float, path: str) -> str:
    dep = table.deployment
    lines = [f"wrote {path}: {len(table.points)} points, TP {table.tps()}, world {dep.world}, {dep.device}, "
             f"{dep.dtype}{' (EMULATED)' if dep.emulated else ''}; {seconds:.1f}s this run"]
    if table.bandwidth_bytes_per_s:
        lines.append(f"reshard bandwidth {table.bandwidth_bytes_per_s / 1e9:.3f} GB/s per rank")
    for c in table.switch_costs:
        lines.append(f"switch TP{c.from_tp}->TP{c.to_tp}: fixed {c.fixed_s * 1e3:.1f} ms, "
                     f"weights {c.weight_bytes / 1e6:.2f} MB on the busiest sender"
                     + (f", {c.graphs_s_per_size * 1e3:.1f} ms per decode graph" if c.graphs_s_per_size else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
