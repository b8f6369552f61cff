"""How a TP1 engine's OpenMP threads wait between kernels: sleeping (PASSIVE), a short spin
(GOMP_SPINCOUNT=10000), or libgomp's own default (a spin of 300000, then sleep), which the engine
keeps where its threads have the cores to themselves (EngineConfig.worker_env).

    PYTHONPATH=.:profiler:integrations:csrc python bench/omp_wait_policy_ab.py [--rounds 8] [--background-load 0 2]

One engine per policy (TP1, 2 torch threads, bench/common.PEER_SPEC, float32) is started and kept;
the policy is read when its worker starts. The engines then take turns on the same greedy batch
(order reversed every round), so the shared host's load hits them alike; an idle engine's threads
sleep. Output tokens/s, median over rounds, per batch size. ``--background-load N`` runs the
whole comparison again with N busy-looping processes beside it: what spinning costs when the
cores are not the engine's alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_cpu import SPEC, model_path  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402

POLICIES = {  # name -> the environment the engine's worker starts with
    "PASSIVE (sleep)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "libgomp default (spin 300000)": {"GOMP_SPINCOUNT": "300000"},
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def start_engines() -> dict[str, Engine]:
    engines = {}
    saved = {k: os.environ.pop(k, None) for k in OMP_VARS}
    try:
        for name, env in POLICIES.items():
            for k in OMP_VARS:
                os.environ.pop(k, None)
            os.environ.update(env)  # a user's own OpenMP settings win over EngineConfig.worker_env
            engines[name] = Engine(model_path(), tp=1, dp=1, dtype="float32", threads_per_worker=2)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    return engines


def compare(engines: dict[str, Engine], batches: list[int], rounds: int, new_tokens: int) -> list[list]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        prompts = torch.randint(10, SPEC.vocab_size - 10, (batch, 32), generator=g).tolist()
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        for engine in engines.values():
            engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), use_tqdm=False)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                start = time.perf_counter()
                engines[name].generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * new_tokens / (time.perf_counter() - start))
        med = {name: statistics.median(v) for name, v in rates.items()}
        base = med["PASSIVE (sleep)"]
        rows.append([batch] + [f"{med[n]:.0f} ({med[n] / base:.2f}x)" for n in engines])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--background-load", type=int, nargs="+", default=[0, 2],
                    help="busy-looping processes beside the engines, one comparison per value")
    args = ap.parse_args()
    engines = start_engines()
    sections = []
    try:
        for hogs in args.background_load:
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
            try:
                rows = compare(engines, args.batch_sizes, args.rounds, args.new_tokens)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            sections.append(f"### {hogs} busy process(es) beside the engines\n\n"
                            + markdown_table(["batch"] + [f"{n} tok/s" for n in engines], rows))
    finally:
        for engine in engines.values():
            engine.shutdown()
    body = (f"TP1 engines, 2 torch threads each, greedy, prompt 32, {args.new_tokens} new tokens, median of "
            f"{args.rounds} interleaved rounds; the ratio is against PASSIVE.\n\n" + "\n\n".join(sections))
    write_result("omp_wait_policy_ab", "OpenMP wait policy of a TP1 engine: sleep, short spin, long spin", body)


if __name__ == "__main__":
    main()
