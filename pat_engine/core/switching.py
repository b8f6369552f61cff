"""``Switching``: when and how the layout changes, and the record of each change.

It holds the switch policy and the cost source switches are priced with, consults the
policy every ``switch_check_interval`` decode steps (it is the steps' ``StepWatcher``),
runs a switch at a step boundary (docs/switch.md: ``check_target``, drain, ``plan_switch``,
every rank's ``SwitchExecutor``, the requests seated in the new groups), starts
generation stages, and records status points and switches on the timeline.

Runs in the loop thread: methods marked ``on_loop`` may be called from any thread.
"""

from __future__ import annotations

import logging
import time

from pat_engine.config import EngineConfig, check_kv_transfer
from pat_engine.core.layout_switch import PlannedSwitch, check_target, plan_switch
from pat_engine.core.loop_thread import LoopThread, on_loop
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.sleep_state import SleepState
from pat_engine.core.stepping import Stepping
from pat_engine.core.timeline import SwitchEvent, Timeline
from pat_engine.errors import LayoutError, WorkerFailure
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.measured_rates import MeasuredRates
from pat_engine.predictor.policy import ScheduledSwitches, SwitchDecision, SwitchPolicy
from pat_engine.protocol import SwitchReport
from pat_engine.protocol.calls import Switch

log = logging.getLogger(__name__)


