"""GlobalCoordinator: the driver's state, as four services the engine loop thread owns.

- ``stepping`` (``Stepping``): requests, per-group scheduling, steps dispatched and their results,
  speculation hooks, status, pausing;
- ``switching`` (``Switching``): the switch policy and cost source, switches, generation stages,
  the timeline;
- ``weight_sync`` (``WeightSync``): RL weight updates (checks on the caller's thread, worker calls
  at a step boundary);
- ``memory_release`` (``MemoryRelease``): memory released for a colocated trainer, and restored.

Each service owns its state and its rules; ``Engine`` forwards each area to its service. A
service method that touches state runs in the loop thread (``loop_thread.on_loop``), so no
state needs a lock. What spans the services is here: a loop turn (``tick``), whether steps
may start, and adopting a fresh worker world after a failure.
"""

from __future__ import annotations

from pat_engine.config import EngineConfig
from pat_engine.core.loop_thread import LoopThread
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.memory_release import MemoryRelease
from pat_engine.core.request import Sequence
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.stepping import Stepping
from pat_engine.core.switching import Switching
from pat_engine.core.timeline import Timeline
from pat_engine.core.weight_sync import WeightSync
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.parallel.layout import Layout


class GlobalCoordinator:
    def __init__(self, config: EngineConfig, memory_plan: MemoryPlan, pool: WorkerPool, layout: Layout,
                 weights: ServedWeights | None = None, thread: LoopThread | None = None):
        self.config, self.memory_plan = config, memory_plan
        self.weights = weights or ServedWeights(config.model)
        self.thread = thread or LoopThread()  # not started: the caller's thread owns the state (tests)
        self.timeline = Timeline(config.timeline_max_events)
        self.stepping = Stepping(config, memory_plan, pool, layout, self.thread, self.timeline)
        self.memory_release = MemoryRelease(config, memory_plan, self.stepping, self.weights, self.thread)
        sleep = self.memory_release.state
        self.switching = Switching(config, memory_plan, self.stepping, sleep, self.timeline, self.thread)
        self.memory_release.on_release = self.switching.graphs_dropped  # the workers drop every graph with it
        self.stepping.watcher = self.switching  # its cost source and its policy learn from every step
        self.weight_sync = WeightSync(memory_plan.arch, config, self.stepping, self.weights, sleep, self.thread)

    def may_dispatch(self) -> bool:
        """Steps start only when not paused, with every byte of memory back and the latest weights
        served: a request queued while memory is released waits, it never runs on released memory."""
        return not self.stepping.paused and not self.memory_release.state.asleep and not self.weights.stale

    def tick(self, timeout: float | None, wake=None) -> None:
        """One loop turn: a switch the policy asked for, at the step boundary; then idle groups get their
        next step (unless a switch is still pending), an overlapping policy's due decision runs while those
        steps compute, and results that arrive within ``timeout`` are handled."""
        self.switching.run_pending()
        dispatch = self.switching.pending is None and self.may_dispatch()
        self.stepping.tick(timeout, wake, dispatch, after_dispatch=self.switching.decide_if_due)

    def restart(self, pool: WorkerPool) -> list[Sequence]:
        """Adopt a fresh worker world at the base layout: every unfinished request is queued again for
        recompute, nothing is released, no switch is pending."""
        self.memory_release.state.clear()
        self.switching.drop_decisions()
        self.switching.graphs_dropped()
        return self.stepping.restart(pool, self.memory_plan.base)
