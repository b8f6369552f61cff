"""The CPU kernels' off switches, read once a step against read on every call (in one process, interleaved).

A CPU decode step asks each kernel family's switch (``PAT_CPU_ATTENTION``, ``PAT_CPU_NORM``, ...) whether
it is on before every kernel call, a few per layer; the worker reads each once a step
(``cpu_extension.switches_read_once`` around ``InferExecutor.launch``). Here one ``InferExecutor`` per
shape runs greedy batch-1 decode steps with the step's reads on, then off (the context replaced by a
no-op, every call reading the environment as before), in blocks of a few steps alternating A, B, A, B;
the table gives each mode's median step and whether both drew the same tokens.

Shapes: ``narrow``, 32 layers of hidden 64 (a step of launches and lookups more than arithmetic: the
host-bound end, as a small model's tail steps); ``h768``, bench/peer_rollout.py's h768 (6 layers of hidden
768, vocabulary 16384), in float32 and bfloat16.

    python bench/cpu_switch_reads.py        # writes bench/results/cpu_switch_reads.md
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from pat_engine.model.arch import load_model_arch  # noqa: E402
from pat_engine.parallel.comm import TPGroup  # noqa: E402
from pat_engine.parallel.layout import Layout  # noqa: E402
from pat_engine.protocol import SeqStep, StepCommand  # noqa: E402
from pat_engine.sampling.spec import SamplingSpec  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402
from pat_engine.worker import infer_executor  # noqa: E402
from peer_rollout import SHAPES  # noqa: E402

NARROW = TinyModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=32, num_heads=4,
                       num_kv_heads=2, seed=5)
CASES = (("narrow", NARROW, torch.float32), ("h768", SHAPES["h768"], torch.float32),
         ("h768", SHAPES["h768"], torch.bfloat16))
GREEDY = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=False)
PROMPT, BLOCK = 32, 16
READ_ONCE = infer_executor.switches_read_once


class Decoder:
    """One sequence decoding greedily, a step at a time, on one executor."""

    def __init__(self, spec: TinyModelSpec, dtype: torch.dtype, steps: int):
        path = str(write_tiny_model(tempfile.mkdtemp(prefix="pat-switch-reads-"), spec))
        blocks = -(-(PROMPT + steps + 1) // BLOCK)
        self.ex = infer_executor.InferExecutor(load_model_arch(path), Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)),
                                               dtype, torch.device("cpu"), block_size=BLOCK, num_blocks=blocks)
        self.ex.load_weights(path)
        res = self.ex.execute(StepCommand(0, True, [SeqStep(0, list(range(5, 5 + PROMPT)), 0, list(range(blocks)),
                                                            sampling=GREEDY)]))
        self.token, self.pos, self.step_id = res.tokens[0], PROMPT, 1

    def step(self) -> tuple[float, int]:
        start = time.perf_counter()
        res = self.ex.execute(StepCommand(self.step_id, False, [SeqStep(0, [self.token], self.pos)]))
        seconds = time.perf_counter() - start
        self.token, self.pos, self.step_id = res.tokens[0], self.pos + 1, self.step_id + 1
        return seconds, self.token


def measure(spec: TinyModelSpec, dtype: torch.dtype, rounds: int, block: int) -> dict[str, tuple[float, list[int]]]:
    """{mode: (median step seconds, tokens)}: ``rounds`` blocks of ``block`` steps per mode, alternating, one
    sequence per mode (the same prompt), after a warm-up block each."""
    modes = {"read once a step": READ_ONCE, "read every call": contextlib.nullcontext}
    decoders = {mode: Decoder(spec, dtype, (rounds + 1) * block) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list[int]] = {mode: [] for mode in modes}
    for r in range(rounds + 1):
        for mode, context in modes.items():
            infer_executor.switches_read_once = context
            try:
                for _ in range(block):
                    seconds, token = decoders[mode].step()
                    tokens[mode].append(token)
                    if r:  # the first block of each mode warms up
                        times[mode].append(seconds)
            finally:
                infer_executor.switches_read_once = READ_ONCE
    return {mode: (statistics.median(times[mode]), tokens[mode]) for mode in modes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="blocks of steps per mode (interleaved)")
    p.add_argument("--block", type=int, default=5, help="steps per block")
    ns = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, spec, dtype in CASES:
        got = measure(spec, dtype, ns.rounds, ns.block)
        (once, once_tokens), (every, every_tokens) = got["read once a step"], got["read every call"]
        rows.append([name, str(dtype).removeprefix("torch."), f"{every * 1e3:.3f}", f"{once * 1e3:.3f}",
                     f"{every / once:.2f}x", "yes" if once_tokens == every_tokens else "NO"])
        print(rows[-1], flush=True)
    body = (f"One torch thread, batch 1, greedy, a {PROMPT}-token prompt; {ns.rounds} blocks of {ns.block} decode "
            "steps per mode after a warm-up block, the modes alternating block by block in one process (each its "
            "own executor and sequence); median step. *read every call*: `switches_read_once` replaced by a no-op, "
            "as before it existed.\n\n"
            + markdown_table(["model", "dtype", "read every call ms", "read once a step ms", "speed-up",
                              "same tokens"], rows))
    write_result("cpu_switch_reads", "The CPU kernels' off switches: read once a step against every call", body)


if __name__ == "__main__":
    sys.exit(main())
