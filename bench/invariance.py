"""Invariant numerics (docs/numerics.md): what a layout change or a live switch changes, and what the mode costs.

A. Identity. For each model shape, dtype (bfloat16, float32) and mode (``numerics`` fast /
   invariant), one world-2 engine runs ``--requests`` long-tailed requests (greedy, then seeded
   temperature-1 sampling, logprobs on) at TP1xDP2 (the reference), at TP2xDP1, and with a live
   switch TP1xDP2 -> TP2xDP1 at decode step ``--switch-step`` on each KV path; a world-1 engine
   (one worker, TP1) runs the same requests, all at once and each alone. Reported per comparison:
   the share of requests whose tokens and logprobs are bit-identical to the reference, the share
   with identical tokens, and the largest |logprob difference| over the positions before the
   first differing token.
B. Cost. Two engines (fast, invariant) side by side run the same workloads in turn, A, B, A, B
   (``--rounds`` rounds, the order flipped every round; the cost is the median of the rounds'
   ratios): the greedy peer workload (bench/peer_cpu.py's checkpoint, 32-token prompts,
   ``--peer-batch`` requests of ``--peer-tokens`` tokens, EOS suppressed) and a sampled long-tail
   rollout (temperature 1, long-tailed lengths), in float32 and bfloat16: at world 1 (one worker),
   and at world 2 (TP1xDP2, TP2xDP1, the rollout with a live switch TP1xDP2 -> TP2xDP1 at decode
   step 16). Then one worker's decode step and prefill in this process (see ``step_cost``).

   The host is shared: other processes take the cores at random, so besides the wall clock each run is
   timed in the CPU seconds its workers used (``/proc/<pid>/stat``), which another process's load barely
   moves; OpenMP's threads sleep between kernels (``OMP_WAIT_POLICY=PASSIVE``, unless set) so that a
   thread waiting for work does not count as working.

    PYTHONPATH=.:profiler:csrc python bench/invariance.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: CPU time counts work, not spinning
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC, markdown_table, write_result  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.parallel.layout import Layout  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402

SHAPES = {
    "qwen2 h256 L4 GQA 8:2": TinyModelSpec(arch="qwen2", hidden_size=256, intermediate_size=512, num_layers=4,
                                           num_heads=8, num_kv_heads=2, seed=21),
    "llama h512 L4 GQA 8:4": PEER_SPEC,
}
MODES = ("fast", "invariant")


def long_tail(n: int, seed: int, short: int = 8, cap: int = 96) -> list[int]:
    """Response lengths: most short, a few near ``cap`` (a rollout's long tail)."""
    rng = random.Random(seed)
    return [min(cap, int(short * rng.lognormvariate(0.0, 1.0)) + 2) for _ in range(n)]


def prompts(n: int, vocab: int, seed: int, length: tuple[int, int] = (4, 24)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(*length))] for _ in range(n)]


def params(lengths: list[int], sampled: bool, logprobs: bool = True) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=m, min_new_tokens=m, logprobs=logprobs, seed=1000 + i,
                           temperature=1.0 if sampled else 0.0) for i, m in enumerate(lengths)]


def run(engine: Engine, start_tp: int, batch, plist, schedule=None, kv=None) -> list:
    engine.reconfigure(tp=start_tp)
    return engine.generate(batch, plist, switch_schedule=schedule, kv_transfer=kv, use_tqdm=False)


def compare(ref: list, other: list) -> tuple[float, float, float]:
    """(bit-identical share, identical-token share, largest |logprob diff| before the first differing token)."""
    same = same_tokens = 0
    worst = 0.0
    for a, b in zip(ref, other):
        same += a.token_ids == b.token_ids and a.logprobs == b.logprobs
        same_tokens += a.token_ids == b.token_ids
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            worst = max(worst, abs(la - lb))
    return same / len(ref), same_tokens / len(ref), worst


