"""``MemoryRelease``: giving the workers' memory to a colocated trainer and taking it back.

``sleep`` / ``wake_up`` (vLLM's levels, or SGLang's tags) at a step boundary. Its
``SleepState`` is the one record of what is released: steps, switches and weight
updates read it and wait or refuse while anything is (``GlobalCoordinator.may_dispatch``).

Runs in the loop thread: methods marked ``on_loop`` may be called from any thread.
"""

from __future__ import annotations

from typing import Callable

from pat_engine.config import EngineConfig
from pat_engine.core.loop_thread import LoopThread, on_loop
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.sleep_state import DISCARDED, SleepState, check_tags, tags_for_level
from pat_engine.core.stepping import Stepping
from pat_engine.protocol.calls import ReleaseMemory, ReloadWeights, RestoreMemory


class MemoryRelease:
    def __init__(self, config: EngineConfig, memory_plan: MemoryPlan, stepping: Stepping, weights: ServedWeights,
                 thread: LoopThread):
        self.config, self.memory_plan, self.stepping, self.weights = config, memory_plan, stepping, weights
        self.thread = thread
        self.state = SleepState()  # what was released; nothing runs until it is restored
        self.on_release: Callable[[], None] = lambda: None  # told once the workers released memory

    def sleep(self, level: int, tags: list[str] | None) -> int:
        """``Engine.sleep``: a level (1: the KV, on GPU the weights to host memory; 2: the weights
        discarded too) or SGLang's tags (released weights are discarded); the bytes freed."""
        if tags is None:
            wanted, weights_to = tags_for_level(level, self.config.device == "cuda")
        else:
            wanted, weights_to = check_tags(tags), DISCARDED
        return self.release(wanted, weights_to or DISCARDED)

    def wake_up(self, tags: list[str] | None) -> list[str]:
        """``Engine.wake_up``: what was restored, by tag."""
        return sorted(self.restore(check_tags(tags)))

    @on_loop
    def release(self, tags: set[str], weights_to: str) -> int:
        """Release what ``tags`` name and is not released yet, at a step boundary; returns the bytes
        freed over all ranks. ``weights_to``: OFFLOADED or DISCARDED.

        The KV goes with everything that points into it: running requests give their blocks back
        and wait to be prefilled again (the same tokens: sampling depends only on seed and
        position), and the prefix cache is dropped. Waiting requests stay queued until the memory
        is restored.
        """
        kv = "kv_cache" in tags and not self.state.kv_cache
        weights = weights_to if "weights" in tags and self.state.weights is None else None
        if not kv and weights is None:
            return 0
        stepping = self.stepping
        stepping.drain()
        if kv:
            stepping.retract_all()
            stepping.flush_prefix_cache()
            stepping.check_block_invariants()  # every block is free now: a restored pool holds nothing anyone reads
        freed = stepping.pool.ask(ReleaseMemory(kv, weights))
        self.on_release()
        self.state.kv_cache = self.state.kv_cache or kv
        self.state.weights = self.state.weights or weights
        return freed

    @on_loop
    def restore(self, tags: set[str]) -> set[str]:
        """Restore what ``tags`` name among what was released; returns what it restored. Anything
        not released is left alone: waking an awake engine is a no-op, never a fresh KV pool."""
        weights = "weights" in tags and self.state.weights is not None
        kv = "kv_cache" in tags and self.state.kv_cache
        if not weights and not kv:
            return set()
        reload = weights and self.state.weights == DISCARDED and self.weights.restored_after_discard()
        blocks = self.memory_plan.num_blocks(self.stepping.layout) if kv else None
        pool = self.stepping.pool
        pool.ask(RestoreMemory(blocks, weights))
        if reload:
            pool.ask(ReloadWeights(self.weights.path))
        if weights:
            self.state.weights = None
        if kv:
            self.state.kv_cache = False
        return ({"weights"} if weights else set()) | ({"kv_cache", "cuda_graph"} if kv else set())
