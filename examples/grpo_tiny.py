"""A real GRPO loop on CPU: a transformers policy trains, pat-engine does the rollouts.

Toy task: every response token earns reward if it lies in a target set (a
quarter of the vocabulary), so the reward of a sample is the fraction of its
tokens in the set; a random policy scores about 0.25. Each iteration:

1. rollout with pat-engine: ``prompts x group`` samples at temperature 1 with
   long-tail lengths (most short, a few long), starting from the base layout
   TP1xDP2 and switching live to TP2xDP1 once the short ones are done;
2. GRPO: group-normalised advantages, clipped importance ratio against the
   rollout's own logprobs, one Adam step on the transformers model (float32);
3. ``engine.update_weights(model.named_parameters())``: the new weights reach
   the engine, or the reward would not rise.

    python examples/grpo_tiny.py                      # under a minute on 2 cores
    python examples/grpo_tiny.py --out bench/results/grpo_tiny.md
    python examples/grpo_tiny.py --tail-batching [--sagc]   # rollouts via pat_engine.rollout

With ``--tail-batching`` / ``--sagc`` the prompts come from a fixed pool whose
prompts keep their length scale across steps and every rollout goes through the rollout
layer (docs/rollout.md); bench/grpo_tail_batching.py compares the policies side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pat_engine import Engine, RequestOutput, SamplingParams, reference_logprobs  # noqa: E402
from pat_engine.platform_info import machine_summary  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402
from pat_engine.rollout import GroupSizingConfig, PromptEntry, RolloutConfig  # noqa: E402
from pat_engine.rollout import RolloutScheduler, TailBatchingConfig, straggler_ratio  # noqa: E402
from pat_engine.rollout.rewards import RewardConfig, RewardStage, SubprocessReward  # noqa: E402
from pat_engine.rollout.runner import RolloutRunner, derived_seed  # noqa: E402


@dataclass(frozen=True)
class GRPOConfig:
    iterations: int = 15
    prompts: int = 8
    group: int = 4  # samples per prompt
    lr: float = 1e-2
    clip: float = 0.2
    min_len: int = 6
    max_len: int = 96
    tail_alpha: float = 1.1  # Pareto shape of the response lengths: smaller = longer tail
    switch_step: int = 16  # decode step at which the rollout merges to TP2
    seed: int = 0
    sync: bool = True  # False: a control run that never pushes weights to the engine
    numerics: str = "fast"  # the engine's numerics; "invariant": reference_logprobs equals the rollout's to the bit


def target_set(vocab_size: int) -> torch.Tensor:
    """Token ids that earn reward: every fourth id past the special tokens."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[8::4] = True
    return mask


def rollout_lengths(cfg: GRPOConfig, rng: random.Random, n: int) -> list[int]:
    return [min(cfg.max_len, cfg.min_len + int(4 * rng.paretovariate(cfg.tail_alpha))) for _ in range(n)]


def make_prompts(cfg: GRPOConfig, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(8, 380) for _ in range(rng.randrange(3, 9))] for _ in range(cfg.prompts)]