def identity(args, paths: dict[str, str]) -> list[list]:
    rows = []
    for shape, path in paths.items():
        vocab = SHAPES[shape].vocab_size
        batch, lengths = prompts(args.requests, vocab, 1), long_tail(args.requests, 2)
        for dtype in ("bfloat16", "float32"):
            for mode in MODES:
                refs, others = {}, {}
                with Engine(path, tp=1, dp=2, dtype=dtype, numerics=mode) as engine:
                    for sampled in (False, True):
                        plist = params(lengths, sampled)
                        refs[sampled] = run(engine, 1, batch, plist)
                        others[sampled] = {
                            "TP2xDP1": run(engine, 2, batch, plist),
                            "switch, migrate": run(engine, 1, batch, plist, [(args.switch_step, 2)], "migrate"),
                            "switch, recompute": run(engine, 1, batch, plist, [(args.switch_step, 2)], "recompute"),
                        }
                with Engine(path, tp=1, dp=1, dtype=dtype, numerics=mode) as engine:  # another deployment size
                    for sampled in (False, True):
                        plist = params(lengths, sampled)
                        others[sampled]["world 1, batched"] = run(engine, 1, batch, plist)
                        others[sampled]["world 1, each alone"] = [run(engine, 1, [p], [q])[0] for p, q in zip(batch, plist)]
                for sampled in (False, True):
                    for name, outs in others[sampled].items():
                        ident, tokens, worst = compare(refs[sampled], outs)
                        rows.append([shape, dtype, mode, "sampled" if sampled else "greedy", name,
                                     f"{ident:.0%}", f"{tokens:.0%}", f"{worst:.3g}"])
                        print(rows[-1], flush=True)
    return rows


def worker_cpu_seconds(engine: Engine) -> float:
    """User + system CPU seconds the engine's worker processes have used so far."""
    total = 0
    for pid in engine.worker_pids():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
    return total / os.sysconf("SC_CLK_TCK")


def timed(engine: Engine, start_tp: int, batch, plist, schedule=None) -> tuple[float, float]:
    """(generated tokens per wall second, per CPU second of the workers)."""
    engine.reconfigure(tp=start_tp)
    cpu, t = worker_cpu_seconds(engine), time.perf_counter()
    outs = engine.generate(batch, plist, switch_schedule=schedule, kv_transfer="migrate" if schedule else None,
                           use_tqdm=False)
    seconds, cpu = time.perf_counter() - t, worker_cpu_seconds(engine) - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / seconds, tokens / cpu


def cost(args, peer_path: str) -> list[list]:
    peer_batch = prompts(args.peer_batch, PEER_SPEC.vocab_size, 3, (32, 33))
    peer = params([args.peer_tokens] * args.peer_batch, sampled=False, logprobs=False)
    tail_batch = prompts(args.tail_requests, PEER_SPEC.vocab_size, 4)
    tail = params(long_tail(args.tail_requests, 5, short=12, cap=160), sampled=True)
    switch = [(16, 2)]
    workloads = {  # (world, dtype) -> (name, start tp, prompts, params, switch schedule)
        (1, "float32"): [("greedy peer, TP1", 1, peer_batch, peer, None),
                         ("sampled long tail, TP1", 1, tail_batch, tail, None)],
        (1, "bfloat16"): [("greedy peer, TP1", 1, peer_batch, peer, None),
                          ("sampled long tail, TP1", 1, tail_batch, tail, None)],
        (2, "float32"): [("greedy peer, TP1xDP2", 1, peer_batch, peer, None),
                         ("greedy peer, TP2xDP1", 2, peer_batch, peer, None),
                         ("sampled long tail, switch TP1xDP2 -> TP2xDP1", 1, tail_batch, tail, switch)],
        (2, "bfloat16"): [("greedy peer, TP1xDP2", 1, peer_batch, peer, None),
                          ("sampled long tail, switch TP1xDP2 -> TP2xDP1", 1, tail_batch, tail, switch)],
    }
    rows = []
    for (world, dtype), loads in workloads.items():
        engines = {mode: Engine(peer_path, tp=1, dp=world, dtype=dtype, numerics=mode) for mode in MODES}
        try:
            for name, tp, batch, plist, schedule in loads:
                for mode in MODES:  # warm-up: kernels, packs, groups
                    timed(engines[mode], tp, batch[:4], plist[:4], schedule)
                rates: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
                for rnd in range(args.rounds):
                    for mode in MODES if rnd % 2 == 0 else MODES[::-1]:  # A, B, B, A, ...: neither always first
                        rates[mode].append(timed(engines[mode], tp, batch, plist, schedule))
                        wall, cpu = rates[mode][-1]
                        print(f"world {world} {name} {dtype} {mode} round {rnd}: {wall:.1f} tok/s, {cpu:.1f} tok per "
                              "CPU s", flush=True)
                by_cpu = [f[1] / i[1] - 1 for f, i in zip(rates["fast"], rates["invariant"])]
                by_wall = [f[0] / i[0] - 1 for f, i in zip(rates["fast"], rates["invariant"])]
                rows.append([world, name, dtype] + [f"{statistics.median(r[k] for r in rates[m]):.1f}"
                                                    for k in (1, 0) for m in MODES]
                            + [f"{statistics.median(by_cpu):+.1%}", " / ".join(f"{c:+.0%}" for c in by_cpu),
                               f"{statistics.median(by_wall):+.1%}"])
        finally:
            for engine in engines.values():
                engine.shutdown()
    return rows


