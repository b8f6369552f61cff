"""GlobalCoordinator: request queues, per-group stepping, status and switches.

Runs in the engine's loop thread. It owns one ``GroupScheduler`` per DP group
and keeps every request's state, so moving requests between groups during a
switch is a local data operation. DP groups step independently: each idle
group gets its next batch as soon as its previous step returns.

It also owns every control operation (pause, switch, weight updates, memory
release, the installed policy and placement): ``Engine`` runs these methods in
the loop thread and adds only argument checks. Workers are reached through
``workers`` (a ``WorkerClient``: one typed method per control call).

Departure from the architecture picture (docs/switch.md), on purpose: batches
are picked here (per group) rather than by each group's leader, and sent to
every rank of the group directly. With all request state in one place the switch needs no
gathering of queues from leaders, and no per-step TP broadcast is needed.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from dataclasses import dataclass

from pat_engine.config import EngineConfig
from pat_engine.core.layout_switch import PlannedSwitch, check_target, plan_switch
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.measured_rates import MeasuredRates
from pat_engine.core.memory import MemoryPlan
from pat_engine.predictor.policy import ClusterStatus, GroupSnapshot, RequestSnapshot, SwitchDecision, SwitchPolicy
from pat_engine.core.request import Sequence
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.sleep_state import DISCARDED, SleepState
from pat_engine.core.timeline import SwitchEvent, Timeline
from pat_engine.core.worker_client import WorkerClient
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import LayoutError, WorkerFailure, last_traceback_line
from pat_engine.parallel.dp_placement import PlacementRule
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import Reply, StepCommand, StepResult, SwitchReport
from pat_engine.speculative.manager import Speculation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One group's step, as the profiler and predictor-accuracy benchmarks see it."""

    t: float  # timeline seconds at completion
    tp: int
    dp: int
    group: int
    is_prefill: bool
    batch_size: int  # sequences in the step
    context_tokens: int  # sum over the batch of context length after the step
    new_tokens: int  # tokens run through the model (prefill: whole prompts)
    seconds: float  # driver-side, dispatch to result
    forward_seconds: float  # worker-side forward + sampling on TP rank 0
    busy_groups: int  # groups with a step in flight when this one was dispatched
    head_seconds: float = 0.0  # of forward_seconds: the LM head
    sample_seconds: float = 0.0  # of forward_seconds: log-probs and the draw


@dataclass
class InFlight:
    cmd: StepCommand
    batch: list[Sequence]
    sent_at: float
    busy_groups: int
    speculative: bool = False  # a decode step dispatched while speculation was on (drafts or not)


