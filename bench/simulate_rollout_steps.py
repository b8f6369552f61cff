"""Simulated multi-step rollouts: best static layout vs PAT vs tail batching (+PAT, +SAGC).

    PYTHONPATH=.:profiler python bench/simulate_rollout_steps.py [--tables a40 h100] [--steps 50]
        [--responses 256] [--check-interval 512]

Every figure is SIMULATED (bench/longtail/multistep.py replaying each round on a latency
table; bench/longtail/tables.py states every constant); none is a measurement. Per table:
  - best static layout (the veRL baseline): every TP run static, the best total kept;
  - PAT alone: plain rounds from the throughput layout, the switch controller inside;
  - tail batching with RollPacker's two static TPs: short rounds at one TP, long rounds at
    another, each the best for its round kind (picked from uniform-TP tail-batching runs);
  - tail batching + PAT: short rounds start at the throughput layout, long rounds at the
    predictor's pick, the controller switching inside both;
  - + SAGC (group size from {4, 8, 16}, responses per step fixed);
Writes bench/results/simulate_rollout_steps.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import markdown_table, write_result
from longtail.multistep import PromptDataset, RunResult, Variant, run_variant
from longtail.tables import a40_table, h100_table
from longtail.workload import LongTail
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.rollout import GroupSizingConfig, RolloutConfig, TailBatchingConfig

TABLES = {
    "a40": (a40_table, 16384, "8xA40 paper-calibrated (Llama-3.1-8B, TP 2/4/8), cap 16K"),
    "h100": (lambda: h100_table(True), 24576, "8xH100 analytic + per-replica batch overheads (TP 1/2/4/8), cap 24K"),
}
ROLLPACKER_FIG = ("RollPacker (Qwen3-8B, 32K, 8 H800 GPUs; its Fig. 7b, cited in issue 15 as Fig. 6): short rounds "
                  "TP1 1029 s / TP2 768 s, long rounds TP1 1172 s / TP2 1284 s (short/long: TP1 0.88, TP2 0.60); "
                  "end to end 2.03-2.56x over veRL, which includes reward scheduling and stream training overlap "
                  "that this simulation does not model (rollout time only).")


def mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def kind_mean(run: RunResult, kind: str) -> float:
    return mean(s.seconds for s in run.steps if s.kind == kind)


def row(run: RunResult, baseline: float) -> list:
    st = run.steps
    launched = sum(s.launched for s in st)
    returned = sum(s.returned for s in st)
    sizes = sorted({s.group_size for s in st})
    return [run.variant.label, run.total, f"{baseline / run.total:.2f}x", mean(s.seconds for s in st),
            kind_mean(run, "short") if any(s.kind == "short" for s in st) else "-",
            kind_mean(run, "long") if any(s.kind == "long" for s in st) else "-",
            f"{sum(s.kind == 'long' for s in st)}/{len(st)}",
            f"{100 * sum(s.prompts_deferred for s in st) / sum(s.prompts_launched for s in st):.1f}%",
            f"{100 * (launched - returned) / launched:.1f}%",
            f"{100 * sum(s.stragglers for s in st) / sum(s.groups for s in st):.1f}%",
            max(s.max_age for s in st), sum(s.switches for s in st), "/".join(map(str, sizes))]


def run_table(name: str, args) -> tuple[str, dict]:
    make, cap, desc = TABLES[name]
    table = make()
    pred = LatencyPredictor(table, max_num_seqs=args.max_num_seqs)
    world = table.deployment.world
    dist = LongTail.fit(prompt_corr=0.6)
    data = PromptDataset(args.dataset, dist, cap, (100, 400), seed=args.seed)
    n = args.responses
    plain = RolloutConfig(n, 8)
    tb = RolloutConfig(n, 8, tail_batching=TailBatchingConfig(eta=args.eta))
    sagc = RolloutConfig(n, 8, tail_batching=TailBatchingConfig(eta=args.eta),
                         group_sizing=GroupSizingConfig(sizes=(4, 8, 16), seed=args.seed))

    def go(v: Variant) -> RunResult:
        t = time.perf_counter()
        r = run_variant(v, data, pred, world, args.steps, args.max_num_seqs, args.check_interval, draws=args.draws)
        print(f"  {name}: {v.label}: {r.total:.0f} s simulated ({time.perf_counter() - t:.0f} s wall)", flush=True)
        return r

    statics = {tp: go(Variant(f"static TP{tp}", plain, short_tp=tp)) for tp in pred.tps}
    best_tp = min(statics, key=lambda tp: statics[tp].total)
    tb_uniform = {tp: go(Variant(f"tail batching, TP{tp} for both", tb, short_tp=tp, long_tp=tp)) for tp in pred.tps}
    short_tp = min(pred.tps, key=lambda tp: kind_mean(tb_uniform[tp], "short"))
    long_tp = min(pred.tps, key=lambda tp: kind_mean(tb_uniform[tp], "long"))
    runs = [statics[best_tp]]
    runs[0].variant = Variant(f"best static (TP{best_tp}; veRL baseline)", plain, short_tp=best_tp)
    runs.append(go(Variant("PAT alone", plain, pat=True)))
    runs.append(tb_uniform[short_tp] if short_tp == long_tp else
                go(Variant(f"tail batching, static TP{short_tp} short / TP{long_tp} long (RollPacker)", tb,
                           short_tp=short_tp, long_tp=long_tp)))
    if short_tp == long_tp:
        runs[-1].variant = Variant(f"tail batching, static TP{short_tp} short / TP{long_tp} long (RollPacker)", tb)
    runs.append(go(Variant("tail batching + PAT", tb, pat=True)))
    runs.append(go(Variant("tail batching + PAT + SAGC", sagc, pat=True)))
    base = runs[0].total
    headers = ["policy (simulated)", f"rollout s, {args.steps} steps", "speed-up vs best static", "mean s/step",
               "short round s", "long round s", "long rounds", "prompts deferred", "responses discarded",
               "straggler rate", "staleness (steps)", "switches", "group sizes"]
    main = markdown_table(headers, [row(r, base) for r in runs])
    anchor = markdown_table(["TP (both rounds)", "short round s (mean)", "long round s (mean)", "short / long"],
                            [[f"TP{tp}", kind_mean(r, "short"), kind_mean(r, "long"),
                              f"{kind_mean(r, 'short') / kind_mean(r, 'long'):.2f}"] for tp, r in tb_uniform.items()])
    static_line = ", ".join(f"TP{tp} {r.total:.0f} s" for tp, r in statics.items())
    per_step = markdown_table(["step"] + [r.variant.label for r in runs],
                              [[k] + [f"{r.steps[k].seconds:.0f} ({r.steps[k].kind[0]}, TP{r.steps[k].tp}"
                                      f"{', G' + str(r.steps[k].group_size) if r.steps[k].group_size != 8 else ''})"
                                      for r in runs] for k in range(args.steps)])
    text = (f"### {name}: {desc}\n\n- table: {table.meta.get('source', table.deployment.device)}\n"
            f"- workload: {args.dataset} prompts (100-400 tokens), {n} responses per step (8 per prompt unless SAGC "
            f"picks), lengths {dist.describe()} (the prompt's part persists across steps); eta {args.eta}; controller checks every {args.check_interval} decode steps, "
            f"{args.draws} length draws; seed {args.seed}\n- static layouts: {static_line}\n"
            f"- RollPacker's TP pair picked from uniform-TP tail-batching runs: short TP{short_tp}, long TP{long_tp}\n\n"
            + main + "\n\nTail batching with one static TP for both round kinds (the shape of RollPacker's Fig. 7b):\n\n"
            + anchor + "\n\n<details><summary>per-step rollout seconds (kind s/l/p, starting TP, group size "
                       "when not 8)</summary>\n\n" + per_step + "\n\n</details>\n")
    return text, {r.variant.label: r.total for r in runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", nargs="+", default=["a40", "h100"], choices=sorted(TABLES))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--responses", type=int, default=256, help="responses per step (fixed, also under SAGC)")
    p.add_argument("--dataset", type=int, default=1024, help="prompts in the dataset")
    p.add_argument("--eta", type=float, default=0.25)
    p.add_argument("--check-interval", type=int, default=512)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sections = []
    for name in args.tables:
        print(f"{name}: {TABLES[name][2]}", flush=True)
        text, _ = run_table(name, args)
        sections.append(text)
    write_result("simulate_rollout_steps", "Multi-step rollout scheduling (SIMULATED): tail batching, PAT, SAGC",
                 "All times are simulated rollout seconds from latency tables, not measurements. Speed-up = best "
                 "static total / policy total. Staleness = the largest number of weight updates between the "
                 "weights a returned response was generated under and the step's weights (deferred partials are "
                 "regenerated from the prompt, so 0). Straggler rate = returned groups whose max/median length "
                 "exceeds 1.25 (SAGC's definition).\n\nAnchors: " + ROLLPACKER_FIG + "\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
