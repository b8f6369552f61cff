"""Speculative decoding on a rollout's tail (issue 24): speculation on vs off, same tokens, how much faster.

1. Model: a tiny Llama learns a synthetic language in the bench: ``--phrases`` fixed phrases of
   6-16 distinct random token ids, concatenated in random order (within a phrase the next token
   is determined, at a boundary any phrase may follow: a toy of text that repeats spans).
   ``--train-steps`` AdamW steps on CPU, seconds to a minute.
2. Workload: GRPO-like rollouts with token-id prompts (30 tokens of the language),
   ``--prompts`` prompts x ``--group`` samples at temperature 1 (seeded), and a greedy one (n=1,
   as many requests); long-tailed response lengths: most short (lognormal, scale ``--short``),
   ``--long`` requests (for the sampled workload: ``--long / --group`` prompts) run to ``--cap``
   tokens; EOS ignored. Each round runs
   ``--rl-steps`` RL steps over the same prompts with fresh seeds (a new prompt set every round),
   so from the second step on the response store (``history``) holds earlier responses.
3. Two engines side by side, world 2 at TP1xDP2, float32, ``numerics="invariant"`` (speculation
   is exact there): speculation off, and on (``max_active`` 8, history on, the n-gram proposer).
   Rounds interleave the arms A, B, B, A, ...; speed-ups are medians over rounds of per-step ratios.

Reported per workload and RL step: the batch phase (from the start until at most ``max_active``
requests are left: speculation is off there, so it must not be slower), the tail phase (from
then until the last request finishes; from the requests' finish times), the whole rollout (wall
clock of ``generate``), the acceptance rate, tokens gained per drafted request, and whether every
token and log-prob equals speculation off.

    PYTHONPATH=.:csrc python bench/spec_tail.py            # a few minutes on 2 quiet cores
    PYTHONPATH=.:csrc python bench/spec_tail.py --quick    # smoke run, results not written
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402

SPEC = TinyModelSpec(arch="llama", vocab_size=390, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                     num_kv_heads=4, max_position=2048, seed=24)
MAX_ACTIVE = 8
ARMS = ("off", "on")


# ---- 1. the model ---------------------------------------------------------------------------------


def make_phrases(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pool = list(range(10, SPEC.vocab_size - 10))
    rng.shuffle(pool)
    phrases = []
    for _ in range(count):
        n = rng.randrange(6, 17)
        phrases.append(pool[:n])
        pool = pool[n:]
    return phrases


def text(phrases: list[list[int]], rng: random.Random, length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += phrases[rng.randrange(len(phrases))]
    return out[:length]


def train(path: Path, phrases: list[list[int]], steps: int) -> tuple[float, float]:
    """Train the checkpoint at ``path`` in place; returns (final loss, seconds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    rng = random.Random(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    start, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        x = torch.tensor([text(phrases, rng, 64) for _ in range(16)])
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        loss = out.loss.item()
        if step % 50 == 0:
            print(f"train step {step}: loss {loss:.3f}", flush=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return loss, time.perf_counter() - start


# ---- 2. the workload ------------------------------------------------------------------------------


def long_tail(n: int, rng: random.Random, short: int, cap: int, long: int) -> list[int]:
    """Response lengths: ``long`` of them ``cap``, the rest short (lognormal), in random order."""
    lengths = [cap] * long + [min(cap // 2, int(short * rng.lognormvariate(0.0, 0.8)) + 4) for _ in range(n - long)]
    rng.shuffle(lengths)
    return lengths


def workload(name: str, phrases, rnd: int, args) -> tuple[list[list[int]], list[int], int, float]:
    """(prompts, lengths, samples per prompt, temperature) of one round."""
    rng = random.Random(1000 + rnd)
    if name == "sampled":
        prompts = [text(phrases, rng, 30) for _ in range(args.prompts)]
        return prompts, long_tail(args.prompts, rng, args.short, args.cap, args.long // args.group), args.group, 1.0
    prompts = [text(phrases, rng, 30) for _ in range(args.prompts * args.group)]
    return prompts, long_tail(len(prompts), rng, args.short, args.cap, args.long), 1, 0.0


def rollout(engine: Engine, prompts, lengths, n: int, temperature: float, seed: int) -> dict:
    params = [SamplingParams(max_new_tokens=m, n=n, temperature=temperature, seed=seed + i, ignore_eos=True,
                             logprobs=True) for i, m in enumerate(lengths)]
    before = engine.speculation_stats()
    start = time.time()
    outs = engine.generate(prompts, params, use_tqdm=False)
    end = time.time()
    samples = [s for o in outs for s in (o.samples or [o])]
    finish = sorted(s.metrics["finish_time"] for s in samples)
    tail_start = finish[-MAX_ACTIVE - 1] if len(finish) > MAX_ACTIVE else start
    return {"seconds": end - start, "tail_s": finish[-1] - tail_start, "head_s": tail_start - start,
            "outputs": [(s.token_ids, s.logprobs) for s in samples],
            "tokens": sum(len(s.token_ids) for s in samples), "stats": _delta(before, engine.speculation_stats())}


def _delta(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    keys = ("verify_steps", "drafted_rows", "drafted_tokens", "accepted_tokens")
    return {k: after[k] - (before or {}).get(k, 0) for k in keys}


# ---- 3. the comparison ----------------------------------------------------------------------------


def compare(args, path: str, phrases) -> list[list]:
    spec = {"max_active": MAX_ACTIVE, "history": True}
    engines = {"off": Engine(path, tp=1, dp=2, dtype="float32", numerics="invariant"),
               "on": Engine(path, tp=1, dp=2, dtype="float32", numerics="invariant", speculative=spec)}
    rows = []
    try:
        for arm in ARMS:  # warm-up: kernels, packs (another prompt set: no history for the rounds)
            prompts, lengths, n, temp = workload("sampled", phrases, -1, args)
            rollout(engines[arm], prompts[:2], [16, 16], n, temp, 1)
        for name in ("sampled", "greedy"):
            runs: dict[tuple[int, int, str], dict] = {}
            for rnd in range(args.rounds):
                prompts, lengths, n, temp = workload(name, phrases, rnd, args)
                for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:  # A, B, B, A, ...: neither always first
                    for step in range(args.rl_steps):
                        r = runs[(rnd, step, arm)] = rollout(engines[arm], prompts, lengths, n, temp, 7919 * rnd + 31 * step)
                        print(f"{name} round {rnd} step {step} {arm}: rollout {r['seconds']:.2f}s tail {r['tail_s']:.2f}s "
                              f"{r['stats'] or ''}", flush=True)
            for step in range(args.rl_steps):
                rows.append(_row(name, step, [(runs[(r, step, "off")], runs[(r, step, "on")]) for r in range(args.rounds)]))
    finally:
        for e in engines.values():
            e.shutdown()
    return rows


def _row(name: str, step: int, pairs: list[tuple[dict, dict]]) -> list:
    med = statistics.median
    identical = all(off["outputs"] == on["outputs"] for off, on in pairs)
    stats = {k: sum(on["stats"][k] for _, on in pairs) for k in pairs[0][1]["stats"]}
    accept = stats["accepted_tokens"] / stats["drafted_tokens"] if stats["drafted_tokens"] else 0.0
    per_row = (stats["accepted_tokens"] + stats["drafted_rows"]) / stats["drafted_rows"] if stats["drafted_rows"] else 1.0
    return [name, step + 1, f"{med(off['head_s'] / max(on['head_s'], 1e-9) for off, on in pairs):.2f}x",
            med(off["tail_s"] for off, _ in pairs), med(on["tail_s"] for _, on in pairs),
            f"{med(off['tail_s'] / on['tail_s'] for off, on in pairs):.2f}x",
            med(off["seconds"] for off, _ in pairs), med(on["seconds"] for _, on in pairs),
            f"{med(off['seconds'] / on['seconds'] for off, on in pairs):.2f}x",
            f"{accept:.0%}", f"{per_row:.2f}", stats["verify_steps"], "yes" if identical else "NO"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phrases", type=int, default=24)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--short", type=int, default=32, help="typical short response length (lognormal scale)")
    ap.add_argument("--cap", type=int, default=384, help="the long responses' length")
    ap.add_argument("--long", type=int, default=8, help="requests of the tail (run to --cap)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rl-steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, nothing written")
    args = ap.parse_args()
    if args.quick:
        args.train_steps, args.rounds, args.rl_steps, args.prompts, args.cap, args.long = 60, 1, 2, 4, 96, 4
    started = time.perf_counter()
    phrases = make_phrases(args.phrases, 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / "phrases", SPEC)
        loss, train_s = train(path, phrases, args.train_steps)
        rows = compare(args, str(path), phrases)
    body = (
        f"Model: Llama h{SPEC.hidden_size} L{SPEC.num_layers} (vocab {SPEC.vocab_size}) trained in the bench for "
        f"{args.train_steps} steps on a language of {args.phrases} phrases (final loss {loss:.3f}, {train_s:.0f} s).\n"
        f"Rollouts: world 2 (CPU worker processes), TP1xDP2, float32, numerics=invariant; sampled: {args.prompts} "
        f"prompts x {args.group} samples, temperature 1, seeded; greedy: {args.prompts * args.group} prompts, n=1; "
        f"lengths: {args.long} requests of {args.cap} tokens, the rest short (lognormal scale {args.short}), EOS ignored. Speculation: max_active "
        f"{MAX_ACTIVE}, history on, n-gram proposer. {args.rounds} rounds, arms interleaved A,B,B,A; "
        f"RL step k reuses the round's prompts with fresh seeds (step 1: no history for them yet).\n\n"
        + markdown_table(["workload", "RL step", "batch phase speed-up", "tail off s", "tail on s", "tail speed-up",
                          "rollout off s",
                          "rollout on s", "rollout speed-up", "acceptance", "tokens per drafted row", "verify steps",
                          "tokens + logprobs identical"], rows)
        + "\n\nBatch phase: from the start to the finish that leaves max_active requests (speculation off in both "
        "arms: the ratio shows its overhead); tail phase: from there to the last finish (medians over rounds; "
        "speed-ups: median of per-round ratios off / on). Acceptance: accepted / drafted tokens; tokens per drafted "
        "row: accepted + 1 per request that had a draft in a verify step.\n\n"
        f"Total time {time.perf_counter() - started:.0f} s. The host is shared by other jobs: rerun on a quiet "
        "machine before quoting the figures.\n"
    )
    if args.quick:
        print(body)
    else:
        write_result("spec_tail", "Speculative decoding on the rollout tail: on vs off", body)


if __name__ == "__main__":
    main()
