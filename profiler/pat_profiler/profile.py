"""Profile a deployment with a real Engine: dummy batches per layout, reshard bandwidth, switch fixed costs.

For each grid point (tp, batch b per DP group, context l): every DP group gets b
prompts of l random token ids at once (so contention between groups is
in the numbers), the prefill is timed, then ``window`` decode steps; the
point keeps the median driver-side decode step latency (dispatch to result,
what the drain time is made of; a median, so a stray slow step does not move
it) and the mean total context of the group's batch over the window. The
engine runs as configured (decode graphs on a GPU, attention "auto"; the
CLI's ``--graph-backend`` / ``--enforce-eager`` pass through). The table is
written after every point, so an interrupted run continues with ``--resume``.
"""

from __future__ import annotations

import datetime
import logging
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from pat_engine import Engine, SamplingParams
from pat_engine.config import EngineConfig
from pat_engine.core.memory import MemoryPlan
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.deployment import engine_deployment, model_shape, reshard_bytes
from pat_engine.predictor.table import ProfilePoint, ProfileTable, SwitchCost, check_deployment
from pat_profiler.draws import DRAWS
from pat_profiler.grid import GridPoint, build_grid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    world: int
    tps: tuple[int, ...] | None  # None: every valid power of two
    dtype: str = "auto"
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    contexts: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    budget_tokens: int = 65536  # per DP group: batch * (context + window) <= budget
    window: int = 60  # decode steps averaged per point (paper: 60)
    passes: int = 1  # measure the grid this many times; the fit averages them
    output: str = "profile.json"
    resume: bool = False
    seed: int = 0
    threads_per_worker: int | None = None
    block_size: int = 16
    switch_repeats: int = 3
    bandwidth_bytes: int = 16 << 20
    engine_kwargs: dict = field(default_factory=dict)
    draw: str = "greedy"  # how decode steps draw (pat_profiler/draws.py): "greedy" or "rl"


