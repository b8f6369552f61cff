"""GRPO on CPU with the rollout layer: tail batching + PAT (+ SAGC) vs PAT alone, same seeds, interleaved.

    PYTHONPATH=.:profiler:integrations python bench/grpo_tail_batching.py [--iterations 12]

Three arms train the same tiny policy from the same seed, each with its own engine
(TP1xDP2, float32, a live switch to TP2 at decode step 16 in every round), stepping in
turn (A, B, C, A, B, C, ...) so host noise hits all alike:
  A  plain rounds (8 prompts x 4 responses) -- the example's rollout as it is;
  B  tail batching (eta 0.25): short rounds race 10 x 5, long rounds run the deferred prompts;
  C  B + SAGC (group size from {2, 4, 8}, 32 responses per step).
Prompts come from a fixed pool in which each prompt has a persistent length scale
(long-tail prompts stay long); the response length of a launch is a function of
(prompt, launch, response), the same in every arm. Reward as in examples/grpo_tiny.py.
Writes bench/results/grpo_tail_batching.md.

    PYTHONPATH=.:profiler:integrations python bench/grpo_tail_batching.py --rewards [--iterations 8]

compares the reward stage instead: two arms with tail batching + PAT score every response with
the same verifier program (examples/reward_check.py, a subprocess per response), one streaming
responses to it as they finish (``RewardStage`` in the runner), one scoring all of them after the
rollout; step time = rollout + the reward time left after the last token. Writes
bench/results/grpo_reward_stage.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from common import markdown_table, write_result  # noqa: E402
from grpo_tiny import RESPONSES, Arm, PromptPool, rollout_config  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402

def run_in_turn(args, make_arms) -> list[Arm]:
    """The arms ``make_arms(model_dir)`` builds, on one tiny policy, stepping in turn (A, B, A, B, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "policy", TinyModelSpec(seed=args.seed))
        arms = make_arms(model_dir)
        try:
            for it in range(args.iterations):
                for arm in arms:
                    arm.step(it, 0.2)
        finally:
            for arm in arms:
                arm.close()
    return arms


