"""LayoutSwitch: the driver half of a live layout change (docs/switch.md).

Pause at a step boundary (the coordinator drains in-flight steps), check the
target, place every unfinished request in a target DP group (``switch_placement``:
the installed admission placement's rebalancing, else balanced by context tokens), choose KV migration or recompute, reserve migrated requests'
blocks in the new groups, have every rank run its ``SwitchExecutor``, then
hand the coordinator the new layout and schedulers.

Blocks that requests share (the n samples of a prompt, a cached prefix) move
once per target group and stay shared there, with their prefix-cache entries.
Cached blocks no request uses are not moved: the new groups start without them.
A recompute switch drops every block and the whole cache.

If any rank fails, ``WorkerFailure`` propagates to the engine loop, which
rebuilds a consistent world and recomputes the unfinished requests; the
schedulers built here are dropped with their blocks, so nothing leaks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pat_engine.core.block_pool import blocks_needed
from pat_engine.core.request import Sequence
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.core.timeline import SwitchEvent
from pat_engine.errors import LayoutError
from pat_engine.parallel.dp_placement import switch_placement
from pat_engine.parallel.kv_plan import KVRun, kv_bytes_per_token, plan_kv_moves
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.kv_path_cost import KVPathEstimate, estimate_kv_paths
from pat_engine.predictor.policy import RequestSnapshot, SwitchDecision
from pat_engine.protocol import SeqTable, SwitchPlan, SwitchReport

if TYPE_CHECKING:  # the coordinator owns the switch; only the type is needed here
    from pat_engine.core.coordinator import GlobalCoordinator


class LayoutSwitch:
    """One switch of ``coordinator`` to another TP degree; ``run`` does it and returns its record."""

    def __init__(self, coordinator: GlobalCoordinator) -> None:
        self.coord = coordinator

    def check_target(self, tp: int) -> Layout:
        """Refuse an invalid target before anything moves."""
        coord = self.coord
        memory = coord.memory
        new = memory.arch.layout(coord.layout.world, tp)
        if memory.num_blocks(new) < 1:
            raise LayoutError(f"{new}: the KV budget holds no block under this layout")
        for seq in coord.unfinished():
            if not memory.fits(new, len(seq.prompt_ids), seq.params.max_new_tokens):
                raise LayoutError(
                    f"{new}: request {seq.request_id} needs "
                    f"{memory.slots_needed(len(seq.prompt_ids), seq.params.max_new_tokens)} KV slots "
                    f"but a DP group would hold {memory.tokens_per_group(new)}")
        return new

    def run(self, decision: SwitchDecision) -> SwitchEvent:
        coord = self.coord
        started = time.perf_counter()
        new = self.check_target(decision.tp)
        coord.drain()
        old = coord.layout
        if new == old:
            return SwitchEvent(coord.timeline.now(), str(old), str(new), decision.reason, "none", 0.0)
        seqs = coord.take_unfinished()
        group_of = self._target_groups(seqs, new)
        schedulers = coord.new_schedulers(new)
        placed = _KVPlacement(coord.schedulers, schedulers, coord.config.block_size)
        for seq in seqs:
            placed.place(seq, group_of[seq.seq_id])
        path, estimate = self._choose_kv_path(decision, new, placed.runs, placed.contexts)
        if path == "recompute":  # nothing moves: fresh groups, every request is prefilled again
            schedulers = coord.new_schedulers(new)
            placed = _KVPlacement(coord.schedulers, schedulers, coord.config.block_size)
        tables = tuple(SeqTable(s.seq_id, group_of[s.seq_id], tuple(placed.tables[s.seq_id]), s.spec,
                                tuple(s.tokens[: s.num_cached]) if s.spec.has_penalties else None)
                       for s in seqs if s.seq_id in placed.tables)
        plan = SwitchPlan(old, new, coord.memory.num_blocks(new), path, tuple(placed.runs), tables)
        report = SwitchReport.merge(coord.pool.call("switch", plan=plan))

        for seq in seqs:
            sched = schedulers[group_of[seq.seq_id]]
            table = placed.tables.get(seq.seq_id)
            if table is not None:
                sched.add_running(seq, table)
                seq.blocks_registered = placed.registered.get(seq.seq_id, 0)
            else:
                seq.forget_kv()  # its blocks belonged to the old pools: prefilled again in the new group
                sched.add(seq)
        for sched in schedulers:  # keep each group's admission order: running first by arrival, waiting by arrival
            sched.running.sort(key=lambda s: s.seq_id)
        coord.install_layout(new, schedulers)
        return self._record(decision, old, new, path, estimate, report, len(placed.tables), len(seqs), started)

    def _target_groups(self, seqs: list[Sequence], new: Layout) -> dict[int, int]:
        """seq_id -> new DP group, by ``switch_placement`` with the coordinator's admission placement:
        the same call, on the same object, that the controller prices this switch with."""
        target = switch_placement(self.coord.placement, [RequestSnapshot.of(s) for s in seqs], new.dp)
        return {seqs[i].seq_id: g for g, members in enumerate(target) for i in members}

    def _choose_kv_path(self, decision: SwitchDecision, new: Layout, runs: list[KVRun],
                        contexts: list[tuple[int, int]]) -> tuple[str, KVPathEstimate | None]:
        coord = self.coord
        forced = decision.kv_path or (coord.config.kv_transfer if coord.config.kv_transfer != "auto" else None)
        if not runs:
            return "recompute", None
        arch, itemsize = coord.memory.arch, coord.memory.dtype.itemsize
        sent: dict[int, int] = {}
        for m in plan_kv_moves(runs, coord.layout, new, arch.num_kv_heads):
            if m.src != m.dst:
                per_token = kv_bytes_per_token(arch.num_layers, len(m.heads), arch.head_dim, itemsize, 1)
                sent[m.src] = sent.get(m.src, 0) + runs[m.run].num_tokens * per_token
        per_group: list[list[int]] = [[] for _ in range(new.dp)]
        for dst, tokens in contexts:  # recompute prefills every migrating request's whole context
            per_group[dst].append(tokens)
        costs = coord.cost_source
        estimate = estimate_kv_paths(max(sent.values(), default=0), costs.bandwidth(), per_group,
                                     lambda n, l_rms: costs.prefill_seconds(new.tp, n, l_rms))
        return forced or estimate.path, estimate

    def _record(self, decision: SwitchDecision, old: Layout, new: Layout, path: str,
                estimate: KVPathEstimate | None, report: SwitchReport, migrated: int, requests: int,
                started: float) -> SwitchEvent:
        coord = self.coord
        if path == "migrate":
            coord.cost_source.record_kv_transfer(report.busiest_kv_bytes, report.busiest_kv_s)
        coord.cost_source.record_weight_reshard(old.tp, new.tp, report.weights_s)
        costs = {**report.to_dict(), "migrated_requests": migrated, "requests": requests}
        del costs["rank"]
        if estimate is not None:
            costs.update(predicted_migrate_s=estimate.migrate_s, predicted_recompute_s=estimate.recompute_s)
        event = SwitchEvent(coord.timeline.now(), str(old), str(new), decision.reason, path,
                            time.perf_counter() - started, costs, dict(decision.details))
        coord.timeline.add_switch(event)
        return event


class _KVPlacement:
    """Where each migrating request's KV lands: new blocks for what no earlier request already
    brought to the same target group, shared references for what one did."""

    def __init__(self, old: list[GroupScheduler], new: list[GroupScheduler], block_size: int) -> None:
        self.old, self.new, self.block_size = old, new, block_size
        self.runs: list[KVRun] = []
        self.tables: dict[int, list[int]] = {}  # seq_id -> its table in its new group
        self.registered: dict[int, int] = {}  # seq_id -> leading blocks indexed in the new group's cache
        self.contexts: list[tuple[int, int]] = []  # (new group, cached tokens) of each migrating request
        self._moved: dict[tuple[int, int, int], int] = {}  # (old group, old block, new group) -> new block

    def place(self, seq: Sequence, dst: int) -> None:
        if seq.num_cached == 0:
            return
        src, bs = seq.group, self.block_size
        table = seq.block_table[:blocks_needed(seq.num_cached, bs)]
        shared = 0  # leading blocks an earlier request already brought to ``dst``
        while shared < len(table) and (src, table[shared], dst) in self._moved:
            shared += 1
        pool = self.new[dst].blocks
        own = table[shared:]
        if not pool.can_allocate(len(own)):
            return  # does not fit now: it will be recomputed
        reused = [self._moved[(src, b, dst)] for b in table[:shared]]
        pool.share(reused)
        fresh = pool.allocate(len(own))
        for old_block, new_block in zip(own, fresh):
            self._moved[(src, old_block, dst)] = new_block
            entry = self.old[src].blocks.entry(old_block)
            if entry is not None:
                pool.adopt(new_block, entry)
        if own:
            self.runs.append(KVRun(seq.num_cached - shared * bs, src, tuple(own), dst, tuple(fresh)))
        self.tables[seq.seq_id] = reused + fresh
        self.contexts.append((dst, seq.num_cached))
        self.registered[seq.seq_id] = min(seq.blocks_registered, len(table))
