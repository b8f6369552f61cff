"""Build a driver (coordinator, memory plan, request factory) over a ``FakeWorkerPool``: no processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fake_workers import FakeWorkerPool, fake_token
from pat_engine.config import EngineConfig
from pat_engine.core.coordinator import GlobalCoordinator
from pat_engine.core.inputs import RequestFactory
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.request import Sequence
from pat_engine.model.arch import ModelArch, RopeSpec
from pat_engine.parallel.layout import Layout
from pat_engine.sampling.params import SamplingParams

VOCAB = 1000
ARCH = ModelArch(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096, rms_eps=1e-6,
                 rope=RopeSpec(theta=10000.0), qkv_bias=False, qk_norm=False, tie_word_embeddings=False,
                 eos_token_ids=(), bos_token_id=None)
BLOCK = 4


@dataclass
class Driver:
    coord: GlobalCoordinator
    pool: FakeWorkerPool
    factory: RequestFactory
    memory: MemoryPlan

    def add(self, prompt: list[int], max_new: int, **params) -> Sequence:
        seq = self.factory.make(prompt, SamplingParams(max_new_tokens=max_new, **params))
        self.coord.stepping.add(seq)
        return seq

    def add_samples(self, prompt: list[int], max_new: int, n: int, **params) -> list[Sequence]:
        seqs = self.factory.make_samples(prompt, SamplingParams(max_new_tokens=max_new, n=n, **params))
        self.coord.stepping.add_samples(seqs)
        return seqs

    def used_blocks(self) -> int:
        return sum(s.blocks.num_blocks - s.blocks.num_free for s in self.coord.stepping.schedulers)

    def ticks(self, n: int) -> None:
        for _ in range(n):
            self.coord.tick(0)

    def run(self, max_ticks: int = 10_000) -> None:
        """Tick until nothing is left to do."""
        for _ in range(max_ticks):
            if not self.coord.stepping.has_work() and self.coord.switching.pending is None:
                return
            self.coord.tick(0)
        raise AssertionError("the driver did not finish")


def make_driver(tp: int = 1, dp: int = 2, kv_blocks: int = 64, **config) -> Driver:
    layout = Layout(tp, dp)
    cfg = EngineConfig(model="fake", tp=tp, dp=dp, dtype="float32", block_size=BLOCK, **config)
    block_bytes = BLOCK * ARCH.kv_bytes_per_token(tp, torch.float32)
    memory = MemoryPlan(ARCH, torch.float32, BLOCK, kv_blocks * block_bytes, layout, device_budget=False)
    pool = FakeWorkerPool(layout, memory.num_blocks(layout), BLOCK, VOCAB)
    coord = GlobalCoordinator(cfg, memory, pool, layout)
    return Driver(coord, pool, RequestFactory(ARCH, None, ARCH.max_position, cfg.seed), memory)


def expected_tokens(seq: Sequence) -> list[int]:
    """What the fake workers generate for ``seq``, whatever the layout and schedule."""
    n = len(seq.prompt_ids)
    return [fake_token(seq.seq_id, n + i, VOCAB) for i in range(seq.params.max_new_tokens)]


def run_checked(d, max_ticks: int = 10_000) -> None:
    """Tick the driver until it has no work, checking the block invariants after every tick."""
    for _ in range(max_ticks):
        if not d.coord.stepping.has_work() and d.coord.switching.pending is None:
            return
        d.coord.tick(0)
        d.coord.stepping.check_block_invariants()
    raise AssertionError("did not finish")