class Switching:
    def __init__(self, config: EngineConfig, memory_plan: MemoryPlan, stepping: Stepping, sleep: SleepState,
                 timeline: Timeline, thread: LoopThread):
        self.config, self.memory_plan, self.stepping, self.thread = config, memory_plan, stepping, thread
        self.sleep = sleep  # a switch reads the weights and the KV it moves: refused while they are released
        self.timeline = timeline
        self.cost_source: CostSource = MeasuredRates()  # replaced by the predictor when a profile table is loaded
        self.policy: SwitchPolicy | None = None
        self.pending: SwitchDecision | None = None  # the policy's decision, run at the next step boundary
        self.decision_due = False  # an overlapping policy's decision, taken once the next steps are sent
        # a costly policy decides while the steps compute where that costs them nothing (a GPU); CPU workers
        # use the host's cores, so there it decides at the boundary (bench/results/controller_overlap.md)
        self.overlap_decisions = config.host_free_during_steps
        self._last_point = (time.monotonic(), 0)  # (when, generated tokens) of the last status point

    # ---- policy and stages -------------------------------------------------------------------

    @on_loop
    def set_policy(self, policy: SwitchPolicy | None, cost_source: CostSource | None = None) -> None:
        """Install the switch policy (None: static) and, when given, the cost source switches are priced
        with (the predictor that comes with a controller)."""
        self.policy = policy
        if cost_source is not None:
            self.cost_source = cost_source

    def scheduled_policy(self, switch_schedule: list[tuple[int, int]], kv_transfer: str | None = None) -> ScheduledSwitches:
        """A fixed switch schedule ``[(decode_step, tp), ...]``, every target checked against this
        model and world first (``LayoutError`` names a bad one)."""
        check_kv_transfer(kv_transfer, allow_auto=False)
        for _, tp in switch_schedule:
            self.memory_plan.arch.layout(self.config.world, tp)
        return ScheduledSwitches(list(switch_schedule), kv_transfer)

    def stage_policy(self, switch_schedule: list[tuple[int, int]] | None, kv_transfer: str | None,
                     policy: SwitchPolicy | None) -> SwitchPolicy | None:
        """A stage's policy, its options checked now (None: keep the installed one)."""
        return self.scheduled_policy(switch_schedule, kv_transfer) if switch_schedule is not None else policy

    @on_loop
    def start_stage(self, policy: SwitchPolicy | None, base_layout: Layout | None = None) -> None:
        """A new generation stage: back to ``base_layout`` first when given (an idle switch when nothing
        runs), then ``policy`` (None: the installed one) counts decode steps from 0."""
        if base_layout is not None and self.stepping.layout != base_layout:
            self.switch(SwitchDecision(base_layout.tp, "new stage: base layout"))
        self.policy = policy if policy is not None else self.policy
        self.decision_due = False  # a decision due from the last stage
        self.stepping.start_stage()

    # ---- what steps teach (Stepping's StepWatcher) --------------------------------------------

    def prefill_done(self, tp: int, tokens: int, seconds: float) -> None:
        self.cost_source.record_prefill(tp, tokens, seconds)

    def decode_step_done(self, tp: int, batch: int, context_tokens: int, seconds: float) -> None:
        self.cost_source.record_decode_step(tp, batch, context_tokens, seconds)

    def decode_steps_grew(self, steps: int) -> None:
        """Every ``switch_check_interval`` decode steps (the policy's own interval when it has one): a
        status point on the timeline, and the policy's decision, to run at the next step boundary. A
        policy that ``overlaps_steps`` decides after the next dispatch instead (``decide_if_due``) where the
        devices compute apart from the host (``overlap_decisions``: CUDA)."""
        interval = getattr(self.policy, "interval", None) or self.config.switch_check_interval
        if steps % interval:
            return
        self._record_point()
        if self.overlap_decisions and getattr(self.policy, "overlaps_steps", False):
            self.decision_due = True
        else:
            self._decide()

    def graphs_dropped(self) -> None:
        """The workers dropped every decode graph (a memory release, a new world): a return captures again."""
        self.cost_source.forget_graphs()

    def drop_decisions(self) -> None:
        """Forget the pending switch and any decision due (a restart adopts a fresh world at the base layout)."""
        self.pending, self.decision_due = None, False

    def decide_if_due(self) -> None:
        """Right after a dispatch: the decision an overlapping policy was due (its host arithmetic runs
        while the steps just sent compute; the switch waits for them at the next step boundary)."""
        if self.decision_due:
            self.decision_due = False
            self._decide()

    def _decide(self) -> None:
        if self.policy is not None and self.pending is None and self.stepping.seqs:
            decision = self.policy.decide(self.stepping.status())
            if decision is not None and decision.tp != self.stepping.layout.tp:
                self.pending = decision

    def _record_point(self) -> None:
        now, tokens = time.monotonic(), self.stepping.generated_tokens
        rate = (tokens - self._last_point[1]) / max(now - self._last_point[0], 1e-9)
        self.timeline.add_point(str(self.stepping.layout), len(self.stepping.seqs), rate)
        self._last_point = (now, tokens)

    # ---- switching ---------------------------------------------------------------------------

    def run_pending(self) -> None:
        """At a step boundary (nothing in flight): run the switch the policy asked for, if any. A target
        that cannot hold the batch is refused and recorded; the batch goes on where it is."""
        if self.pending is None or self.stepping.inflight:
            return
        decision, self.pending = self.pending, None
        try:
            self.switch(decision)
        except LayoutError as exc:  # a policy asked for a layout that cannot hold the batch
            log.warning("switch to tp=%d refused: %s", decision.tp, exc)
            self.timeline.add_switch(SwitchEvent(self.timeline.now(), str(self.stepping.layout), f"tp={decision.tp}",
                                                 decision.reason, "none", 0.0, decision=dict(decision.details),
                                                 ok=False, error=f"refused: {exc}"))

    def reconfigure(self, tp: int, kv_transfer: str | None, timeout: float | None) -> SwitchEvent:
        """``Engine.reconfigure``: the switch to TP ``tp`` at the next step boundary, from any thread."""
        check_kv_transfer(kv_transfer, allow_auto=False)
        decision = SwitchDecision(tp, "reconfigure() call", kv_transfer)
        return self.thread.run(self.switch, decision, timeout=timeout)  # the target is checked there

    def switch(self, decision: SwitchDecision) -> SwitchEvent:
        """Change layout now (docs/switch.md); returns the switch's record.

        The target is checked before anything moves; then in-flight steps drain, every unfinished
        request is taken out of its group, ``plan_switch`` decides where each goes and whether its KV
        migrates, every rank runs the plan, and the requests join the new groups. A worker failing on the
        way leaves the world half switched and the requests out of their groups: its ``WorkerFailure``
        says the engine loop must rebuild the world (``world_broken``), also when a caller's thread
        asked for the switch (``reconfigure``)."""
        try:
            return self._switch(decision)
        except WorkerFailure as exc:
            exc.world_broken = True
            raise

    def _switch(self, decision: SwitchDecision) -> SwitchEvent:
        if self.sleep.asleep:  # the reshard reads the weights and the KV it would move
            raise LayoutError(f"cannot change the layout while {self.sleep.describe()} is released; wake_up() first")
        stepping = self.stepping
        started = time.perf_counter()
        new = check_target(self.memory_plan, stepping.layout, decision.tp, stepping.unfinished())
        drain_started = time.perf_counter()
        stepping.drain()
        drain_s = time.perf_counter() - drain_started  # the steps in flight at the decision, finished
        old = stepping.layout
        if new == old:
            return SwitchEvent(self.timeline.now(), str(old), str(new), decision.reason, "none", 0.0)
        # cached prefixes no request uses stay behind unless the switch keeps them (core/layout_switch.py):
        # counted, as what a switch costs a later request with the same prefix
        cached_before = sum(sched.blocks.num_cached for sched in stepping.schedulers)
        seqs = stepping.take_unfinished()
        planned = plan_switch(decision, seqs, old, new, stepping.schedulers, stepping.new_schedulers,
                              self.memory_plan, self.config.kv_transfer, stepping.placement, self.cost_source,
                              self.config.switch_keeps_prefix_cache)
        report = stepping.pool.ask(Switch(planned.plan))
        planned.seat(seqs)
        stepping.install_layout(new, planned.schedulers)
        cached_dropped = cached_before - sum(len(blocks) for blocks in planned.cached.values())
        return self._record_switch(decision, planned, report, len(seqs), started, drain_s, cached_dropped)

    def _record_switch(self, decision: SwitchDecision, planned: PlannedSwitch, report: SwitchReport, requests: int,
                       started: float, drain_s: float, cached_dropped: int) -> SwitchEvent:
        """Feed the measured costs back to the cost source and add the switch to the timeline."""
        old, new = planned.plan.old, planned.plan.new
        if planned.path == "migrate":
            self.cost_source.record_kv_transfer(report.busiest_kv_bytes, report.busiest_kv_s)
        self.cost_source.record_weight_reshard(old.tp, new.tp, report.weights_s)
        self.cost_source.record_graphs(old.tp, report.graphs_left, new.tp)
        costs = {**report.to_dict(), "drain_s": drain_s, "migrated_requests": len(planned.tables),
                 "requests": requests, "cached_blocks_dropped": cached_dropped}
        del costs["rank"]
        if planned.estimate is not None:
            costs.update(predicted_migrate_s=planned.estimate.migrate_s,
                         predicted_recompute_s=planned.estimate.recompute_s)
        event = SwitchEvent(self.timeline.now(), str(old), str(new), decision.reason, planned.path,
                            time.perf_counter() - started, costs, dict(decision.details))
        self.timeline.add_switch(event)
        return event

    def record_failure(self, message: str) -> None:
        """A worker failure: the world goes back to the base layout, recomputing (the loop restarts it)."""
        self.timeline.add_switch(SwitchEvent(self.timeline.now(), str(self.stepping.layout),
                                             str(self.memory_plan.base), f"worker failure: {message}", "recompute",
                                             0.0, ok=False, error=message))
