"""Where a decode step with graphs spends its wall time: the host's phases beside the GPU's busy time.

The third H100 run measured a batch-1 step at 7.04 ms in process while its decode graph replayed alone took
5.96 ms, and at batch 64 9.88 ms against 7.75: a millisecond or two a step outside the graph, that the kernel
table (eager steps) cannot place. Here a few graphs steps run under ``torch.profiler``, each inside a
``STEP`` range, and the executor's own ranges (``InferExecutor.launch``: prepare, forward, logits, sample)
give the host's time in each phase; what the step's wall time holds beyond them is the wait for the GPU and
the draw's read-back. On CUDA the kernels that start inside a step's range (the steps synchronise at both
ends) give its GPU busy time; wall minus busy is the time the GPU sat idle, waiting for the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PHASES = ("prepare", "forward", "logits", "sample")  # InferExecutor.launch's record_function ranges


@dataclass(frozen=True)
class StepPhases:
    """Medians over the profiled steps, in ms."""

    steps: int
    wall_ms: float
    phase_ms: dict[str, float]  # host time in each of ``PHASES`` (0.0 where a step had none)
    rest_ms: float  # the step's wall time outside every phase: the wait for the GPU, the read-back
    busy_ms: float | None  # GPU: kernel and copy time started inside the step (None on the CPU)
    kernels: float | None  # device events per step (a graph's kernels count where the profiler sees them)


def step_phases(events: Sequence, step_name: str, cuda: bool) -> StepPhases:
    """The phases of the steps inside ``step_name`` ranges of a profile's ``events``."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    steps = sorted((e.time_range.start, e.time_range.end) for e in cpu if e.name == step_name)
    if not steps:
        raise ValueError(f"no {step_name!r} range in the profile")

    def step_of(t: float) -> int | None:
        return next((i for i, (a, b) in enumerate(steps) if a <= t <= b), None)

    phase = {p: [0.0] * len(steps) for p in PHASES}
    for e in cpu:
        i = step_of(e.time_range.start) if e.name in PHASES else None
        if i is not None:
            phase[e.name][i] += e.time_range.elapsed_us() / 1e3
    walls = [(b - a) / 1e3 for a, b in steps]
    rests = [w - sum(phase[p][i] for p in PHASES) for i, w in enumerate(walls)]
    busy = kernels = None
    if cuda:
        ranges = {e.name for e in cpu if e.is_user_annotation}
        per_step_us, per_step_n = [0.0] * len(steps), [0] * len(steps)
        for d in events:
            if d.device_type == torch.autograd.DeviceType.CPU or d.is_user_annotation or d.name in ranges:
                continue
            i = step_of(d.time_range.start)
            if i is not None:
                per_step_us[i] += d.time_range.elapsed_us()
                per_step_n[i] += 1
        busy = statistics.median(per_step_us) / 1e3
        kernels = statistics.median(per_step_n)
    return StepPhases(len(steps), statistics.median(walls), {p: statistics.median(v) for p, v in phase.items()},
                      statistics.median(rests), busy, kernels)


def describe(s: StepPhases) -> str:
    """One paragraph for the results file."""
    host = ", ".join(f"{p} {s.phase_ms[p]:.3f}" for p in PHASES)
    text = (f"A graphs step under torch.profiler (median of {s.steps}): wall **{s.wall_ms:.3f}** ms; the host's "
            f"phases {host} ms (forward: the inputs copied into the graph's buffers and the replay launched; logits: "
            f"the LM head launched; sample: the draw launched and its copy queued); the rest, "
            f"{s.rest_ms:.3f} ms, waits for the GPU and reads the draw back.")
    if s.busy_ms is not None:
        text += (f" GPU busy {s.busy_ms:.3f} ms a step ({s.kernels:.0f} device events), idle "
                 f"{s.wall_ms - s.busy_ms:.3f} ms: the host's share of the step.")
    return text