class GlobalCoordinator:
    def __init__(self, config: EngineConfig, memory: MemoryPlan, pool: WorkerPool, layout: Layout,
                 weights: ServedWeights | None = None):
        self.config = config
        self.memory = memory
        self.pool = pool
        self.weights = weights or ServedWeights(config.model)
        self.sleep = SleepState()  # what release_memory gave back; nothing runs until it is restored
        self.timeline = Timeline(config.timeline_max_events)
        self.cost_source: CostSource = MeasuredRates()  # replaced by the predictor when a profile table is loaded
        self.policy: SwitchPolicy | None = None
        # optional admission rule: placement(seq, schedulers) -> group (Engine.set_placement)
        self.placement: PlacementRule | None = None
        self.pending_switch: SwitchDecision | None = None
        self.paused = False
        self.stage_decode_steps = 0  # set before the first install_layout, which copies it into the groups
        self._decode_ema: dict[int, float] = {}
        self._tokens_since_point = 0
        self._last_point = time.monotonic()
        self.inflight: dict[int, InFlight] = {}
        self.install_layout(layout, self.new_schedulers(layout))
        self.seqs: dict[int, Sequence] = {}  # unfinished, by seq id
        self.step_log: list[StepRecord] | None = None  # set to a list to record every step
        # speculative decoding (docs/speculative.md): drafts for small decode batches; None when off
        self.speculation = Speculation(config.speculative) if config.speculative.enabled else None
        self.last_step_at: float | None = None  # monotonic time of the last step result (for /health)

    @property
    def workers(self) -> WorkerClient:
        """The typed control calls to the current worker pool (a restart replaces the pool)."""
        return WorkerClient(self.pool)

    # ---- layout ----------------------------------------------------------------------

    def new_schedulers(self, layout: Layout) -> list[GroupScheduler]:
        """One empty scheduler per DP group of ``layout``, each with the layout's block count."""
        cfg = self.config
        blocks = self.memory.num_blocks(layout)
        return [GroupScheduler(g, blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                               cfg.enable_prefix_caching)
                for g in range(layout.dp)]

    def install_layout(self, layout: Layout, schedulers: list[GroupScheduler]) -> None:
        """Adopt ``layout`` with its groups' schedulers (after a switch, a restart, or at start)."""
        if self.inflight:
            raise RuntimeError("install_layout with steps in flight: drain() first")
        self.layout = layout
        self.schedulers = schedulers
        # the stage's decode-step count goes on across a switch or restart: the policy and the timeline
        # are consulted only when it grows, so new groups starting at 0 would silence both for a while
        for sched in self.schedulers:
            sched.decode_steps = self.stage_decode_steps
        self.inflight: dict[int, InFlight] = {}
        self._decode_ema = {}

    def drain(self) -> None:
        """Wait for every in-flight step and apply its results: the step boundary a switch or a
        weight update needs."""
        while self.inflight:
            for msg in self.pool.poll(1.0):
                self._handle(msg)
            self._check_step_timeouts()

    def take_unfinished(self) -> list[Sequence]:
        """Every unfinished sequence out of its scheduler, by arrival (a switch re-places them);
        their KV stays where it is until the switch has moved or dropped it."""
        if self.inflight:
            raise RuntimeError("take_unfinished with steps in flight: drain() first")
        return sorted((s for sched in self.schedulers for s in sched.take_all()), key=lambda s: s.seq_id)

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache hit rate (prompt tokens found cached at admission) and unreferenced cached blocks."""
        queried = sum(s.blocks.stats.queried_tokens for s in self.schedulers)
        hit = sum(s.blocks.stats.hit_tokens for s in self.schedulers)
        return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else 0.0,
                "cached_blocks": sum(s.blocks.num_cached for s in self.schedulers),
                "used_blocks": sum(s.blocks.num_blocks - s.blocks.num_free for s in self.schedulers)}

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix block (after a weight change their KV is stale)."""
        for sched in self.schedulers:
            sched.blocks.flush_cache()

    def check_block_invariants(self) -> None:
        """``AssertionError`` unless every group's blocks are free or owned by exactly one sequence."""
        for sched in self.schedulers:
            sched.check_blocks()

    # ---- requests ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.add_samples([seq])

    def add_samples(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one prompt on one DP group, so they can share the prompt's KV blocks:
        the group the admission placement picks for the first (``placement``), else the one with the
        fewest outstanding tokens."""
        if self.placement is not None:
            group = self.placement(seqs[0], self.schedulers)
        else:
            group = min(range(self.layout.dp), key=lambda g: (self.schedulers[g].outstanding_tokens(), g))
        for seq in seqs:
            self.schedulers[group].add(seq)
            self.seqs[seq.seq_id] = seq
        if self.speculation is not None:
            self.speculation.track(seqs)

    def _take(self, seq_ids: list[int]) -> list[Sequence]:
        """The unfinished sequences among ``seq_ids``, out of the coordinator and their queues (KV freed)."""
        out = []
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.schedulers[seq.group].remove(seq)
                self._left(seq)
                out.append(seq)
        return out

    def _left(self, seq: Sequence) -> None:
        """``seq`` left the engine's queues (finished, aborted or withdrawn)."""
        if self.speculation is not None:
            self.speculation.release(seq)

    def abort(self, seq_ids: list[int], reason: str = "abort", error: str | None = None) -> list[Sequence]:
        out = self._take(seq_ids)
        for seq in out:
            seq.finish(reason, error)
            self._notify(seq, 0)
        return out

    def retract_all(self) -> int:
        """Every running sequence frees its KV and waits to be prefilled again; drain() first."""
        if self.inflight:
            raise RuntimeError("retract_all with steps in flight: drain() first")
        return sum(sched.retract_running() for sched in self.schedulers)

    def withdraw(self, seq_ids: list[int]) -> list[Sequence]:
        """Take requests out of the queues without finishing them (held back after a crash); KV dropped."""
        return self._take(seq_ids)

    def step_members(self, rank: int | None) -> list[Sequence]:
        """Unfinished requests in the steps in flight on ``rank``'s DP group (every group's when None)."""
        groups = [g for g in self.inflight if rank is None or rank in self.layout.group_ranks(g)]
        return [s for g in groups for s in self.inflight[g].batch if s.seq_id in self.seqs]

    def has_work(self) -> bool:
        return bool(self.inflight) or any(s.has_work() for s in self.schedulers)

    def unfinished(self) -> list[Sequence]:
        return list(self.seqs.values())

    # ---- control: what Engine asks for, run here in the loop thread ---------------------------------

    def set_policy(self, policy: SwitchPolicy | None, cost_source: CostSource | None = None) -> None:
        """Install the switch policy (None: static) and, when given, the cost source switches are priced
        with (the predictor that comes with a controller)."""
        self.policy = policy
        if cost_source is not None:
            self.cost_source = cost_source

    def set_placement(self, placement: PlacementRule | None) -> None:
        self.placement = placement

    def speculation_stats(self) -> dict | None:
        """Speculative decoding totals (None: off): verify steps, drafted and accepted tokens."""
        spec = self.speculation
        if spec is None:
            return None
        st = spec.stats
        return {"verify_steps": st.verify_steps, "drafted_rows": st.drafted_rows, "drafted_tokens": st.drafted_tokens,
                "accepted_tokens": st.accepted_tokens, "acceptance_rate": st.acceptance_rate,
                "tokens_per_step": st.tokens_per_step}

    def set_draft_proposer(self, proposer) -> None:
        """Draft with ``proposer`` (a ``pat_engine.speculative.DraftProposer``); speculation must be on."""
        if self.speculation is None:
            raise RuntimeError("speculative decoding is off (EngineConfig.speculative)")
        self.speculation.use(proposer, self.unfinished())

    def remember_responses(self, prompt: list[int], responses: list[list[int]]) -> None:
        """Earlier responses to ``prompt`` as draft sources (kept with ``speculative.history`` on)."""
        if self.speculation is not None:
            for response in responses:
                self.speculation.remember(prompt, response)

    def set_step_log(self, step_log: list[StepRecord] | None) -> None:
        """Append a ``StepRecord`` per step to ``step_log`` (None: stop recording)."""
        self.step_log = step_log

    def pause(self, mode: str) -> int:
        """Start no step until ``resume``; returns how many requests ``mode`` touched (Engine.pause)."""
        self.paused = True
        self.drain()
        if mode == "retract":
            return self.retract_all()
        if mode == "abort":
            return len(self.abort([s.seq_id for s in self.unfinished()], "abort", "aborted by pause (mode abort)"))
        return len(self.unfinished())

    def resume(self) -> None:
        self.paused = False

    def abort_all(self, message: str) -> int:
        return len(self.abort([s.seq_id for s in self.unfinished()], "abort", message))

    def num_unfinished(self) -> int:
        return len(self.seqs)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.pool.procs]

    def worker_stats(self) -> list[dict]:
        return self.workers.stats()

    def bandwidth_probe(self, nbytes: int, repeats: int) -> list[float]:
        """Each rank's best seconds to exchange ``nbytes`` with its neighbours, all ranks at once."""
        return self.workers.bandwidth_probe(nbytes, repeats)

    def kv_blocks(self) -> dict:
        """Free, cached and total KV blocks per DP group and whether the block invariants hold
        (reported, not raised)."""
        groups = [{"group": g, "free": s.blocks.num_free, "cached": s.blocks.num_cached,
                   "total": s.blocks.num_blocks} for g, s in enumerate(self.schedulers)]
        out = {"layout": str(self.layout), "groups": groups, "unfinished": len(self.seqs)}
        try:
            self.check_block_invariants()
            out["invariants"] = "ok"
        except AssertionError as exc:
            out["invariants"] = f"violated: {exc}"
        return out

    def start_stage(self, policy: SwitchPolicy | None, base_layout: Layout | None = None) -> None:
        """A new generation stage: back to ``base_layout`` first when given (an idle switch when nothing
        runs), then ``policy`` (None: the installed one) counts decode steps from 0."""
        if base_layout is not None and self.layout != base_layout:
            self.switch(SwitchDecision(base_layout.tp, "new stage: base layout"))
        self.policy = policy if policy is not None else self.policy
        self.stage_decode_steps = 0
        for s in self.schedulers:
            s.decode_steps = 0

    # ---- weights: updated in place at a step boundary -----------------------------------------------

    def load_weights(self, tensors: list[tuple[str, Any]]) -> int:
        """One bucket of full named tensors into every rank's shards; returns how many were applied."""
        self.drain()
        return self.workers.load_weights(tensors)

    def load_weights_from_handles(self, payloads: list[bytes]) -> int:
        """One bucket of tensors a colocated trainer shares by handle; every rank rebuilds and slices."""
        self.drain()
        return self.workers.load_weights_from_handles(payloads)

    def reload_weights(self, path: str) -> None:
        self.drain()
        self.workers.reload_weights(path)

    def receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                        timeout_s: float | None) -> int:
        """The trainer's broadcast of full tensors, through the weight-update group ``group_name``."""
        self.drain()
        return self.workers.update_weights_from_distributed(names, dtypes, shapes, group_name, timeout_s)

    def join_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> None:
        """Every worker joins a trainer's group as rank ``rank_offset + its rank`` (blocks until all have)."""
        self.workers.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                               backend, timeout_s)

    def leave_weights_update_group(self, group_name: str) -> bool:
        return self.workers.destroy_weights_update_group(group_name)

    def new_weight_version(self, version: str | None) -> str:
        """Count one finished update; unfinished requests note from which token the new weights apply.
        The prefix cache is dropped: its blocks hold KV the old weights computed."""
        self.flush_prefix_cache()
        name = self.weights.new_version(version)
        for seq in self.seqs.values():
            seq.note_new_weights(name)
        return name

    # ---- the loop body -------------------------------------------------------------------

    def tick(self, timeout: float | None, wake=None) -> None:
        """Dispatch idle groups, then handle whatever results arrive within ``timeout``."""
        if self.pending_switch is not None and not self.inflight:
            decision, self.pending_switch = self.pending_switch, None
            try:
                self.switch(decision)
            except LayoutError as exc:  # a policy asked for a layout that cannot hold the batch
                log.warning("switch to tp=%d refused: %s", decision.tp, exc)
                self.timeline.add_switch(SwitchEvent(self.timeline.now(), str(self.layout), f"tp={decision.tp}",
                                                     decision.reason, "none", 0.0, decision=dict(decision.details),
                                                     ok=False, error=f"refused: {exc}"))
        if self.pending_switch is None and self.may_dispatch():
            self._dispatch()
        for msg in self.pool.poll(timeout, [wake] if wake is not None else None):
            self._handle(msg)
        self._check_step_timeouts()

    def may_dispatch(self) -> bool:
        """Steps start only when not paused, with every byte of memory back and the latest weights
        served: a request queued while memory is released waits, it never runs on released memory."""
        return not self.paused and not self.sleep.asleep and not self.weights.stale

    def _check_step_timeouts(self) -> None:
        """A step that never returns (a hung rank that did not die) becomes an error, not a hang."""
        limit = self.config.step_timeout_s
        now = time.monotonic()
        for g, flight in self.inflight.items():
            if now - flight.sent_at > limit:
                raise WorkerFailure(f"DP group {g} (ranks {self.layout.group_ranks(g)}) did not finish a step "
                                    f"within step_timeout_s={limit:.0f}s", rank=self.layout.leader(g))

    def _dispatch(self) -> None:
        for g, sched in enumerate(self.schedulers):
            if g in self.inflight:
                continue
            drafts = self._draft_fn()
            item = sched.schedule(drafts)
            if item is None:
                continue
            cmd, batch = item
            self.pool.send(self.layout.group_ranks(g), cmd)
            self.inflight[g] = InFlight(cmd, batch, time.monotonic(), len(self.inflight) + 1,
                                        drafts is not None and not cmd.is_prefill)

    def _draft_fn(self):
        """The speculation's draft proposer while it is on for this many unfinished requests, else None."""
        spec = self.speculation
        return spec.drafts if spec is not None and spec.active(len(self.seqs)) else None

    def _observe_speculation(self, flight: InFlight, msg: StepResult) -> None:
        """Every decode step's cost; for speculating steps the acceptance per drafted request and the
        step's speed, for the speculation and the policy."""
        spec = self.speculation
        if spec is None or flight.cmd.is_prefill:
            return
        seconds = time.monotonic() - flight.sent_at
        spec.observe_cost(self.layout.tp, sum(len(s.token_ids) for s in flight.cmd.seqs), seconds)
        if not flight.speculative:
            return
        counts = msg.counts or [1] * len(flight.batch)
        for seq, step, n in zip(flight.batch, flight.cmd.seqs, counts):
            spec.observe(seq, len(step.token_ids) - 1, n)
        spec.observe_step(self.layout.tp, len(flight.batch), sum(s.start_pos + 1 for s in flight.cmd.seqs), seconds,
                          sum(counts), flight.cmd.verify)

    def _handle(self, msg: StepResult | Reply) -> None:
        if isinstance(msg, Reply):
            if not msg.ok:
                raise WorkerFailure(f"rank {msg.rank} failed during a step: {last_traceback_line(msg.error)}\n{msg.error}",
                                    rank=msg.rank)
            return
        flight = self.inflight.pop(msg.group, None)
        if flight is None or flight.cmd.step_id != msg.step_id:
            return  # a stale answer from before a restart
        self.last_step_at = time.monotonic()
        sched = self.schedulers[msg.group]
        is_prefill = flight.cmd.is_prefill
        if is_prefill:
            self.cost_source.record_prefill(self.layout.tp, sum(len(s.token_ids) for s in flight.cmd.seqs),
                                            msg.forward_seconds)
        else:
            elapsed = time.monotonic() - flight.sent_at
            prev = self._decode_ema.get(msg.group)
            self._decode_ema[msg.group] = elapsed if prev is None else 0.8 * prev + 0.2 * elapsed
        if self.step_log is not None:
            self.step_log.append(StepRecord(
                self.timeline.now(), self.layout.tp, self.layout.dp, msg.group, is_prefill, len(flight.batch),
                sum(s.start_pos + len(s.token_ids) for s in flight.cmd.seqs), sum(len(s.token_ids) for s in flight.cmd.seqs),
                time.monotonic() - flight.sent_at, msg.forward_seconds, flight.busy_groups, msg.head_seconds,
                msg.sample_seconds))
        finished = sched.on_result(flight.batch, is_prefill, msg)
        self._observe_speculation(flight, msg)
        counts = msg.counts or [1] * len(flight.batch)
        for seq, n in zip(flight.batch, counts):
            if seq.seq_id in self.seqs:
                self._notify(seq, n)
        for seq in finished:
            self.seqs.pop(seq.seq_id, None)
            self._left(seq)
        self._tokens_since_point += sum(counts)
        if not is_prefill:
            self._after_decode(sched)

    def _notify(self, seq: Sequence, new_tokens: int) -> None:
        if seq.on_update is not None:
            seq.on_update(seq, new_tokens)

    def _after_decode(self, sched: GroupScheduler) -> None:
        steps = max(s.decode_steps for s in self.schedulers)
        if steps <= self.stage_decode_steps:
            return
        self.stage_decode_steps = steps
        interval = getattr(self.policy, "interval", None) or self.config.switch_check_interval
        if steps % interval == 0:
            self._record_point()
            if self.policy is not None and self.pending_switch is None and self.seqs:
                decision = self.policy.decide(self.status())
                if decision is not None and decision.tp != self.layout.tp:
                    self.pending_switch = decision

    def _record_point(self) -> None:
        now = time.monotonic()
        rate = self._tokens_since_point / max(now - self._last_point, 1e-9)
        self.timeline.add_point(str(self.layout), len(self.seqs), rate)
        self._tokens_since_point, self._last_point = 0, now

    def status(self) -> ClusterStatus:
        groups = []
        for g, sched in enumerate(self.schedulers):
            reqs = tuple(RequestSnapshot.of(s) for s in sched.unfinished())
            groups.append(GroupSnapshot(g, reqs, sched.blocks.num_free, sched.blocks.num_blocks, self._decode_ema.get(g)))
        return ClusterStatus(time.time(), self.layout, tuple(groups), self.stage_decode_steps, self.config.block_size,
                             self.placement, self.speculation.status() if self.speculation is not None else None)

    def reset(self, pool: WorkerPool, layout: Layout) -> list[Sequence]:
        """Adopt a fresh worker world: every unfinished request is queued again for recompute."""
        self.pool = pool
        self.sleep = SleepState()  # fresh workers hold all their memory
        self.pending_switch = None
        seqs = sorted(self.seqs.values(), key=lambda s: s.seq_id)
        self.inflight = {}  # the old world's steps will never answer
        self.install_layout(layout, self.new_schedulers(layout))
        families: dict[int, list[Sequence]] = {}  # the samples of one prompt stay together
        for seq in seqs:
            seq.forget_kv()
            self.seqs.pop(seq.seq_id)
            families.setdefault((seq.first_sample or seq).seq_id, []).append(seq)
        for family in families.values():
            self.add_samples(family)
        return seqs

    # ---- memory for a colocated trainer -------------------------------------------------------

    def release_memory(self, tags: set[str], weights_to: str) -> int:
        """Release what ``tags`` name and is not released yet, at a step boundary; returns the bytes
        freed over all ranks. ``weights_to``: OFFLOADED or DISCARDED.

        The KV goes with everything that points into it: running requests give their blocks back
        and wait to be prefilled again (the same tokens: sampling depends only on seed and
        position), and the prefix cache is dropped. Waiting requests stay queued until the memory
        is restored.
        """
        kv = "kv_cache" in tags and not self.sleep.kv_cache
        weights = weights_to if "weights" in tags and self.sleep.weights is None else None
        if not kv and weights is None:
            return 0
        self.drain()
        if kv:
            self.retract_all()
            self.flush_prefix_cache()
            self.check_block_invariants()  # every block is free now: a restored pool holds nothing anyone reads
        freed = self.workers.release_memory(kv, weights)
        self.sleep.kv_cache = self.sleep.kv_cache or kv
        self.sleep.weights = self.sleep.weights or weights
        return freed

    def restore_memory(self, tags: set[str]) -> set[str]:
        """Restore what ``tags`` name among what was released; returns what it restored. Anything
        not released is left alone: waking an awake engine is a no-op, never a fresh KV pool."""
        weights = "weights" in tags and self.sleep.weights is not None
        kv = "kv_cache" in tags and self.sleep.kv_cache
        if not weights and not kv:
            return set()
        reload = weights and self.sleep.weights == DISCARDED and self.weights.restored_after_discard()
        blocks = self.memory.num_blocks(self.layout) if kv else None
        self.workers.restore_memory(blocks, weights)
        if reload:
            self.workers.reload_weights(self.weights.path)
        if weights:
            self.sleep.weights = None
        if kv:
            self.sleep.kv_cache = False
        return ({"weights"} if weights else set()) | ({"kv_cache", "cuda_graph"} if kv else set())

    # ---- switching -------------------------------------------------------------------------

    def switch(self, decision: SwitchDecision) -> SwitchEvent:
        """Change layout now (docs/switch.md); returns the switch's record.

        The target is checked before anything moves; then in-flight steps drain, every unfinished
        request is taken out of its group, ``plan_switch`` decides where each goes and whether its KV
        migrates, every rank runs the plan, and the requests join the new groups.
        """
        if self.sleep.asleep:  # the reshard reads the weights and the KV it would move
            raise LayoutError(f"cannot change the layout while {self.sleep.describe()} is released; wake_up() first")
        started = time.perf_counter()
        new = check_target(self.memory, self.layout, decision.tp, self.unfinished())
        self.drain()
        old = self.layout
        if new == old:
            return SwitchEvent(self.timeline.now(), str(old), str(new), decision.reason, "none", 0.0)
        seqs = self.take_unfinished()
        planned = plan_switch(decision, seqs, old, new, self.schedulers, self.new_schedulers, self.memory,
                              self.config.kv_transfer, self.placement, self.cost_source)
        report = self.workers.switch(planned.plan)
        planned.seat(seqs)
        self.install_layout(new, planned.schedulers)
        return self._record_switch(decision, planned, report, len(seqs), started)

    def _record_switch(self, decision: SwitchDecision, planned: PlannedSwitch, report: SwitchReport, requests: int,
                       started: float) -> SwitchEvent:
        """Feed the measured costs back to the cost source and add the switch to the timeline."""
        old, new = planned.plan.old, planned.plan.new
        if planned.path == "migrate":
            self.cost_source.record_kv_transfer(report.busiest_kv_bytes, report.busiest_kv_s)
        self.cost_source.record_weight_reshard(old.tp, new.tp, report.weights_s)
        costs = {**report.to_dict(), "migrated_requests": len(planned.tables), "requests": requests}
        del costs["rank"]
        if planned.estimate is not None:
            costs.update(predicted_migrate_s=planned.estimate.migrate_s,
                         predicted_recompute_s=planned.estimate.recompute_s)
        event = SwitchEvent(self.timeline.now(), str(old), str(new), decision.reason, planned.path,
                            time.perf_counter() - started, costs, dict(decision.details))
        self.timeline.add_switch(event)
        return event