def rewards_of(outs: list[RequestOutput], target: torch.Tensor) -> torch.Tensor:
    return torch.tensor([target[torch.tensor(o.token_ids)].float().mean().item() for o in outs])


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def response_logprobs(model, outs: list[RequestOutput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities the policy gives each response token: (B, T) padded, and a (B, T) mask."""
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, W-1, V): position t predicts token t+1
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, W-1)
    resp_len = max(len(o.token_ids) for o in outs)
    out = torch.zeros(len(outs), resp_len)
    mask = torch.zeros(len(outs), resp_len)
    for i, o in enumerate(outs):
        start, n = len(o.prompt_token_ids) - 1, len(o.token_ids)
        out[i, :n] = logp[i, start : start + n]
        mask[i, :n] = 1.0
    return out, mask


def grpo_step(model, optimizer, outs: list[RequestOutput], advantages: torch.Tensor, clip: float) -> float:
    """One clipped policy-gradient step; returns max |trainer logprob - rollout logprob| before it."""
    logp, mask = response_logprobs(model, outs)
    old = torch.zeros_like(logp)
    for i, o in enumerate(outs):
        old[i, : len(o.logprobs)] = torch.tensor(o.logprobs)
    drift = float(((logp.detach() - old).abs() * mask).max())
    ratio = torch.exp(logp - old) * mask
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = -((surrogate * mask).sum(dim=1) / mask.sum(dim=1)).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return drift


def run(cfg: GRPOConfig, workdir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    path = write_tiny_model(workdir / "policy", TinyModelSpec(seed=cfg.seed))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    target = target_set(model.config.vocab_size)
    rng = random.Random(cfg.seed)
    rows = []
    served = path  # a checkpoint of the weights the engine serves, for the trainer-side reference log-probs
    with Engine(str(path), tp=1, dp=2, dtype="float32", numerics=cfg.numerics) as engine:
        for it in range(cfg.iterations):
            prompts = make_prompts(cfg, rng)
            batch = [p for p in prompts for _ in range(cfg.group)]
            lengths = rollout_lengths(cfg, rng, len(batch))
            params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=rng.randrange(1 << 30), logprobs=True,
                                     ignore_eos=True) for n in lengths]
            seen = len(engine.switches)
            t0 = time.perf_counter()
            outs = engine.generate(batch, params, from_base_layout=True, switch_schedule=[(cfg.switch_step, 2)],
                                   use_tqdm=False)
            rollout_s = time.perf_counter() - t0
            switches = [e for e in engine.switches[seen:] if e.reason.startswith("schedule")]
            rewards = rewards_of(outs, target)
            # the trainer's side of the same numbers: one process, the engine's kernels (docs/numerics.md)
            reference = reference_logprobs(str(served), [(o.prompt_token_ids, o.token_ids) for o in outs],
                                           dtype="float32", world=engine.config.world,
                                           max_tp=engine.config.max_tp)
            mismatch = max(abs(a - b) for o, ref in zip(outs, reference) for a, b in zip(o.logprobs, ref))
            t1 = time.perf_counter()
            drift = grpo_step(model, optimizer, outs, group_advantages(rewards, cfg.group), cfg.clip)
            applied = 0
            if cfg.sync:
                applied = engine.update_weights((name, p.detach()) for name, p in model.named_parameters())
                served = workdir / f"policy-{it + 1}"
                model.save_pretrained(served)
            train_s = time.perf_counter() - t1
            rows.append({
                "iteration": it, "mean_reward": rewards.mean().item(), "rollout_s": rollout_s,
                "switches": " ".join(f"{e.from_layout}->{e.to_layout}" for e in switches) or "none",
                "tokens": sum(len(o.token_ids) for o in outs), "max_len": max(lengths),
                "logprob_drift": drift, "reference_mismatch": mismatch, "train_s": train_s, "tensors": applied,
            })
            print(format_row(rows[-1]), flush=True)
    return rows


# ---- rollouts through the rollout layer (tail batching, SAGC; docs/rollout.md) -------------------

POOL = 48  # prompts in the pool the rollout-layer runs draw from
RESPONSES = 32  # returned per step
MIN_LEN, MAX_LEN = 6, 96


def rollout_config(tail_batching: bool, sagc: bool, seed: int) -> RolloutConfig:
    """RESPONSES per step, 4 per prompt; SAGC picks from {2, 4, 8} with kappa 2.0 (1.25 flags nearly every
    group of this heavy-tailed toy)."""
    return RolloutConfig(RESPONSES, 4, tail_batching=TailBatchingConfig(0.25) if tail_batching else None,
                         group_sizing=GroupSizingConfig(sizes=(2, 4, 8), seed=seed, straggler_threshold=2.0)
                         if sagc else None)


@dataclass
class PromptPool:
    """Prompts with a persistent length scale (long-tail prompts stay long); a launch's lengths are a
    function of (prompt, launch, response), so every arm draws the same ones."""

    seed: int
    prompts: list[list[int]] = field(init=False)
    scale: list[float] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.prompts = [[rng.randrange(8, 380) for _ in range(rng.randrange(3, 9))] for _ in range(POOL)]
        self.scale = [min(rng.paretovariate(1.2), 12.0) for _ in range(POOL)]  # persistent per prompt

    def drawer(self):
        order = list(range(POOL))
        pos = [0]

        def draw(n: int) -> list[PromptEntry]:
            out = []
            for _ in range(n):
                epoch, k = divmod(pos[0], POOL)
                if k == 0:
                    random.Random(self.seed * 1000 + epoch).shuffle(order)
                out.append(PromptEntry(order[k], self.prompts[order[k]]))
                pos[0] += 1
            return out

        return draw

    def length(self, uid: int, launch: int, r: int) -> int:
        e = random.Random(derived_seed(self.seed, uid, launch, r)).expovariate(1.0)
        return min(MAX_LEN, MIN_LEN + int(3 * self.scale[uid] * e))


REWARD_MODES = ("in-process", "streamed", "sequential")


def subprocess_reward(work: int) -> SubprocessReward:
    """examples/reward_check.py run once per response, as a code or math verifier runs."""
    return SubprocessReward((sys.executable, str(Path(__file__).with_name("reward_check.py")), "--work", str(work)))


class Arm:
    """One GRPO run whose rollouts go through the rollout layer (``pat_engine.rollout``).

    ``reward_mode``: ``in-process`` scores with the target set here; ``streamed`` runs the verifier
    program on each response as it finishes, while the round still generates (``RewardStage``);
    ``sequential`` runs the same verifier on every response after the rollout, as a loop without a
    reward stage does.
    """

    def __init__(self, label: str, rollout: RolloutConfig, pool: PromptPool, model_dir: Path, seed: int, lr: float,
                 reward_mode: str = "in-process", reward_work: int = 2000, reward_workers: int = 2):
        from transformers import AutoModelForCausalLM

        self.label = label
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.target = target_set(self.model.config.vocab_size)
        self.engine = Engine(str(model_dir), tp=1, dp=2, dtype="float32")
        self.launches: dict[int, int] = {}
        self.pool = pool
        sched = RolloutScheduler(rollout, pool.drawer(), default_length=20)
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {reward_mode!r}")
        self.reward_mode = reward_mode
        self.rewards = (None if reward_mode == "in-process" else
                        RewardStage(subprocess_reward(reward_work), RewardConfig(max_workers=reward_workers)))
        self.runner = RolloutRunner(self.engine, sched, self.params_for, seed=seed, name=label[:1],
                                    stage_options={"switch_schedule": [(16, 2)]},
                                    rewards=self.rewards if reward_mode == "streamed" else None)
        self.rows: list[dict] = []

    def params_for(self, entry: PromptEntry, r: int) -> SamplingParams:
        if r == 0:
            self.launches[entry.uid] = self.launches.get(entry.uid, 0) + 1
        launch = self.launches[entry.uid]
        return SamplingParams(max_new_tokens=self.pool.length(entry.uid, launch, r), temperature=1.0, ignore_eos=True,
                              seed=derived_seed(7, entry.uid, launch, r), logprobs=True)

    def step(self, it: int, clip: float) -> None:
        res = self.runner.step()
        scores, reward_s = self._scores(res)
        outs, advantages, rewards = [], [], []
        for p, (_, group) in enumerate(res.groups):
            r = torch.tensor(scores[p])
            advantages.append((r - r.mean()) / (r.std() + 1e-6))
            rewards.append(r)
            outs += group
        reward = torch.cat(rewards)
        t1 = time.perf_counter()
        grpo_step(self.model, self.opt, outs, torch.cat(advantages), clip)
        self.engine.update_weights((n, p.detach()) for n, p in self.model.named_parameters())
        self.runner.weights_updated()
        s = res.summary
        self.rows.append({"it": it, "reward": reward.mean().item(), "rollout_s": res.seconds, "reward_s": reward_s,
                          "reward_failures": self._failures, "kind": s.kind,
                          "group": s.group_size, "launched": s.responses_launched, "returned": s.responses_returned,
                          "tokens": sum(len(o.token_ids) for o in outs), "longest": max(len(o.token_ids) for o in outs),
                          "stragglers": sum(straggler_ratio([len(o.token_ids) for o in g]) > 1.25 for _, g in res.groups),
                          "groups": len(res.groups), "deferred": s.prompts_deferred,
                          "train_s": time.perf_counter() - t1})
        print(f"{self.label[:40]:40s} it {it:2d} {s.kind:5s} G{s.group_size} reward {reward.mean():.3f} "
              f"rollout {res.seconds:.2f}s longest {self.rows[-1]['longest']}", flush=True)

    def _scores(self, res) -> tuple[list[list[float]], float]:
        """Each returned group's rewards, and the seconds the step spent on rewards after its last
        token (a failed verification scores 0, as a sandbox timeout does)."""
        self._failures = 0
        if self.reward_mode == "in-process":
            return [[self.target[torch.tensor(o.token_ids)].float().mean().item() for o in g] for _, g in res.groups], 0.0
        if self.reward_mode == "streamed":
            results, seconds = res.rewards, res.reward_wait_s
        else:  # every response now, after the rollout
            t = time.perf_counter()
            for p, (_, g) in enumerate(res.groups):
                for r, o in enumerate(g):
                    self.rewards.submit((p, r), o)
            done = {r.key: r for r in self.rewards.drain()}
            results = [[done[(p, r)] for r in range(len(g))] for p, (_, g) in enumerate(res.groups)]
            seconds = time.perf_counter() - t
        self._failures = sum(not r.ok for group in results for r in group)
        return [[r.reward if r.ok else 0.0 for r in group] for group in results], seconds

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        self.engine.shutdown()


HEADER = ("| iter | mean reward | rollout s | switches during rollout | tokens | longest | "
          "max abs(trainer - rollout logprob) | max abs(reference_logprobs - rollout logprob) | train+sync s |")
SEPARATOR = "|---:|---:|---:|---|---:|---:|---:|---:|---:|"


def format_row(r: dict) -> str:
    return (f"| {r['iteration']:>4} | {r['mean_reward']:.3f} | {r['rollout_s']:.2f} | {r['switches']} | "
            f"{r['tokens']} | {r['max_len']} | {r['logprob_drift']:.1e} | {r['reference_mismatch']:.1e} | "
            f"{r['train_s']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=GRPOConfig.iterations)
    ap.add_argument("--seed", type=int, default=GRPOConfig.seed)
    ap.add_argument("--no-sync", action="store_true", help="never call update_weights (the control run)")
    ap.add_argument("--numerics", choices=("fast", "invariant"), default="fast",
                    help="the engine's numerics; invariant: reference_logprobs equals the rollout's to the bit")
    ap.add_argument("--with-control", action="store_true", help="then repeat without update_weights, for contrast")
    ap.add_argument("--out", help="also write the table, command and machine to this markdown file")
    ap.add_argument("--tail-batching", action="store_true", help="rollouts through pat_engine.rollout: tail batching")
    ap.add_argument("--sagc", action="store_true", help="rollouts through pat_engine.rollout: SAGC group sizing")
    args = ap.parse_args()
    if args.tail_batching or args.sagc:  # a prompt pool with persistent lengths, rollout layer
        run_rollout_layer(rollout_config(args.tail_batching, args.sagc, args.seed), args)
        return
    cfg = GRPOConfig(iterations=args.iterations, seed=args.seed, sync=not args.no_sync, numerics=args.numerics)
    rows = table(cfg)
    control = table(dataclasses.replace(cfg, sync=False)) if args.with_control and cfg.sync else None
    if args.out:
        write_report(Path(args.out), rows, cfg, control, " ".join(sys.argv[1:]))


def run_rollout_layer(rollout: RolloutConfig, args) -> None:
    """GRPO with rollouts through the rollout layer (bench/grpo_tail_batching.py compares the policies)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "policy", TinyModelSpec(seed=args.seed))
        arm = Arm("rollout layer", rollout, PromptPool(args.seed), model_dir, args.seed, GRPOConfig.lr)
        try:
            for it in range(args.iterations):
                arm.step(it, GRPOConfig.clip)
        finally:
            arm.close()


def table(cfg: GRPOConfig) -> list[dict]:
    print(f"GRPO, {'weights pushed to the engine after every step' if cfg.sync else 'control: engine never updated'}")
    print(HEADER)
    print(SEPARATOR)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(cfg, Path(tmp))
    print(f"mean reward {rows[0]['mean_reward']:.3f} -> {rows[-1]['mean_reward']:.3f} over {len(rows)} iterations\n")
    return rows


def write_report(path: Path, rows: list[dict], cfg: GRPOConfig, control: list[dict] | None, argv: str) -> None:
    lines = [
        "# GRPO on a tiny model with pat-engine rollouts (CPU)",
        "",
        f"Command: `python examples/grpo_tiny.py {argv}`",
        f"Machine: {machine_summary()}",
        f"Date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{cfg.prompts} prompts x {cfg.group} samples per iteration, temperature 1, response lengths Pareto "
        f"(alpha {cfg.tail_alpha}, {cfg.min_len}..{cfg.max_len} tokens); engine TP1xDP2 at the start of every "
        f"rollout, switching to TP2xDP1 at decode step {cfg.switch_step}. Reward: fraction of response tokens in "
        "a target quarter of the vocabulary (random policy: about 0.25). The logprob column compares the "
        "trainer's log-probabilities of the sampled tokens with those the engine returned: float32 noise only, "
        "so the engine served exactly the weights the trainer had just pushed. The reference column compares "
        "`pat_engine.reference_logprobs` (one process, the engine's kernels) with the rollout's: 0 to the bit "
        f"with `--numerics invariant`, float32 rounding with the default `fast` (this run: {cfg.numerics}). Runs differ a little from one "
        "another: in float32 the batch composition changes the last bits of the logits (pat-engine's token-exact "
        "guarantees are stated in float64).",
        "",
        HEADER,
        SEPARATOR,
        *[format_row(r) for r in rows],
        "",
        f"Mean reward {rows[0]['mean_reward']:.3f} -> {rows[-1]['mean_reward']:.3f}.",
        "",
    ]
    if control is not None:
        rewards = ", ".join(f"{r['mean_reward']:.2f}" for r in control)
        lines += [f"Control, same seed, `update_weights` never called (the engine keeps the initial policy): "
                  f"mean reward per iteration {rewards}.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
