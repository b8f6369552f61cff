"""Shared KV blocks: n samples of one prompt, and a repeated system prompt (prefix cache).

A. ``--n`` samples of each of ``--prompts`` prompts of ``--prompt-len`` random tokens, every
   sample decoding ``--new-tokens`` (EOS ignored, temperature 1, seeded):
   - shared: ``SamplingParams(n=N)`` (the prompt is prefilled once, its full blocks shared);
   - unshared: the same N draws sent as N separate requests (seeds ``sample_seed(seed, i)``) with
     prefix caching off, i.e. what an engine without sharing does.
   Reported: peak KV blocks in use (polled), wall time, and "decode tok/s" = generated tokens / wall time
   (prefill included); the tokens must agree.
B. ``--requests`` requests, each one of ``--systems`` system prompts of ``--system-len`` tokens plus
   a unique question: prefix caching on vs off; hit rate and wall time.

Runs alternate (A shared, A unshared, A shared, ...), ``--repeats`` rounds; medians reported.

    PYTHONPATH=.:profiler python bench/prefix_sharing.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import replace

import numpy as np

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.sampling.seeds import sample_seed
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

# the issue 11 checkpoint shape, with room for 512-token prompts
SPEC = TinyModelSpec(arch="llama", vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=4,
                     num_heads=8, num_kv_heads=4, max_position=2048, seed=11)


class PeakBlocks:
    """Polls the engine's KV blocks in use while a run goes on."""

    def __init__(self, engine: Engine, every_s: float = 0.05):
        self.engine, self.every_s, self.peak = engine, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.engine.prefix_cache_stats()["used_blocks"])
            self._stop.wait(self.every_s)

    def __enter__(self) -> "PeakBlocks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_samples(engine: Engine, prompts: list[list[int]], params: SamplingParams, shared: bool) -> dict:
    if shared:
        batch, per = prompts, [params] * len(prompts)
    else:
        singles = [replace(params, n=1, seed=sample_seed(params.seed, i)) for i in range(params.n)]
        batch = [p for p in prompts for _ in range(params.n)]
        per = [s for _ in prompts for s in singles]
    with PeakBlocks(engine) as peak:
        t = time.perf_counter()
        outs = engine.generate(batch, per, use_tqdm=False)
        wall = time.perf_counter() - t
    tokens = [s.token_ids for o in outs for s in (o.samples or [o])]
    return {"wall_s": wall, "peak_blocks": peak.peak, "tok_per_s": sum(map(len, tokens)) / wall, "tokens": tokens}


def run_systems(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    before = engine.prefix_cache_stats()
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    after = engine.prefix_cache_stats()
    queried = after["queried_tokens"] - before["queried_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    return {"wall_s": wall, "hit_rate": hit / queried if queried else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=64, help="KV budget per rank (MiB)")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    model = str(write_tiny_model(tempfile.mkdtemp(prefix="pat-prefix-"), SPEC))
    prompts = [rng.integers(10, 2000, args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=7, n=args.n, ignore_eos=True)
    systems = [rng.integers(10, 2000, args.system_len).tolist() for _ in range(args.systems)]
    questions = [systems[i % args.systems] + rng.integers(10, 2000, int(rng.integers(16, 64))).tolist()
                 for i in range(args.requests)]
    kv = args.kv_mib << 20

    with Engine(model, tp=1, dp=1, dtype="float32", kv_cache_bytes=kv) as shared_engine, \
            Engine(model, tp=1, dp=1, dtype="float32", kv_cache_bytes=kv, enable_prefix_caching=False) as plain:
        blocks_total = shared_engine.worker_stats()[0]["kv_blocks"]
        a = {"shared": [], "unshared": []}
        b = {"on": [], "off": []}
        for _ in range(args.repeats):  # interleaved: A shared, A unshared, B on, B off, ...
            a["shared"].append(run_samples(shared_engine, prompts, params, shared=True))
            a["unshared"].append(run_samples(plain, prompts, params, shared=False))
            b["on"].append(run_systems(shared_engine, questions, 16))
            b["off"].append(run_systems(plain, questions, 16))
    agree = all(r["tokens"] == a["shared"][0]["tokens"] for r in a["shared"] + a["unshared"])

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    rows_a = [[name, med(runs, "peak_blocks"), med(runs, "wall_s"), med(runs, "tok_per_s")] for name, runs in a.items()]
    ratio = med(a["shared"], "tok_per_s") / med(a["unshared"], "tok_per_s")
    rows_b = [[f"prefix caching {name}", med(runs, "hit_rate"), med(runs, "wall_s")] for name, runs in b.items()]
    body = (
        f"Model: Llama-shaped, hidden 512, 4 layers, 8 heads / 4 KV heads, float32, TP1 (one worker); KV budget "
        f"{args.kv_mib} MiB ({blocks_total} blocks of 16 tokens).\n\n"
        f"## A. n={args.n} samples of {args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each\n\n"
        + markdown_table(["run", "peak KV blocks in use", "wall s", "decode tok/s"], rows_a)
        + f"\n\nshared / unshared throughput: **{ratio:.2f}x**; tokens identical in every run: **{agree}**\n\n"
        f"## B. {args.requests} requests over {args.systems} system prompts of {args.system_len} tokens\n\n"
        + markdown_table(["run", "prefix-cache hit rate", "wall s"], rows_b)
        + f"\n\nmedians of {args.repeats} interleaved rounds."
    )
    write_result("prefix_sharing", "Shared KV: n samples and the prefix cache", body)


if __name__ == "__main__":
    main()
