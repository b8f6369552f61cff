"""Rewards that wait, scored while the rollout still generates (the reward stage) vs scored after it.

    PYTHONPATH=.:profiler:integrations:bench python bench/reward_overlap.py [--reps 5]

RollPacker's reward scheduler overlaps scoring with generation: each response goes to a bounded pool
of verifiers the moment it finishes, so a step costs max(generation, last reward) rather than their
sum. That pays when scoring *waits* (a sandbox running tests, a remote reward model), which is what
this measures: every answer waits 0.5-3 s to be scored (a function of its tokens, so both arms wait
the same per answer) and uses no CPU while it waits, in the contract's two forms: ``command``
(bench/sleep_verifier.sh, a process per answer as a sandbox runs; its start costs about a millisecond
of the CPU the engine shares) and ``remote`` (bench/remote_judge.py, an async function awaiting its
sleep, as a call to a remote reward model does).

Workload: the built-in tiny Llama, TP1xDP2 on two CPU worker processes, float32, prefix caching off
(every run does the same work); one rollout step of 12 prompts x 4 responses at temperature 1, fixed
seeds, lengths long-tailed as the demo's (80% short, 15% medium, 5% at --tail tokens; ignore_eos).
Verifier pool: --workers at once, a fixed 30 s limit (RollPacker's adaptive limit would cut correct
answers that merely wait longer than 1.5x the fastest of their prompt).

Two faces, each measured streamed vs after, interleaved (A, B, A, B; the first of each pair swapped
every repetition), one engine for all:
- ``runner``: ``RolloutRunner(..., rewards=stage)`` (the Python API; the adapters' ``rollout_step``
  runs this code) vs ``RolloutRunner`` then every returned response scored by the same stage;
- ``batch``: ``pat-serve batch --reward`` (``run_batch`` in this process) vs the job without a reward
  and its result lines scored afterwards.
Step = rollout + the reward time left after the last token. Writes bench/results/reward_overlap.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.outputs import RequestOutput
from pat_engine.rollout.config import RolloutConfig
from pat_engine.rollout.reward_fns import SubprocessReward, reward_from_spec
from pat_engine.rollout.rewards import RewardConfig, RewardStage
from pat_engine.rollout.runner import RolloutRunner
from pat_engine.rollout.scheduler import RolloutScheduler
from pat_engine.rollout.tail_batching import PromptEntry
from pat_engine.serve.batch.job import BatchJob, run_batch
from pat_engine.serve.batch.scoring import BatchReward
from pat_engine.serve.demo import long_tail_lengths
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

HERE = Path(__file__).resolve().parent
PROMPTS, GROUP = 12, 4
GOAL = 0.20  # step time at least 20% lower than scoring afterwards (issue 34)


@dataclass
class Row:
    face: str
    verifier: str
    arm: str  # "streamed" or "after"
    rep: int
    rollout_s: float  # first request submitted -> last token
    reward_after_s: float  # reward time left after the last token
    failures: int

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.reward_after_s


def verifier(kind: str):
    if kind == "command":
        return SubprocessReward((str(HERE / "sleep_verifier.sh"),))
    return reward_from_spec("remote_judge:judge")


def prompts(seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(8, 24))] for _ in range(PROMPTS)]


class RunnerFace:
    """One plain rollout step through the rollout layer, the same prompts and seeds every time."""

    def __init__(self, engine: Engine, lengths: list[int], seed: int):
        self.engine, self.lengths, self.seed = engine, lengths, seed
        self.prompt_ids = prompts(seed)

    def step(self, stage: RewardStage, streamed: bool) -> tuple[float, float, int]:
        sched = RolloutScheduler(RolloutConfig(responses_per_step=PROMPTS * GROUP, group_size=GROUP),
                                 lambda n: [PromptEntry(u, self.prompt_ids[u]) for u in range(n)], default_length=64)
        runner = RolloutRunner(self.engine, sched, self.params_for, rewards=stage if streamed else None)
        res = runner.step()
        if streamed:
            results = [r for g in res.rewards for r in g]
            return res.seconds, res.reward_wait_s, sum(not r.ok for r in results)
        t = time.perf_counter()
        for g, (entry, outs) in enumerate(res.groups):
            for r, out in enumerate(outs):
                stage.submit((g, r), out, task=entry.uid)
        results = stage.drain()
        return res.seconds, time.perf_counter() - t, sum(not r.ok for r in results)

    def params_for(self, entry: PromptEntry, r: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.lengths[entry.uid * GROUP + r], ignore_eos=True, temperature=1.0,
                              seed=self.seed * 1000 + entry.uid * GROUP + r)


class BatchFace:
    """``pat-serve batch`` over a file of 48 lines, with ``--reward`` or scored from its output afterwards."""

    def __init__(self, engine: Engine, lengths: list[int], seed: int, tmp: Path):
        self.engine, self.tmp = engine, tmp
        self.input = tmp / "lines.jsonl"
        ids = prompts(seed)
        self.input.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": ids[i // GROUP], "max_tokens": n,
                                                  "ignore_eos": True, "temperature": 1.0, "seed": seed * 1000 + i})
                                      + "\n" for i, n in enumerate(lengths)))

    def step(self, stage: RewardStage, streamed: bool) -> tuple[float, float, int]:
        out = self.tmp / "results.jsonl"
        reward = BatchReward(stage.fn, stage.config) if streamed else None
        summary = run_batch(self.engine, BatchJob(self.input, out, "tiny", progress=False, overwrite=True,
                                                  reward=reward))
        if streamed:
            return summary.wall_s - summary.rewards.wait_s, summary.rewards.wait_s, summary.rewards.failed
        t = time.perf_counter()
        for rec in map(json.loads, out.read_text().splitlines()):
            stage.submit(rec["id"], RequestOutput(rec["id"], [], rec["token_ids"], rec["text"], rec["finish_reason"]))
        results = stage.drain()
        return summary.wall_s, time.perf_counter() - t, sum(not r.ok for r in results)


def measure(args) -> list[Row]:
    lengths = long_tail_lengths(PROMPTS * GROUP, args.seed, args.tail)
    config = RewardConfig(max_workers=args.workers, timeout_s=30.0)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", TinyModelSpec(seed=args.seed, max_position=4096))
        with Engine(str(model), tp=1, dp=2, dtype="float32", enable_prefix_caching=False) as engine:
            faces = {"runner": RunnerFace(engine, lengths, args.seed),
                     "batch": BatchFace(engine, lengths, args.seed, Path(tmp))}
            faces["runner"].step(RewardStage(verifier("remote"), config), False)  # warm-up, not counted
            for rep in range(args.reps):
                for face in args.faces:
                    for kind in args.verifiers:
                        arms = ("streamed", "after") if rep % 2 == 0 else ("after", "streamed")
                        for arm in arms:
                            with RewardStage(verifier(kind), config) as stage:
                                rollout, after, failed = faces[face].step(stage, arm == "streamed")
                            rows.append(Row(face, kind, arm, rep, rollout, after, failed))
                            print(f"rep {rep} {face:6s} {kind:7s} {arm:8s} rollout {rollout:5.2f} s + rewards after "
                                  f"{after:5.2f} s = {rollout + after:5.2f} s ({failed} failed)", flush=True)
    return rows


def report(args, rows: list[Row], load: tuple[float, float]) -> None:
    summary, per_rep, verdicts = [], [], []
    for face in args.faces:
        for kind in args.verifiers:
            mine = {arm: [r for r in rows if (r.face, r.verifier, r.arm) == (face, kind, arm)]
                    for arm in ("streamed", "after")}
            mean = {arm: {k: statistics.fmean(getattr(r, k) for r in rs) for k in ("rollout_s", "reward_after_s",
                                                                                    "step_s")}
                    for arm, rs in mine.items()}
            ratios = [s.step_s / a.step_s for s, a in zip(mine["streamed"], mine["after"])]
            cut = 1 - mean["streamed"]["step_s"] / mean["after"]["step_s"]
            # the host's load moves the rollouts of the two arms apart by chance: the same cut with both arms
            # given the rollout mean of all their runs, so that only the reward time differs
            rollout = statistics.fmean(r.rollout_s for rs in mine.values() for r in rs)
            same = 1 - (rollout + mean["streamed"]["reward_after_s"]) / (rollout + mean["after"]["reward_after_s"])
            verdicts.append(f"{face} / {kind}: step time {cut:.0%} lower, {same:.0%} with equal rollouts "
                            f"({'met' if min(cut, same) >= GOAL else 'NOT met'})")
            for arm, m in mean.items():
                summary.append([face, kind, arm, f"{m['rollout_s']:.2f}", f"{m['reward_after_s']:.2f}",
                                f"{m['step_s']:.2f}", f"{m['step_s'] / mean['after']['step_s']:.2f}x",
                                sum(r.failures for r in mine[arm])])
            summary.append([face, kind, "per-rep streamed/after", "", "", "",
                            f"{min(ratios):.2f}-{max(ratios):.2f}x", ""])
            for s, a in zip(mine["streamed"], mine["after"]):
                per_rep.append([face, kind, s.rep, f"{s.rollout_s:.2f} + {s.reward_after_s:.2f} = {s.step_s:.2f}",
                                f"{a.rollout_s:.2f} + {a.reward_after_s:.2f} = {a.step_s:.2f}",
                                f"{s.step_s / a.step_s:.2f}x"])
    def span(values) -> str:
        return f"{min(values):.2f}-{max(values):.2f} s"

    noise = (f"This host is shared (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end): "
             f"the rollout's time moves with that load ({span([r.rollout_s for r in rows])} over all runs); the "
             f"reward time after the last token is waiting (streamed "
             f"{span([r.reward_after_s for r in rows if r.arm == 'streamed'])}, after "
             f"{span([r.reward_after_s for r in rows if r.arm == 'after'])}).")
    body = (
        f"Workload: the built-in tiny Llama (TinyModelSpec(seed={args.seed}, max_position=4096)), TP1xDP2 on 2 CPU worker processes, "
        f"float32, prefix caching off; one step = {PROMPTS} prompts x {GROUP} responses at temperature 1, fixed seeds, "
        f"long-tailed lengths (`long_tail_lengths(48, {args.seed}, {args.tail})`: 80% short, 15% medium, 5% near "
        f"{args.tail} tokens). Every answer is scored by a verifier that waits 0.5-3 s (a function "
        f"of its tokens: the same answer waits the same in both arms) and prints a reward: `command` = "
        f"`bench/sleep_verifier.sh`, a process per answer (a sandbox), `remote` = `bench/remote_judge.py`, an async "
        f"function awaiting its sleep (a remote reward model). "
        f"{args.workers} verifiers at once, fixed 30 s limit. Arms interleaved (streamed/after, the first swapped "
        f"each repetition), one engine; {args.reps} repetitions. `rollout`: first request to last token; `reward "
        f"after`: what the step still spent on rewards after its last token; step = their sum.\n\n"
        f"**Goal (step time at least {GOAL:.0%} lower than scoring afterwards; met when both the measured cut and "
        f"the cut with each arm given the mean rollout of both reach it):** " + "; ".join(verdicts) + ".\n\n"
        + noise + "\n\n"
        + markdown_table(["face", "verifier", "arm", "rollout s (mean)", "reward after the last token s (mean)",
                          "step s (mean)", "step vs after", "reward failures"], summary)
        + "\n\nPer repetition: rollout + reward after = step seconds\n\n"
        + markdown_table(["face", "verifier", "rep", "streamed", "after", "streamed / after"], per_rep))
    write_result("reward_overlap", "Rewards that wait: scored while the rollout generates vs after it", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--faces", nargs="+", default=["runner", "batch"], choices=["runner", "batch"])
    ap.add_argument("--verifiers", nargs="+", default=["command", "remote"], choices=["command", "remote"])
    ap.add_argument("--workers", type=int, default=16, help="verifiers running at once")
    ap.add_argument("--tail", type=int, default=1600, help="length of the longest answers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = os.getloadavg()[0]
    rows = measure(args)
    report(args, rows, (start, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
