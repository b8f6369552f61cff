"""Real model steps in the test process: a ``WorkerPool`` stand-in whose DP groups are TP1
``InferExecutor``s (no processes, no collectives), for fast-tier tests that need real logits.

Steps run at the next poll, after the driver has dispatched every group's step; control calls
(switches, memory release) are not served: tests that need them start real workers (slow tier).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pat_engine.config import EngineConfig
from pat_engine.core.coordinator import GlobalCoordinator
from pat_engine.core.inputs import RequestFactory
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.request import Sequence
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import AnswerHeld, StepCommand, StepResult
from pat_engine.sampling.params import SamplingParams
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.infer_executor import InferExecutor


class LocalPool:
    def __init__(self, config: EngineConfig, layout: Layout, num_blocks: int):
        assert layout.tp == 1, "in-process groups are TP1"
        arch = load_model_arch(config.model)
        self.layout, self.procs = layout, []
        self.executors = []
        for g in range(layout.dp):
            ex = InferExecutor(arch, layout, TPGroup(0, 1, (g,)), config.torch_dtype(), torch.device("cpu"),
                               config.block_size, num_blocks, numerics=config.numerics, max_tp=config.max_tp,
                               graphs=GraphSettings.from_config(config, arch))
            ex.load_weights(config.model)
            ex.capture_graphs()  # as a worker does (nothing when graphs are off)
            self.executors.append(ex)
        self.pending: list[tuple[int, StepCommand]] = []
        self.steps: list[StepCommand] = []

    def send(self, ranks: list[int], msg: StepCommand | AnswerHeld) -> None:
        if isinstance(msg, AnswerHeld):  # these executors answer every step at once: nothing is held
            return
        self.steps.append(msg)
        self.pending.append((self.layout.group_of(ranks[0]), msg))

    def poll(self, timeout: float | None, extra: list | None = None) -> list[StepResult]:
        """Run the steps sent since the last poll (so the driver's dispatch-to-result time is the step's)."""
        todo, self.pending = self.pending, []
        return [self.executors[g].execute(msg) for g, msg in todo]

    def ask(self, call, ranks=None):
        raise NotImplementedError(f"LocalPool serves steps only, not {type(call).__name__}")

    def alive(self) -> bool:
        return True


@dataclass
class LocalDriver:
    coord: GlobalCoordinator
    pool: LocalPool
    factory: RequestFactory

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[Sequence]]:
        """Every sample of every prompt, run to the end with block invariants checked after each tick."""
        families = []
        for prompt, p in zip(prompts, params):
            seqs = self.factory.make_samples(prompt, p)
            self.coord.stepping.add_samples(seqs)
            families.append(seqs)
        for _ in range(100_000):
            if not self.coord.stepping.has_work():
                return families
            self.coord.tick(0)
            self.coord.stepping.check_block_invariants()
        raise AssertionError("the driver did not finish")


def local_driver(path: str, dp: int = 1, kv_blocks: int = 256, block_size: int = 4, **config) -> LocalDriver:
    cfg = EngineConfig.from_kwargs(path, tp=1, dp=dp, block_size=block_size, **config)
    arch = load_model_arch(path)
    layout = Layout(1, dp)
    dtype = cfg.torch_dtype()
    memory = MemoryPlan(arch, dtype, block_size, kv_blocks * block_size * arch.kv_bytes_per_token(1, dtype), layout,
                        device_budget=False)
    pool = LocalPool(cfg, layout, memory.num_blocks(layout))
    return LocalDriver(GlobalCoordinator(cfg, memory, pool, layout), pool,
                       RequestFactory(arch, None, arch.max_position, cfg.seed))