def reward_stage(args) -> None:
    """Streamed against sequential rewards, the same verifier, arms stepping in turn."""
    pool = PromptPool(args.seed)
    cfg = rollout_config(True, False, args.seed)
    arms = run_in_turn(args, lambda model_dir: [
        Arm(f"{mode} rewards", cfg, pool, model_dir, args.seed, args.lr, reward_mode=mode,
            reward_work=args.reward_work, reward_workers=args.reward_workers) for mode in ("streamed", "sequential")])
    rows = []
    base = statistics.fmean(r["rollout_s"] + r["reward_s"] for r in arms[1].rows)
    for arm in arms:
        step = [r["rollout_s"] + r["reward_s"] for r in arm.rows]
        rows.append([arm.label, f"{statistics.fmean(r['rollout_s'] for r in arm.rows):.2f}",
                     f"{statistics.fmean(r['reward_s'] for r in arm.rows):.2f}", f"{statistics.fmean(step):.2f}",
                     f"{base / statistics.fmean(step):.2f}x", sum(r["reward_failures"] for r in arm.rows),
                     f"{arm.rows[0]['reward']:.3f} -> {arm.rows[-1]['reward']:.3f}"])
    per_iter = markdown_table(["iter"] + [a.label for a in arms],
                              [[k] + [f"{a.rows[k]['rollout_s']:.2f} + {a.rows[k]['reward_s']:.2f} s "
                                      f"({a.rows[k]['kind'][0]})" for a in arms] for k in range(args.iterations)])
    body = ("Measured on this host (2 cores shared by the engine's workers and the verifier processes; noisy). "
            "Both arms: tail batching + PAT (TP1xDP2, a switch to TP2 at decode step 16), the same prompts and "
            f"seeds, stepping in turn. Verifier: examples/reward_check.py --work {args.reward_work}, one subprocess "
            f"per response, {args.reward_workers} at a time, RollPacker's adaptive timeout (t_max 30 s). "
            "`reward s`: what the step still spent on rewards after its last token.\n\n"
            + markdown_table(["arm", "rollout s (mean)", "reward s after the rollout (mean)", "step s (mean)",
                              "speed-up vs sequential", "reward failures", "mean reward first -> last"], rows)
            + "\n\nPer iteration: rollout + reward seconds (round kind)\n\n" + per_iter)
    write_result("grpo_reward_stage", "GRPO (tiny, CPU): rewards streamed during the rollout vs after it", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--rewards", action="store_true", help="compare streamed and sequential rewards instead")
    ap.add_argument("--reward-work", type=int, default=2000, help="verifier work per response token")
    ap.add_argument("--reward-workers", type=int, default=2)
    args = ap.parse_args()
    if args.rewards:
        reward_stage(args)
        return
    pool = PromptPool(args.seed)
    arms_cfg = [
        ("A: PAT alone (plain rounds, 8 x 4)", rollout_config(False, False, args.seed)),
        ("B: tail batching + PAT", rollout_config(True, False, args.seed)),
        ("C: tail batching + PAT + SAGC", rollout_config(True, True, args.seed)),
    ]
    arms = run_in_turn(args, lambda model_dir: [Arm(label, cfg, pool, model_dir, args.seed, args.lr)
                                                for label, cfg in arms_cfg])
    base = statistics.fmean(r["rollout_s"] for r in arms[0].rows)
    summary = []
    for arm in arms:
        rows = arm.rows
        half = len(rows) // 2
        summary.append([arm.label, statistics.fmean(r["rollout_s"] for r in rows),
                        f"{base / statistics.fmean(r['rollout_s'] for r in rows):.2f}x",
                        rows[0]["reward"], statistics.fmean(r["reward"] for r in rows[half:]), rows[-1]["reward"],
                        f"{sum(r['kind'] == 'long' for r in rows)}/{len(rows)}",
                        f"{100 * sum(r['launched'] - r['returned'] for r in rows) / sum(r['launched'] for r in rows):.0f}%",
                        f"{100 * sum(r['stragglers'] for r in rows) / sum(r['groups'] for r in rows):.0f}%",
                        "/".join(str(g) for g in sorted({r['group'] for r in rows}))])
    per_iter = markdown_table(["iter"] + [a.label for a in arms],
                              [[k] + [f"{a.rows[k]['reward']:.3f} / {a.rows[k]['rollout_s']:.2f}s "
                                      f"({a.rows[k]['kind'][0]}, G{a.rows[k]['group']}, longest {a.rows[k]['longest']})"
                                      for a in arms] for k in range(args.iterations)])
    body = ("Measured on this host (CPU worker processes; shared, noisy machine): the three arms step in turn "
            "(A, B, C, A, B, C, ...), each with its own engine; every rollout starts at TP1xDP2 and switches to "
            f"TP2xDP1 at decode step 16 (PAT by schedule). {RESPONSES} responses returned per step in every arm; "
            "tail-batching arms launch more in short rounds and return only the first finished. SAGC here uses "
            "kappa = 2.0 (the paper's 1.25 flags nearly every group of this heavy-tailed toy). Weights pushed "
            "after every step, so deferred partials are always stale and regenerated (staleness 0).\n\n"
            + markdown_table(["arm", "rollout s/step (mean)", "speed-up vs A", "reward it 0",
                              "reward, mean of 2nd half", "reward last", "long rounds", "responses discarded",
                              "straggler rate (max/median > 1.25)", "group sizes"], summary)
            + "\n\nPer iteration: mean reward / rollout seconds (round kind, group size, longest response)\n\n"
            + per_iter)
    write_result("grpo_tail_batching", "GRPO (tiny, CPU): tail batching + PAT (+ SAGC) vs PAT alone", body)


if __name__ == "__main__":
    main()
