"""The switch planner: what a live layout change will do, decided without doing any of it.

``check_target`` refuses an invalid target before anything moves. ``plan_switch``
places every unfinished request in a target DP group (``switch_placement``: the
installed admission placement's rebalancing, else balanced by context tokens),
reserves migrated requests' blocks in fresh schedulers for the new layout,
and chooses KV migration or recompute with the cost source. It returns a
``PlannedSwitch``: the ``SwitchPlan`` the workers run, the new schedulers and the
estimate. The driver does the rest (``Switching.switch``): drain,
take the requests, call the workers, seat the requests, install the layout.

Blocks that requests share (the n samples of a prompt, a cached prefix) move
once per target group and stay shared there, with their prefix-cache entries.
Cached blocks no request uses are not moved by default: the new groups start without them. With
``keep_cache`` (``EngineConfig.switch_keeps_prefix_cache``) a migrating switch also moves them, most
recently used first, into blocks their target group has unused after the requests' (each old group's
into the new group that holds its first rank), where they are cached again: what multi-turn rollouts
want, whose next turns extend prefixes no request holds during the switch. Not free: their bytes join
the switch's KV phase, and when requests hold KV the cost model chooses the KV path by the requests alone
(the cached blocks follow it). When none does (a switch between turns or rounds), the cached blocks are
priced by themselves: moved if the cost model finds moving them cheaper than prefilling them again.
A recompute switch drops every block and the whole cache.

If any rank fails, ``WorkerFailure`` (marked ``world_broken``) reaches the engine loop, also
when a caller's thread asked for the switch, and the loop rebuilds a consistent world and
recomputes the unfinished requests; the
schedulers planned here are dropped with their blocks, so nothing leaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pat_engine.core.block_pool import blocks_needed
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.request import Sequence
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.errors import LayoutError
from pat_engine.parallel.dp_placement import PlacementRule, switch_placement
from pat_engine.parallel.kv_plan import KVRun, kv_bytes_per_token, plan_kv_moves
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.kv_path_cost import KVPathEstimate, estimate_kv_paths
from pat_engine.predictor.policy import RequestSnapshot, SwitchDecision
from pat_engine.protocol import SeqTable, SwitchPlan


def check_target(memory: MemoryPlan, current: Layout, tp: int, unfinished: list[Sequence]) -> Layout:
    """The layout for TP ``tp``; ``LayoutError`` if the model, the world or the KV budget refuse it,
    or an unfinished request would not fit one of its DP groups."""
    new = memory.arch.layout(current.world, tp)
    if memory.num_blocks(new) < 1:
        raise LayoutError(f"{new}: the KV budget holds no block under this layout")
    for seq in unfinished:
        if not memory.fits(new, len(seq.prompt_ids), seq.params.max_new_tokens):
            raise LayoutError(
                f"{new}: request {seq.request_id} needs "
                f"{memory.slots_needed(len(seq.prompt_ids), seq.params.max_new_tokens)} KV slots "
                f"but a DP group would hold {memory.tokens_per_group(new)}")
    return new


@dataclass
class PlannedSwitch:
    """A switch decided: the workers' plan, the new groups' schedulers and where each request sits."""

    plan: SwitchPlan
    schedulers: list[GroupScheduler]
    estimate: KVPathEstimate | None
    group_of: dict[int, int]  # seq_id -> new DP group
    tables: dict[int, list[int]]  # seq_id -> block table in its new group (requests whose KV migrates)
    registered: dict[int, int]  # seq_id -> leading blocks indexed in the new group's prefix cache
    cached: dict[int, list[int]] = field(default_factory=dict)  # new group -> moved cached blocks no request holds

    @property
    def path(self) -> str:
        return self.plan.kv_path

    def seat(self, seqs: list[Sequence]) -> None:
        """Once the workers ran the plan: each request joins its new group, running where its KV
        migrated, waiting (to be prefilled again) where it did not."""
        for seq in seqs:
            sched = self.schedulers[self.group_of[seq.seq_id]]
            table = self.tables.get(seq.seq_id)
            if table is not None:
                sched.add_running(seq, table, self.registered.get(seq.seq_id, 0))
            else:
                seq.forget_kv()  # its blocks belonged to the old pools
                sched.add(seq)
        for sched in self.schedulers:  # keep admission order: running first by arrival, waiting by arrival
            sched.running.sort(key=lambda s: s.seq_id)
        for group, blocks in self.cached.items():  # unreferenced again: cached in their new group
            self.schedulers[group].blocks.free(blocks)


def plan_switch(decision: SwitchDecision, seqs: list[Sequence], old: Layout, new: Layout,
                old_schedulers: list[GroupScheduler], new_schedulers: Callable[[Layout], list[GroupScheduler]],
                memory: MemoryPlan, default_kv_transfer: str, placement: PlacementRule | None,
                costs: CostSource, keep_cache: bool = False) -> PlannedSwitch:
    """Plan the switch of ``seqs`` (every unfinished request, by arrival, taken out of
    ``old_schedulers``) from ``old`` to ``new``; nothing outside the returned plan is changed.

    ``new_schedulers(layout)`` makes empty schedulers; ``default_kv_transfer`` is the engine's
    "auto" / "migrate" / "recompute" (``decision.kv_path`` overrides it); ``keep_cache``: a migrating
    switch moves the cached blocks no request holds too, and a switch with no request holding KV prices
    moving them (a forced recompute drops them).
    """
    group_of = _target_groups(seqs, new, placement)
    block_size = old_schedulers[0].block_size
    schedulers = new_schedulers(new)
    placed = _KVPlacement(old_schedulers, schedulers, block_size)
    for seq in seqs:
        placed.place(seq, group_of[seq.seq_id])
    forced = decision.kv_path or (default_kv_transfer if default_kv_transfer != "auto" else None)
    keep_cache = keep_cache and forced != "recompute"
    cache_only = keep_cache and not placed.runs
    if cache_only:  # no request holds KV: the cached prefixes alone are priced, moved against prefilled again
        placed.place_all_cached(old, new)
    if placed.runs:
        estimate = _estimate(old, new, memory, placed, costs)
        path = forced or estimate.path
    else:  # nothing to migrate
        path, estimate = "recompute", None
    if path == "recompute":  # nothing moves: fresh groups, every request is prefilled again
        schedulers = new_schedulers(new)
        placed = _KVPlacement(old_schedulers, schedulers, block_size)
    elif keep_cache and not cache_only:  # after the requests' blocks, into what their groups leave unused
        placed.place_all_cached(old, new)
    tables = tuple(SeqTable(s.seq_id, group_of[s.seq_id], tuple(placed.tables[s.seq_id]), s.sampling,
                            tuple(s.tokens[: s.num_cached]) if s.sampling.has_penalties else None)
                   for s in seqs if s.seq_id in placed.tables)
    per_group = tuple(sum(1 for g in group_of.values() if g == group) for group in range(new.dp))
    plan = SwitchPlan(old, new, memory.num_blocks(new), path, tuple(placed.runs), tables, per_group)
    return PlannedSwitch(plan, schedulers, estimate, group_of, placed.tables, placed.registered, placed.cached)


def _target_groups(seqs: list[Sequence], new: Layout, placement: PlacementRule | None) -> dict[int, int]:
    """seq_id -> new DP group, by ``switch_placement`` with the admission placement: the same call,
    on the same object, that the controller prices this switch with."""
    target = switch_placement(placement, [RequestSnapshot.of(s) for s in seqs], new.dp)
    return {seqs[i].seq_id: g for g, members in enumerate(target) for i in members}


def _estimate(old: Layout, new: Layout, memory: MemoryPlan, placed: "_KVPlacement", costs: CostSource) -> KVPathEstimate:
    """Predicted seconds of migrating the placed KV against prefilling it again in the new groups."""
    arch, itemsize = memory.arch, memory.dtype.itemsize
    sent: dict[int, int] = {}
    for m in plan_kv_moves(placed.runs, old, new, arch.num_kv_heads):
        if m.src != m.dst:
            per_token = kv_bytes_per_token(arch.num_layers, len(m.heads), arch.head_dim, itemsize, 1)
            sent[m.src] = sent.get(m.src, 0) + placed.runs[m.run].num_tokens * per_token
    per_group: list[list[int]] = [[] for _ in range(new.dp)]
    for dst, tokens in placed.contexts:  # recompute prefills every migrating request's whole context
        per_group[dst].append(tokens)
    return estimate_kv_paths(max(sent.values(), default=0), costs.bandwidth(), per_group,
                             lambda n, l_rms: costs.prefill_seconds(new.tp, n, l_rms))


@dataclass
class _KVPlacement:
    """Where each migrating request's KV lands: new blocks for what no earlier request already
    brought to the same target group, shared references for what one did."""

    old: list[GroupScheduler]
    new: list[GroupScheduler]
    block_size: int
    runs: list[KVRun] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> its table in its new group
    registered: dict[int, int] = field(default_factory=dict)  # seq_id -> leading blocks indexed in the new cache
    # (new group, tokens) per migrating request, and per group's moved cache
    contexts: list[tuple[int, int]] = field(default_factory=list)
    cached: dict[int, list[int]] = field(default_factory=dict)  # new group -> moved cached blocks no request holds
    _moved: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (old group, old block, new group) -> new

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

    def place_all_cached(self, old: Layout, new: Layout) -> None:
        """Every old group's cached blocks into the new group that holds its first rank."""
        for group in range(old.dp):
            self.place_cached(group, new.group_of(old.group_ranks(group)[0]))

    def place_cached(self, src: int, dst: int) -> None:
        """Old group ``src``'s cached blocks that no request holds, most recently used first, into blocks
        ``dst`` has unused (a prefix ``dst`` already indexes is not brought twice)."""
        old, pool = self.old[src].blocks, self.new[dst].blocks
        moving = []
        for block in old.cached_blocks():
            if pool.num_unused == 0:
                break
            entry = old.entry(block)
            if entry is not None and not pool.indexes(entry):
                fresh = pool.allocate(1)[0]
                pool.adopt(fresh, entry)
                moving.append((block, fresh))
        if moving:
            self.runs.append(KVRun(len(moving) * self.block_size, src, tuple(b for b, _ in moving), dst,
                                   tuple(f for _, f in moving)))
            self.cached.setdefault(dst, []).extend(f for _, f in moving)
            self.contexts.append((dst, len(moving) * self.block_size))  # what prefilling them again would cost