def kv_bytes_for(opts: ProfileOptions, tps: list[int], max_batch: int) -> int:
    """Per-rank KV bytes so every layout's group holds the budget (plus one block of rounding per request)."""
    arch = load_model_arch(opts.model)
    dtype = EngineConfig(model=opts.model, dtype=opts.dtype, device=opts.device).torch_dtype()
    tokens = opts.budget_tokens + max_batch * opts.block_size
    plan = MemoryPlan(arch, dtype, opts.block_size, 1, Layout(min(tps), opts.world // min(tps)), device_budget=False)
    per_block = max(plan.block_bytes(Layout(tp, opts.world // tp)) for tp in tps)
    return -(-tokens // opts.block_size) * per_block


def _random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    lo = min(16, vocab - 2)  # keep clear of special ids (pad/bos/eos sit at the bottom in our checkpoints)
    return [[rng.randrange(lo, vocab - 1) for _ in range(length)] for _ in range(n)]


def measure_point(engine: Engine, pt: GridPoint, window: int, rng: random.Random, draw: str = "greedy"
                  ) -> ProfilePoint:
    if engine.layout.tp != pt.tp:
        engine.reconfigure(pt.tp)
    dp = engine.layout.dp
    prompts = _random_prompts(rng, pt.batch * dp, pt.context, engine.arch.vocab_size)
    # 1 token from the prefill, 1 warm-up decode step (it overlaps other groups' prefills), then the window
    how = DRAWS[draw]
    params = SamplingParams(max_new_tokens=window + 2, ignore_eos=True, temperature=how.temperature,
                            logprobs=how.logprobs)
    with engine.record_steps() as steps:
        engine.generate(prompts, params, use_tqdm=False)
    prefill: dict[int, float] = {}
    decode: dict[int, list] = {}
    for s in steps:
        if s.is_prefill:
            prefill[s.group] = prefill.get(s.group, 0.0) + s.seconds
        else:
            decode.setdefault(s.group, []).append(s)
    window_steps = [s for recs in decode.values() for s in recs[1:]]
    secs = [s.seconds for s in window_steps]
    return ProfilePoint(
        tp=pt.tp, batch_size=pt.batch, context_len=pt.context,
        total_tokens=statistics.fmean(s.context_tokens for s in window_steps),
        prefill_s=statistics.fmean(prefill.values()),
        decode_step_s=statistics.median(secs),
        decode_step_std_s=statistics.pstdev(secs) if len(secs) > 1 else 0.0,
        steps=len(secs),
        repeat=pt.repeat,
    )


def measure_switch_costs(engine: Engine, tps: list[int], repeats: int) -> list[SwitchCost]:
    """Idle switches between every ordered pair; fixed = total - weights - KV - graphs (groups are cached
    by now). An idle switch captures no decode graph (no request can run), so one graph's capture time
    is the mean of every capture the run made (start-up, and the first step of each batch size per TP),
    as the workers report it; 0 where graphs are off.

    Weights keep the mean of the repeats, not the best: a merge allocates the larger shards afresh and
    the first touch of that memory varies run to run (on the CPU bench model TP2->TP1 took 2.9-7 s),
    and the controller should weigh the cost it will typically pay."""
    dtype = engine.config.torch_dtype()
    world = engine.config.world
    per_graph = max((s.get("graphs", {}).get("capture_s_per_size", 0.0) for s in engine.worker_stats()), default=0.0)
    out = []
    for a in tps:
        for b in tps:
            if a == b:
                continue
            fixed, weights = [], []
            for _ in range(repeats):
                engine.reconfigure(a)
                ev = engine.reconfigure(b)
                fixed.append(max(ev.seconds - ev.costs["weights_s"] - ev.costs["kv_s"]
                                 - ev.costs.get("graphs_s", 0.0), 0.0))
                weights.append(ev.costs["weights_s"])
            out.append(SwitchCost(a, b, min(fixed), reshard_bytes(engine.arch, dtype, Layout.for_world(world, a),
                                                                  Layout.for_world(world, b)),
                                  statistics.fmean(weights), graphs_s_per_size=per_graph))
    return out


def _warm_up(engine: Engine, rng: random.Random) -> None:
    prompts = _random_prompts(rng, engine.layout.dp, 16, engine.arch.vocab_size)
    engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), use_tqdm=False)


def run_profile(opts: ProfileOptions, command: str = "") -> ProfileTable:
    started = time.perf_counter()
    arch = load_model_arch(opts.model)
    tps = sorted(opts.tps or (layout.tp for layout in arch.valid_layouts(opts.world)))
    max_batch = max(opts.batches)
    engine = Engine(opts.model, tp=tps[0], dp=opts.world // tps[0], dtype=opts.dtype, device=opts.device,
                    kv_cache_bytes=kv_bytes_for(opts, tps, max_batch), threads_per_worker=opts.threads_per_worker,
                    block_size=opts.block_size, **opts.engine_kwargs)
    try:
        deployment = replace(engine_deployment(engine.arch, engine.config), candidate_tps=tuple(tps))
        table = _open_table(opts, deployment, engine)
        capacity = min(engine.memory.tokens_per_group(Layout.for_world(opts.world, tp)) for tp in tps)
        grid = build_grid(tps, list(opts.batches), list(opts.contexts), opts.window,
                          min(opts.budget_tokens, capacity), arch.max_position, engine.config.max_num_seqs,
                          opts.passes)
        todo = [p for p in grid if p.key not in table.done_keys()]
        rng = random.Random(opts.seed)
        warmed: set[int] = set()
        bar = tqdm(todo, desc="pat-profile", unit="pt", dynamic_ncols=True)
        for pt in bar:
            bar.set_postfix_str(f"TP{pt.tp} b={pt.batch} l={pt.context}"
                                + (f" pass {pt.repeat + 1}" if opts.passes > 1 else ""), refresh=False)
            if pt.tp not in warmed:
                if engine.layout.tp != pt.tp:
                    engine.reconfigure(pt.tp)
                _warm_up(engine, rng)
                warmed.add(pt.tp)
            table.add_point(measure_point(engine, pt, opts.window, rng, opts.draw))
            _stamp(table, started, command)
            table.save(opts.output)
        bar.close()
        if table.bandwidth_bytes_per_s is None:
            table.bandwidth_bytes_per_s = engine.measure_bandwidth(opts.bandwidth_bytes)
            _stamp(table, started, command)
            table.save(opts.output)
        if not table.switch_costs and len(tps) > 1:
            table.switch_costs = measure_switch_costs(engine, tps, opts.switch_repeats)
            _stamp(table, started, command)
            table.save(opts.output)
        return table
    finally:
        engine.shutdown()


def _open_table(opts: ProfileOptions, deployment, engine: Engine) -> ProfileTable:
    path = Path(opts.output)
    if path.exists():
        if not opts.resume:
            raise FileExistsError(f"{path} exists; pass --resume to continue it or choose another --output")
        table = ProfileTable.load(path)
        check_deployment(table if table.points else _with_tp(table, engine.base_layout.tp), deployment,
                         engine.base_layout.tp, where=str(path))
        drawn = table.meta.get("draw", "greedy")  # tables from before the option were greedy
        if drawn != opts.draw:
            raise ValueError(f"{path} was profiled with --draw {drawn}; resuming it with --draw {opts.draw} would "
                             "mix two kinds of step in one table")
        table.meta["resumed"] = table.meta.get("resumed", 0) + 1
        table.meta["profile_seconds_before"] = table.meta.get("profile_seconds", 0.0)
        return table
    return ProfileTable(deployment, model_shape(engine.arch, engine.config.torch_dtype()),
                        meta={"created": datetime.datetime.now().isoformat(timespec="seconds"), "profile_seconds": 0.0,
                              "async_scheduling": engine.config.async_scheduling_on(), "draw": opts.draw,
                              "profile_seconds_before": 0.0, "window": opts.window,
                              "budget_tokens": opts.budget_tokens})


def _with_tp(table: ProfileTable, tp: int) -> ProfileTable:
    # an empty table (interrupted before its first point) still gets its deployment checked
    return ProfileTable(table.deployment, table.model, [ProfilePoint(tp, 1, 1, 1.0, 0.0, 0.0)])


def _stamp(table: ProfileTable, started: float, command: str) -> None:
    # seconds of earlier (interrupted) runs + this one
    table.meta["profile_seconds"] = round(table.meta["profile_seconds_before"] + time.perf_counter() - started, 2)
    if command:
        table.meta["command"] = command
