"""Multi-turn agent rollouts: prefill tokens each turn computes, and turn latency, with and without reuse.

``--conversations`` agent trajectories of ``--turns`` turns run at once on one engine (TP1xDP2 at every
stage start; in the "switching" scenario TP2xDP1 after ``--switch-at`` decode steps, as PAT merges for
the tail; "static" stays at TP1xDP2), each as an agent
loop drives the adapters' frontend (``pat_integrations.frontend.AsyncEngineFrontend``, what veRL's and
OpenRLHF's actors serve with): a turn's prompt is the conversation so far; a turn ends at a stop token
(about one token in ``--stop-every``) or after ``--max-new`` tokens; then a tool answers after
``--tool-s`` seconds with ``--tool-tokens`` tokens. The first prompt is a ``--system-len``-token system
prompt every conversation shares plus a ``--question-len``-token question. Sampling is seeded per
conversation, so every configuration generates the same tokens.

Configurations (interleaved: one run of each scenario and configuration per round, ``--repeats`` rounds;
medians reported):
- reuse: the frontend as the adapters build it: prefix cache on, ``turns.PrefixAffinity`` (a turn goes
  to the DP group holding its conversation) and ``turns.TurnLedger`` (a turn at an idle engine joins
  the stage instead of switching back to the base layout and losing unreferenced cached blocks);
- cache only: prefix cache on, but the engine's own placement (fewest outstanding tokens) and every
  request at an idle engine starting a stage (what the frontend did before);
- no cache: ``enable_prefix_caching=False``;
- reuse, switches keep the cache: reuse, and ``switch_keeps_prefix_cache=True`` (a migrating switch moves
  the cached turns of conversations between turns too, instead of leaving them behind);
- cache only, switches keep the cache: cache only, and ``switch_keeps_prefix_cache=True`` (an idle
  engine's switch back to the base layout keeps the cache when the cost model finds moving it cheaper
  than prefilling it again).

Per turn index: prompt tokens, prefill tokens computed (prompt - cached at admission) and turn latency
(submit to last token, queueing included), summed/averaged over conversations; per run: wall time and
switches (a round's first run may switch back to the base layout the previous run left).

    PYTHONPATH=.:integrations:bench python bench/agent_turns.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model
from pat_integrations.frontend import AsyncEngineFrontend
from pat_integrations.stage import StagePlan

SPEC = TinyModelSpec(arch="llama", vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=4,
                     num_heads=8, num_kv_heads=4, max_position=4096, seed=11)
CONFIGS = ("reuse", "reuse, switches keep the cache", "cache only", "cache only, switches keep the cache", "no cache")


@dataclass
class Run:
    prompt: dict[int, list[int]] = field(default_factory=dict)  # turn -> prompt tokens per conversation
    computed: dict[int, list[int]] = field(default_factory=dict)  # turn -> prefill tokens computed
    latency: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds
    tokens: dict[int, list[int]] = field(default_factory=dict)  # conversation -> its final tokens
    wall: float = 0.0
    switches: int = 0


def frontend_for(config: str, engine: Engine) -> AsyncEngineFrontend:
    frontend = AsyncEngineFrontend(engine)
    if config.startswith("cache only"):  # the frontend without its turn awareness (benchmark-only override)
        engine.set_placement(None)
        frontend.turns.continues = lambda prompt, version: False
    return frontend


async def conversation(frontend: AsyncEngineFrontend, args, rng: random.Random, system: list[int], i: int,
                       run: Run) -> None:
    stops = list(range(7, SPEC.vocab_size - 6, args.stop_every))
    ctx = system + [rng.randrange(10, SPEC.vocab_size - 6) for _ in range(args.question_len)]
    for turn in range(1, args.turns + 1):
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, stop_token_ids=stops,
                                seed=1000 * i + turn)
        t0 = time.perf_counter()
        out = await frontend.generate(ctx, params)
        run.latency.setdefault(turn, []).append(time.perf_counter() - t0)
        run.prompt.setdefault(turn, []).append(len(ctx))
        run.computed.setdefault(turn, []).append(len(ctx) - out.metrics["cached_tokens"])
        ctx = ctx + out.token_ids
        if turn < args.turns:
            await asyncio.sleep(args.tool_s)  # the tool runs; the engine may go idle
            ctx = ctx + [rng.randrange(10, SPEC.vocab_size - 6) for _ in range(args.tool_tokens)]
    run.tokens[i] = ctx


async def one_run(frontend: AsyncEngineFrontend, args) -> Run:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, SPEC.vocab_size - 6) for _ in range(args.system_len)]
    rngs = [random.Random(args.seed * 7919 + i) for i in range(args.conversations)]
    run = Run()
    switches = len(frontend.engine.switches)
    t0 = time.perf_counter()
    await asyncio.gather(*[conversation(frontend, args, rngs[i], system, i, run) for i in range(args.conversations)])
    run.wall = time.perf_counter() - t0
    run.switches = len(frontend.engine.switches) - switches
    return run


def report(runs: dict[tuple[str, str], list[Run]], args) -> str:
    rows, per_run = [], []
    for (scenario, config), these in runs.items():
        for turn in range(1, args.turns + 1):
            prompt = sum(these[0].prompt[turn])  # the same in every run: the same tokens
            computed = statistics.median(sum(r.computed[turn]) for r in these)
            lat = statistics.median(statistics.mean(r.latency[turn]) for r in these)
            rows.append([scenario, config, turn, prompt, computed, f"{1 - computed / prompt:.0%}", round(lat * 1000, 1)])
        totals = [sum(sum(v) for v in r.computed.values()) for r in these]
        per_run.append([scenario, config, "/".join(map(str, totals)), round(statistics.median(r.wall for r in these), 2),
                        "/".join(str(r.switches) for r in these)])
    reference = next(iter(runs.values()))[0].tokens
    differ = sum(r.tokens[i] != reference[i] for these in runs.values() for r in these for i in reference)
    return (
        f"{args.conversations} conversations x {args.turns} turns at once; system prompt {args.system_len} + question "
        f"{args.question_len} tokens; turns end at a stop token (1 in {args.stop_every}) or {args.max_new} tokens; "
        f"tool answers {args.tool_tokens} tokens after {args.tool_s} s. Engine TP1xDP2 at every stage start; "
        f"\"switching\": TP2xDP1 after {args.switch_at} decode steps of each stage (KV migrated). float32, block "
        f"size {args.block_size}, numerics invariant (the same tokens whatever the layout and the cache), "
        f"{args.repeats} interleaved rounds. Conversations whose tokens differ from the first run's: {differ}.\n\n"
        "Per turn (tokens: sums over conversations, computed: median over rounds; latency: mean over conversations, "
        "median over rounds; submit to last token, queueing included):\n\n"
        + markdown_table(["scenario", "config", "turn", "prompt tokens", "prefill computed", "reused",
                          "turn latency ms"], rows)
        + "\n\nPer run:\n\n"
        + markdown_table(["scenario", "config", "prefill tokens computed, each round", "wall s (median)",
                          "switches, each round"], per_run)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--tool-tokens", type=int, default=256)
    ap.add_argument("--tool-s", type=float, default=0.2)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--stop-every", type=int, default=41)
    ap.add_argument("--switch-at", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    path = str(write_tiny_model(tempfile.mkdtemp(prefix="pat_agent_"), SPEC))
    scenarios = {"static": StagePlan(), "switching": StagePlan.from_options([(args.switch_at, 2)], "migrate")}
    runs: dict[tuple[str, str], list[Run]] = {(s, c): [] for s in scenarios for c in CONFIGS}

    async def rounds() -> None:
        engines = {c: Engine(path, tp=1, dp=2, dtype="float32", block_size=args.block_size, numerics="invariant",
                             enable_prefix_caching=c != "no cache", switch_keeps_prefix_cache="keep" in c)
                   for c in CONFIGS}
        try:
            frontends = {c: frontend_for(c, engines[c]) for c in CONFIGS}
            for _ in range(args.repeats):
                for scenario, plan in scenarios.items():
                    for c in CONFIGS:
                        engines[c].flush_cache()
                        frontends[c].turns.reset()
                        frontends[c].plan = plan
                        runs[(scenario, c)].append(await one_run(frontends[c], args))
        finally:
            for e in engines.values():
                e.shutdown()

    asyncio.run(rounds())
    write_result("agent_turns", "Multi-turn agent rollouts: prefill per turn with and without reuse", report(runs, args))


if __name__ == "__main__":
    main()
