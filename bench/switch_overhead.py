"""Cost of a live layout switch vs a naive restart, on CPU worker processes.

Three measurements, all in one run on the same model (Llama-shaped, hidden
1024, 8 layers, float32, 4 worker processes):

1. A mid-batch switch (default TP2xDP2 -> TP4xDP1 with 9 unfinished requests,
   as in the paper's Fig. 12) broken down by component, against a naive
   restart: shut the engine down, start a new one at the target layout
   (weights reloaded from disk) and re-prefill every unfinished request.
2. KV migration vs recompute across context lengths: the measured cost of
   each path (migration: the switch's KV phase; recompute: the pool rebuild
   plus the re-prefill steps after the switch) and the cost model's
   prediction of each (Eq. 1-4 with the bandwidth and prefill rates the engine
   measured), so the predicted and the measured crossover can be compared.
3. Peak extra memory of the switch vs the size of the full KV pool.

    python bench/switch_overhead.py [--contexts 128 512 1024 2048] [--requests 9]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

SPEC = TinyModelSpec(arch="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=8,
                     num_heads=16, num_kv_heads=8, max_position=8192)


def prompts_for(n: int, context: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, SPEC.vocab_size - 10, (n, context), generator=g).tolist()


def switched_run(engine: Engine, prompts, start_tp: int, target_tp: int, kv: str, at_step: int, new_tokens: int):
    """Generate with one switch at ``at_step``; return (switch event, re-prefill seconds after it, outputs)."""
    engine.reconfigure(tp=start_tp)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with engine.record_steps() as steps:
        outs = engine.generate(prompts, params, switch_schedule=[(at_step, target_tp)], kv_transfer=kv, use_tqdm=False)
    event = engine.switches[-1]
    # recompute: the prefill steps that follow the switch rebuild the KV (groups run them in parallel)
    after = [s for s in steps if s.is_prefill and s.t > event.t]
    by_group: dict[int, float] = {}
    for s in after:
        by_group[s.group] = by_group.get(s.group, 0.0) + s.seconds
    return event, max(by_group.values(), default=0.0), outs


def naive_restart(path: str, world: int, target_tp: int, unfinished: list[list[int]], kv_bytes: int) -> dict:
    """New engine at the target layout, weights from disk, every unfinished request re-prefilled."""
    t = time.perf_counter()
    engine = Engine(path, tp=target_tp, dp=world // target_tp, dtype="float32", kv_cache_bytes=kv_bytes)
    started = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate(unfinished, SamplingParams(max_new_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    engine.shutdown()
    stopped = time.perf_counter() - t
    return {"start_and_load_s": started, "reprefill_s": prefill, "shutdown_s": stopped,
            "total_s": started + prefill + stopped}


def crossover_summary(rows: list[list]) -> str:
    """Where the cheaper KV path changes, measured and predicted (rows: context, mig, rec, _, pmig, prec, _)."""

    def describe(mig_col: int, rec_col: int) -> str:
        flips = [rows[i][0] for i in range(1, len(rows))
                 if (rows[i][mig_col] <= rows[i][rec_col]) != (rows[i - 1][mig_col] <= rows[i - 1][rec_col])]
        ratios = [r[rec_col] / r[mig_col] for r in rows if r[mig_col] > 0]
        if flips:
            return f"the cheaper path changes at context {flips[0]}"
        winner = "migration" if rows[0][mig_col] <= rows[0][rec_col] else "recompute"
        return (f"no crossover between {rows[0][0]} and {rows[-1][0]} tokens: {winner} is cheaper everywhere "
                f"(recompute / migrate = {min(ratios):.0f}x to {max(ratios):.0f}x)")

    return f"Crossover, measured: {describe(1, 2)}. Predicted: {describe(4, 5)}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--context", type=int, default=1024, help="prompt length for the headline switch")
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--from-tp", type=int, default=2)
    ap.add_argument("--to-tp", type=int, default=4)
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool per rank")
    args = ap.parse_args()
    world = 4
    kv_bytes = args.kv_cache_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(tmp, SPEC))
        engine = Engine(path, tp=args.from_tp, dp=world // args.from_tp, dtype="float32", kv_cache_bytes=kv_bytes)
        try:
            # warm-up: every layout's groups exist and every layout has measured prefill rates
            warm = prompts_for(4, 64, 0)
            for tp in (1, 2, 4):
                engine.reconfigure(tp=tp)
                engine.generate(warm, SamplingParams(max_new_tokens=2, ignore_eos=True), use_tqdm=False)
            bw = engine.measure_bandwidth(16 << 20)
            engine._loop.thread.run(lambda: engine.coordinator.switching.cost_source.record_kv_transfer(16 << 20, (16 << 20) / bw))

            # 1. headline switch vs naive restart
            prompts = prompts_for(args.requests, args.context, 1)
            event, _, outs = switched_run(engine, prompts, args.from_tp, args.to_tp, "migrate", 4, 8)
            unfinished = [o.prompt_token_ids + o.token_ids[:4] for o in outs]
            naive = naive_restart(path, world, args.to_tp, unfinished, kv_bytes)
            c = event.costs
            rows = [
                ["communication groups", c["groups_s"], "cache hit" if c["group_cache_hit"] else "created"],
                ["weights (reshard)", c["weights_s"], f"{c['weight_bytes_sent'] / 2**20:.1f} MiB sent "
                 f"(all-gather-and-slice would send {c['weight_bytes_allgather'] / 2**20:.1f} MiB)"],
                ["KV (migrate)", c["kv_s"], f"{c['kv_bytes_sent'] / 2**20:.1f} MiB sent, {c['migrated_requests']} requests"],
                ["rebuild + resume", c["rebuild_s"], f"{c['graphs_captured']} CUDA graphs (CPU: none)"],
                ["**switch total**", event.seconds, "driver-side, includes the drain to a step boundary"],
                ["naive: start + load from disk", naive["start_and_load_s"], ""],
                ["naive: re-prefill", naive["reprefill_s"], f"{len(unfinished)} requests"],
                ["naive: shutdown", naive["shutdown_s"], ""],
                ["**naive restart total**", naive["total_s"], ""],
            ]
            ratio = event.seconds / naive["total_s"]
            part1 = (f"TP{args.from_tp}xDP{world // args.from_tp} -> TP{args.to_tp}xDP{world // args.to_tp}, "
                     f"{args.requests} unfinished requests at ~{args.context} tokens of context.\n\n"
                     + markdown_table(["component", "seconds", "detail"], rows)
                     + f"\n\n**Switch / naive restart = {ratio:.1%}** (paper: 9.4%, target < 5%).\n")

            # 2. migrate vs recompute across context lengths
            rows2 = []
            for ctx in args.contexts:
                p = prompts_for(args.requests, ctx, 2 + ctx)
                mig, _, _ = switched_run(engine, p, args.from_tp, args.to_tp, "migrate", 4, 6)
                rec, reprefill, _ = switched_run(engine, p, args.from_tp, args.to_tp, "recompute", 4, 6)
                measured_mig = mig.costs["kv_s"]
                measured_rec = rec.costs["kv_s"] + reprefill
                rows2.append([ctx, measured_mig, measured_rec, "migrate" if measured_mig <= measured_rec else "recompute",
                              mig.costs.get("predicted_migrate_s", float("nan")),
                              mig.costs.get("predicted_recompute_s", float("nan")),
                              "migrate" if mig.costs.get("predicted_migrate_s", 0) <= mig.costs.get("predicted_recompute_s", 0)
                              else "recompute"])
            part2_tail = crossover_summary(rows2)
            part2 = ("KV handling per path (seconds). Measured migrate = the switch's KV phase; measured recompute = "
                     "pool rebuild + the re-prefill steps after the switch. Predicted = Eq. 1-4 with the measured "
                     f"bandwidth ({bw / 1e9:.2f} GB/s one-way per rank) and the engine's measured prefill rates.\n\n"
                     + markdown_table(["context", "migrate (measured)", "recompute (measured)", "faster (measured)",
                                       "migrate (predicted)", "recompute (predicted)", "faster (predicted)"], rows2)
                     + "\n\n" + part2_tail)

            # 3. memory
            part3 = (f"\n\nPeak extra memory during the headline switch: {c['peak_extra_bytes'] / 2**20:.2f} MiB per rank "
                     f"(largest rank) vs a full KV pool of {c['kv_pool_bytes_before'] / 2**20:.0f} MiB per rank "
                     f"({c['peak_extra_bytes'] / c['kv_pool_bytes_before']:.1%}). Pool after the switch: "
                     f"{c['kv_pool_bytes_after'] / 2**20:.0f} MiB per rank (on CPU the per-rank KV budget is fixed in bytes).\n")
        finally:
            engine.shutdown()
    write_result("switch_overhead", "Live switch vs naive restart (CPU, 4 worker processes)", part1 + "\n" + part2 + part3)


if __name__ == "__main__":
    main()