def step_cost(args, peer_path: str) -> list[list]:
    """One worker's decode step and prefill, in this process, as a worker of each world has it: world 1,
    the cores' threads (2 here), timed in CPU seconds of the process (``time.process_time``, every
    thread's); world 2, one thread, in CPU seconds of the thread (``time.thread_time``): the time other
    processes hold the cores does not count. Medians of many steps of the two modes interleaved. The
    invariant mode's chunk count is the declared width (8) in both."""
    from step_breakdown import Rollout  # same directory; the scheduler-like driver of one InferExecutor

    previous = torch.get_num_threads()
    rows = []
    for world, threads, clock in ((1, len(os.sched_getaffinity(0)), time.process_time), (2, 1, time.thread_time)):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for batch in args.step_batches:
                steps: dict[str, list[float]] = {mode: [] for mode in MODES}
                prefills: dict[str, list[float]] = {mode: [] for mode in MODES}
                for rep in range(args.prefill_repeats):
                    runs = {}
                    for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                        runs[mode] = Rollout(peer_path, batch, 32, args.step_tokens, True, dtype, Layout(1, world), mode)
                        t = clock()
                        runs[mode].prefill()
                        prefills[mode].append(clock() - t)
                    for i in range(args.step_tokens // 4):
                        for mode in MODES if i % 2 == 0 else MODES[::-1]:
                            for _ in range(4):
                                t = clock()
                                runs[mode].decode()
                                steps[mode].append(clock() - t)
                fast_step, inv_step = (statistics.median(steps[m]) * 1e3 for m in MODES)
                fast_pre, inv_pre = (statistics.median(prefills[m]) * 1e3 for m in MODES)
                rows.append([world, threads, str(dtype).removeprefix("torch."), batch, f"{fast_step:.2f}",
                             f"{inv_step:.2f}", f"{inv_step / fast_step - 1:+.1%}", f"{fast_pre:.1f}",
                             f"{inv_pre:.1f}", f"{inv_pre / fast_pre - 1:+.1%}"])
                print(rows[-1], flush=True)
    torch.set_num_threads(previous)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--switch-step", type=int, default=8)
    ap.add_argument("--peer-batch", type=int, default=16)
    ap.add_argument("--peer-tokens", type=int, default=48)
    ap.add_argument("--tail-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--step-tokens", type=int, default=24)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--skip-identity", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: str(write_tiny_model(Path(tmp) / f"m{i}", spec)) for i, (name, spec) in enumerate(SHAPES.items())}
        ident = [] if args.skip_identity else identity(args, paths)
        costs = [] if args.skip_cost else cost(args, paths["llama h512 L4 GQA 8:4"])
        steps = [] if args.skip_cost else step_cost(args, paths["llama h512 L4 GQA 8:4"])
    body = (
        f"{args.requests} long-tailed requests per run; reference: a world-2 engine (CPU worker processes) at "
        f"TP1xDP2; live switches TP1xDP2 -> TP2xDP1 at decode step {args.switch_step}; world 1: a one-worker "
        "engine (another deployment size), the requests all at once and each alone.\n\n"
        + markdown_table(["model", "dtype", "numerics", "sampling", "vs TP1xDP2", "bit-identical (tokens + logprobs)",
                          "identical tokens", "max |logprob diff|"], ident)
        + "\n\nThroughput, median of "
        f"{args.rounds} interleaved rounds: generated tokens per CPU second of the workers (the measure) and per "
        "wall second (the shared host's other load moves it); cost = fast / invariant - 1 in each round, "
        "median and each round (CPU), median (wall):\n\n"
        + markdown_table(["world", "workload", "dtype", "fast tok / CPU s", "invariant tok / CPU s",
                          "fast tok/s (wall)", "invariant tok/s (wall)", "cost (CPU)", "per round (CPU)",
                          "cost (wall)"], costs)
        + "\n\nOne worker's step in this process, llama h512 checkpoint, 32-token prompts, temperature 1; "
        "world 1: the machine's threads, CPU ms of the process; world 2: one thread, CPU ms of the thread; median of "
        f"{args.prefill_repeats * args.step_tokens} interleaved decode steps and of {args.prefill_repeats} "
        "prefills per mode:\n\n"
        + markdown_table(["world", "threads", "dtype", "batch", "fast decode ms", "invariant decode ms", "decode cost",
                          "fast prefill ms", "invariant prefill ms", "prefill cost"], steps)
        + f"\n\nTotal time {time.perf_counter() - start:.0f} s.\n"
    )
    write_result("invariance", "Invariant numerics: identity across layouts and live switches, and its cost", body)


if __name__ == "__main__":
    main()
