"""Two revisions of the engine timed side by side: the working tree against a base commit, in alternating
processes (base, tree, tree, base, ...), each running the same in-process step timer.

    python bench/revision_ab.py --base 40146f9 [--rounds 4] [--shape moe] [--dtypes float32 bfloat16]
                                [--prefills 16x128 1x2000]

The base is checked out into a temporary git worktree (its CPU kernels build there, into their own cache
folder: cpu_extension names it after the checkout). Each process times, on one worker's executor in process
(2 threads, fast numerics, the environment an engine gives a CPU worker: ``EngineConfig.worker_env``):
prefills (``--prefills``, default 16 prompts of 128 tokens, one 2048-token step; two untimed first, then the
median of 5) and decode steps at batch 16 and 64 (median of 30 after 4). Medians over rounds; the ratio is
base time / tree time (above 1: the tree is faster). Writes bench/results/revision_ab_<shape>[_<name>].md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(shape: str, dtype_name: str, prefills: tuple[tuple[int, int], ...] = ((16, 128),)) -> dict[str, float]:
    """This checkout's step times in ms (run inside the child process)."""
    import torch

    import step_breakdown
    from peer_rollout import SHAPES, model_path

    torch.set_num_threads(2)
    step_breakdown.SPEC = SHAPES[shape]
    path, dtype = model_path(shape), getattr(torch, dtype_name)

    def median_ms(fn, times: int) -> float:
        spans = []
        for _ in range(times):
            start = time.perf_counter()
            fn()
            spans.append(time.perf_counter() - start)
        return statistics.median(spans) * 1e3

    out = {}
    for batch, prompt_len in prefills:
        run = step_breakdown.Rollout(path, batch, prompt_len, 4, False, dtype=dtype)
        for _ in range(2):
            run.prefill()
        out[f"prefill {batch} x {prompt_len}"] = median_ms(run.prefill, 5)
    for batch in (16, 64):
        run = step_breakdown.Rollout(path, batch, 32, 40, False, dtype=dtype)
        run.prefill()
        for _ in range(4):
            run.decode()
        out[f"decode step, batch {batch}"] = median_ms(run.decode, 30)
    return out


def child(checkout: Path, shape: str, dtype_name: str, prefills: tuple[tuple[int, int], ...]) -> dict[str, float]:
    from common import json_from_worker_process

    # this file as the tree has it (a base may hold an older one, or none), the checkout's own bench helpers
    code = ("import importlib.util, json; "
            f"spec = importlib.util.spec_from_file_location('revision_ab_tree', {str(Path(__file__).resolve())!r}); "
            "timer = importlib.util.module_from_spec(spec); spec.loader.exec_module(timer); "
            f"print(json.dumps(timer.measure({shape!r}, {dtype_name!r}, {prefills!r})))")
    return json_from_worker_process(code, checkout, "the timer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shape", default="moe")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prefills", nargs="+", default=["16x128"], help="prefill steps as BATCHxPROMPT_LEN")
    ap.add_argument("--name", default="", help="what the change is, for the result file's name")
    args = ap.parse_args()
    prefills = tuple(tuple(int(v) for v in p.lower().split("x")) for p in args.prefills)
    sys.path.insert(0, str(ROOT / "bench"))
    from common import markdown_table, worker_process_env, write_result


    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() + (" + uncommitted changes" if dirty else "")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for dtype_name in args.dtypes:
                times: dict[str, list[dict[str, float]]] = {"base": [], "tree": []}
                for r in range(args.rounds):
                    for name in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
                        checkout = worktree if name == "base" else ROOT
                        times[name].append(child(checkout, args.shape, dtype_name, prefills))
                        print(name, dtype_name, times[name][-1], flush=True)
                for case in times["base"][0]:
                    b, t = (statistics.median(run[case] for run in times[n]) for n in ("base", "tree"))
                    rows.append([dtype_name, case, f"{b:.2f}", f"{t:.2f}", f"{b / t:.3f}x"])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    env_note = ", ".join(f"{k}={v}" for k, v in worker_process_env().items()) or "none"
    body = (f"Base {base}, tree {head}; model `{args.shape}`; medians over {args.rounds} alternating rounds, a fresh "
            f"process each, with the environment an engine gives its CPU workers ({env_note}) (ms).\n\n"
            + markdown_table(["dtype", "step", f"base {base} ms", "tree ms", "base / tree"], rows))
    write_result(f"revision_ab_{args.shape}" + (f"_{args.name}" if args.name else ""), "The working tree against a base revision, step by step", body)


if __name__ == "__main__":
    main()
