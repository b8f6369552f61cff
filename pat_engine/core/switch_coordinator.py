"""Driver side of a live layout switch (ARCHITECTURE.md sec. 6, steps 1-2 and 5-6).

Pause at a step boundary (drain in-flight steps), check the target, place
every unfinished request in a target DP group balanced by tokens, choose KV
migration or recompute, allocate migrated requests' blocks in the new pools,
have every rank run its SwitchExecutor, then install the new schedulers.

If any rank fails, ``WorkerFailure`` propagates to the engine loop, which
rebuilds a consistent world and recomputes the unfinished requests.
"""

from __future__ import annotations

import time

from pat_engine.core.block_allocator import blocks_needed
from pat_engine.core.policy import SwitchDecision
from pat_engine.core.request import Sequence
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.core.timeline import SwitchEvent
from pat_engine.errors import LayoutError
from pat_engine.parallel.kv_plan import SeqPlacement, plan_kv_moves
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.kv_cost import KVPathEstimate, estimate_kv_paths
from pat_engine.worker.switch_executor import SwitchPlan


def check_target(coord, tp: int) -> Layout:
    """Refuse an invalid target before anything moves."""
    new = Layout.for_world(coord.layout.world, tp)
    try:
        coord.memory.arch.check_tp(tp)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    if coord.memory.num_blocks(new) < 1:
        raise LayoutError(f"{new}: the KV budget holds no block under this layout")
    capacity = coord.memory.tokens_per_group(new)
    bs = coord.config.block_size
    for seq in coord.unfinished():
        need = blocks_needed(len(seq.prompt_ids) + seq.params.max_new_tokens, bs) * bs
        if need > capacity:
            raise LayoutError(
                f"{new}: request {seq.request_id} needs {need} KV slots but a DP group would hold {capacity}"
            )
    return new


def balance(seqs: list[Sequence], groups: int) -> dict[int, int]:
    """seq_id -> target group, longest first onto the least loaded group (by context tokens)."""
    load = [0] * groups
    count = [0] * groups
    out = {}
    for seq in sorted(seqs, key=lambda s: (-s.length, s.seq_id)):
        g = min(range(groups), key=lambda i: (load[i], count[i], i))
        out[seq.seq_id] = g
        load[g] += seq.length
        count[g] += 1
    return out


def _choose_kv_path(coord, decision: SwitchDecision, new: Layout, placements: list[SeqPlacement]) -> tuple[str, KVPathEstimate | None]:
    forced = decision.kv_path or (coord.config.kv_transfer if coord.config.kv_transfer != "auto" else None)
    if not placements:
        return "recompute", None
    arch = coord.memory.arch
    elt = coord.memory.block_bytes(new) // (coord.config.block_size * arch.num_layers * 2 * arch.kv_heads_per_rank(new.tp) * arch.head_dim)
    sent: dict[int, int] = {}
    for m in plan_kv_moves(placements, coord.layout, new, arch.num_kv_heads):
        if m.src != m.dst:
            n = placements[m.seq].num_tokens
            sent[m.src] = sent.get(m.src, 0) + 2 * n * len(m.heads) * arch.head_dim * arch.num_layers * elt
    per_group: list[list[int]] = [[] for _ in range(new.dp)]
    for p in placements:
        per_group[p.dst_group].append(p.num_tokens)
    costs = coord.cost_source
    estimate = estimate_kv_paths(
        max(sent.values(), default=0),
        costs.bandwidth(),
        per_group,
        lambda n, l_rms: costs.prefill_seconds(new.tp, n, l_rms),
    )
    return forced or estimate.path, estimate


def _drain(coord) -> None:
    while coord.inflight:
        for msg in coord.pool.poll(1.0):
            coord._handle(msg)


def run_switch(coord, decision: SwitchDecision) -> SwitchEvent:
    started = time.perf_counter()
    new = check_target(coord, decision.tp)
    _drain(coord)
    old = coord.layout
    if new == old:
        return SwitchEvent(coord.timeline.now(), str(old), str(new), decision.reason, "none", 0.0)
    seqs = sorted((s for sched in coord.schedulers for s in sched.take_all()), key=lambda s: s.seq_id)
    target = balance(seqs, new.dp)
    blocks = coord.memory.num_blocks(new)
    cfg = coord.config
    schedulers = [GroupScheduler(g, blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens) for g in range(new.dp)]

    # Candidate placements for every request with cached KV, blocks taken from the new pools.
    placements: list[SeqPlacement] = []
    for seq in seqs:
        if seq.num_cached == 0:
            continue
        alloc = schedulers[target[seq.seq_id]].allocator
        need = blocks_needed(seq.num_cached, cfg.block_size)
        if not alloc.can_allocate(need):
            continue  # does not fit now: it will be recomputed
        table = tuple(alloc.allocate(need))
        placements.append(SeqPlacement(seq.seq_id, seq.num_cached, seq.group, tuple(seq.block_table),
                                       target[seq.seq_id], table))
    path, estimate = _choose_kv_path(coord, decision, new, placements)
    if path == "recompute":
        placements = []
    plan = SwitchPlan(old, new, blocks, path, tuple(placements),
                      {p.seq_id: coord.seqs[p.seq_id].spec for p in placements})
    results = coord.pool.call("switch", plan=plan)

    moved = {p.seq_id: p for p in placements}
    for seq in seqs:
        sched = schedulers[target[seq.seq_id]]
        p = moved.get(seq.seq_id)
        if p is not None:
            seq.block_table = list(p.dst_table)
            sched.add_running(seq)
        else:
            seq.block_table, seq.blocks_sent, seq.num_cached = [], 0, 0
            sched.add(seq)
    # keep each group's admission order: running first by arrival, waiting by arrival
    for sched in schedulers:
        sched.running.sort(key=lambda s: s.seq_id)
    coord._set_layout(new, schedulers)

    busiest = max(results, key=lambda r: r["total_s"])
    kv_rank = max(results, key=lambda r: r["kv_bytes_sent"])
    if path == "migrate":
        coord.cost_source.record_kv_transfer(kv_rank["kv_bytes_sent"], kv_rank["kv_s"])
    costs = {
        "groups_s": max(r["groups_s"] for r in results),
        "group_cache_hit": all(r["group_cache_hit"] for r in results),
        "weights_s": max(r["weights_s"] for r in results),
        "kv_s": max(r["kv_s"] for r in results),
        "rebuild_s": max(r["rebuild_s"] for r in results),
        "workers_total_s": busiest["total_s"],
        "weight_bytes_sent": sum(r["weight_bytes_sent"] for r in results),
        "weight_bytes_allgather": sum(r["weight_bytes_allgather"] for r in results),
        "kv_bytes_sent": sum(r["kv_bytes_sent"] for r in results),
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in results),
        "kv_pool_bytes_before": results[0]["kv_pool_bytes_before"],
        "kv_pool_bytes_after": results[0]["kv_pool_bytes_after"],
        "graphs_captured": max(r["graphs_captured"] for r in results),
        "migrated_requests": len(placements),
        "requests": len(seqs),
    }
    coord.cost_source.record_weight_reshard(old.tp, new.tp, costs["weights_s"])
    if estimate is not None:
        costs.update(predicted_migrate_s=estimate.migrate_s, predicted_recompute_s=estimate.recompute_s)
    event = SwitchEvent(coord.timeline.now(), str(old), str(new), decision.reason, path,
                        time.perf_counter() - started, costs, dict(decision.details))
    coord.timeline.add_switch(event)
    return event
