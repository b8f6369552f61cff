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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pat_engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from pat_engine.platform_info import machine_summary  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402


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
    with Engine(str(path), tp=1, dp=2, dtype="float32") as engine:
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
            t1 = time.perf_counter()
            drift = grpo_step(model, optimizer, outs, group_advantages(rewards, cfg.group), cfg.clip)
            applied = 0
            if cfg.sync:
                applied = engine.update_weights((name, p.detach()) for name, p in model.named_parameters())
            train_s = time.perf_counter() - t1
            rows.append({
                "iteration": it, "mean_reward": rewards.mean().item(), "rollout_s": rollout_s,
                "switches": " ".join(f"{e.from_layout}->{e.to_layout}" for e in switches) or "none",
                "tokens": sum(len(o.token_ids) for o in outs), "max_len": max(lengths),
                "logprob_drift": drift, "train_s": train_s, "tensors": applied,
            })
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = ("| iter | mean reward | rollout s | switches during rollout | tokens | longest | "
          "max abs(trainer - rollout logprob) | train+sync s |")
SEPARATOR = "|---:|---:|---:|---|---:|---:|---:|---:|"


def format_row(r: dict) -> str:
    return (f"| {r['iteration']:>4} | {r['mean_reward']:.3f} | {r['rollout_s']:.2f} | {r['switches']} | "
            f"{r['tokens']} | {r['max_len']} | {r['logprob_drift']:.1e} | {r['train_s']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=GRPOConfig.iterations)
    ap.add_argument("--seed", type=int, default=GRPOConfig.seed)
    ap.add_argument("--no-sync", action="store_true", help="never call update_weights (the control run)")
    ap.add_argument("--with-control", action="store_true", help="then repeat without update_weights, for contrast")
    ap.add_argument("--out", help="also write the table, command and machine to this markdown file")
    args = ap.parse_args()
    cfg = GRPOConfig(iterations=args.iterations, seed=args.seed, sync=not args.no_sync)
    rows = table(cfg)
    control = table(dataclasses.replace(cfg, sync=False)) if args.with_control and cfg.sync else None
    if args.out:
        write_report(Path(args.out), rows, cfg, control, " ".join(sys.argv[1:]))


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
        "so the engine served exactly the weights the trainer had just pushed. Runs differ a little from one "
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
