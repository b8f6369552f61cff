"""The sampler's GPU path: a decode step's draw reads no value back to the host until its one final
transfer, and draws exactly what the CPU path draws.

The GPU path is the one ``sampling/host.reads_are_free`` selects for non-CPU tensors; here it is
selected for CPU tensors (the C++ sampling kernels switched off, so torch ops run as on a GPU) and
every operation is watched: a value read (``bool``, ``item``, ``tolist``, ``nonzero``...) or a
tensor built from host data inside ``sample_on_device`` fails the test.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pat_engine.sampling import host
from pat_engine.sampling.sampler import SamplingBatch, sample_batch, sample_on_device
from pat_engine.sampling.spec import SamplingSpec

# what forces a device->host copy (or a host->device one from Python data) on a GPU
READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
         "masked_select", "unique", "tensor", "repeat_interleave"}


class NoHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.ops.append(name)
        if name in READS:
            raise AssertionError(f"the device path read a value back: {name}")
        return func(*args, **(kwargs or {}))


def _specs(n: int) -> list[SamplingSpec]:
    """An RL step's mix: plain temperature-1 rows with log-probs, top_p, top_k, both, min_p, greedy."""
    kinds = [SamplingSpec(1.0, -1, 1.0, 11, True), SamplingSpec(0.9, -1, 0.95, 12, True),
             SamplingSpec(1.0, 40, 1.0, 13, True), SamplingSpec(0.7, 20, 0.9, 14, True, processed_logprobs=True),
             SamplingSpec(1.0, -1, 1.0, 15, True, min_p=0.05), SamplingSpec(0.0, -1, 1.0, 0, True, top_logprobs=3)]
    return [kinds[i % len(kinds)] for i in range(n)]


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setenv("PAT_CPU_SAMPLER", "torch")  # torch ops, as on a GPU
    monkeypatch.setattr(host, "reads_are_free", lambda x: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_reads_nothing_back_until_its_one_transfer(device_path, dtype):
    specs = _specs(12)
    logits = (3 * torch.randn(12, 1000, generator=torch.Generator().manual_seed(0))).to(dtype)
    logits[0, 7] = 50.0  # row 0's certain pick, unless the suppression below holds
    batch = SamplingBatch.build(specs, list(range(40, 52)), [(7,)] + [()] * 11)
    with NoHostReads() as watch:
        out = sample_on_device(logits, batch)
    assert "sort" in watch.ops and out.tokens.shape == (12,) and out.logprobs.dtype == torch.float64
    host_side = out.to_host()
    assert host_side.tokens[0] != 7 and len(host_side.top[5]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_path_draws_what_the_cpu_path_draws(monkeypatch, dtype):
    specs = _specs(24)
    positions = list(range(100, 124))
    logits = (3 * torch.randn(24, 3000, generator=torch.Generator().manual_seed(1))).to(dtype)
    cpu = sample_batch(logits, SamplingBatch.build(specs, positions))  # the C++ kernels where they serve
    monkeypatch.setenv("PAT_CPU_SAMPLER", "torch")
    monkeypatch.setattr(host, "reads_are_free", lambda x: False)
    dev = sample_batch(logits, SamplingBatch.build(specs, positions))
    assert dev.tokens == cpu.tokens
    assert dev.logprobs == pytest.approx(cpu.logprobs, rel=0, abs=1e-12)  # a library log vs math.log
    assert [[i for i, _ in row] for row in dev.top] == [[i for i, _ in row] for row in cpu.top]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_builds_its_batch_and_draws_without_waiting_for_the_stream():
    """``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for every queued
    kernel; the batch's host lists go through ``host.to_device`` instead (pinned, non-blocking). Checked
    with CUDA's sync debug mode, which raises on any synchronising call."""
    from pat_engine.sampling.spec import SamplingSpec as Spec

    specs = _specs(11) + [Spec(1.0, -1, 1.0, 16, True, repetition_penalty=1.2, frequency_penalty=0.5,
                               logit_bias=((3, 2.0),), prompt_len=2)]
    histories = [None] * 11 + [[5, 6, 7, 7, 9]]
    logits = 3 * torch.randn(12, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(specs, list(range(40, 52)), [(7,)] + [()] * 11, "cuda", histories, 1000)
        out = sample_on_device(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.to_host().tokens == out.tokens.tolist() and len(out.tokens) == 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_draws_transfer_does_not_wait_for_work_queued_after_it():
    """Async scheduling launches step N+1 before reading step N's draw: the read must wait for N's copy
    only (``start_transfer`` queues it behind N's kernels, an event marks its end), not for N+1."""
    logits = torch.randn(8, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    out = sample_on_device(logits, SamplingBatch.build(_specs(8), list(range(8)), device="cuda"))
    transfer = out.start_transfer()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):  # the next step: far longer than the copy
        a = a @ a * 1e-3
    got = transfer.result()
    still_running = not torch.cuda.current_stream().query()
    assert got.tokens == out.tokens.tolist()
    assert still_running, "reading the draw waited for the work queued after its transfer"
