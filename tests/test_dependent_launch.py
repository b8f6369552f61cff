"""Programmatic dependent launch (``PAT_PDL``, pat_kernels/dependent_launch.py): asked for per executor, taken
only where the device and Triton can, scoped to the launches inside the ask.

What PDL compiles to is checked by tests/test_triton_compile.py (sm_90 PTX, no GPU) and that it changes no
bit of a step by the gpu test in tests/test_triton_layer_kernels.py; here, on the CPU, who asks and who
gets it.
"""

from __future__ import annotations

import pytest
import torch

from pat_engine import env
from pat_engine.model.arch import load_model_arch
from pat_engine.model.layers import triton_ops
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.infer_executor import InferExecutor
from triton_markers import needs_triton

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # device names only: nothing runs on them here


@pytest.fixture
def dl(monkeypatch):
    """The module, with every CUDA device taken as one that launches with PDL (an H100 with a recent Triton)."""
    from pat_kernels import dependent_launch

    monkeypatch.setattr(dependent_launch, "device_supports", lambda device: device.type == "cuda")
    return dependent_launch


@needs_triton
def test_kernels_launch_plainly_unless_asked_and_the_device_can(dl):
    assert dl.pdl_options(CUDA) == {"PDL": False}
    with dl.programmatic_launch(True):
        assert dl.pdl_options(CUDA) == {"PDL": True, "launch_pdl": True}
        assert dl.pdl_options(CPU) == {"PDL": False}
        with dl.programmatic_launch(False):
            assert dl.pdl_options(CUDA) == {"PDL": False}
        assert dl.pdl_options(CUDA)["PDL"]
    assert dl.pdl_options(CUDA) == {"PDL": False}


@needs_triton
def test_the_cpu_and_the_interpreter_never_launch_with_pdl():
    """The interpreter has no griddepcontrol: a kernel it runs must never get the flag."""
    from pat_kernels import dependent_launch
    from pat_kernels.triton_support import INTERPRETED

    assert not dependent_launch.device_supports(CPU)
    if INTERPRETED:  # conftest.py turns it on where there is no GPU
        assert not dependent_launch.device_supports(CUDA)


def test_pat_pdl_asks_for_it_on_cuda_only(monkeypatch):
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: True)
    monkeypatch.delenv("PAT_PDL", raising=False)
    assert not env.pdl_asked("cuda")  # off by default
    monkeypatch.setenv("PAT_PDL", " On ")
    assert env.pdl_asked("cuda") and not env.pdl_asked("cpu")
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: False)  # no Triton: nothing to launch with it
    assert not env.pdl_asked("cuda")


@needs_triton
def test_pdl_is_possible_on_a_device_that_can_only(dl, monkeypatch):
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: True)
    assert triton_ops.pdl_possible(CUDA) and not triton_ops.pdl_possible(CPU)
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: False)  # no Triton for CUDA tensors
    assert not triton_ops.pdl_possible(CUDA)


@needs_triton
def test_a_model_takes_pdl_where_asked_and_possible_and_says_when_it_cannot(dl, monkeypatch, caplog):
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: True)
    monkeypatch.setenv("PAT_PDL", "on")
    assert triton_ops.launches_with_pdl(CUDA) and not triton_ops.launches_with_pdl(CPU)
    monkeypatch.setattr(dl, "device_supports", lambda device: False)  # an A100, or a Triton without launch_pdl
    with caplog.at_level("WARNING", logger="pat_engine.model.layers.triton_ops"):
        assert not triton_ops.launches_with_pdl(CUDA)
    assert "launch plainly" in caplog.text
    monkeypatch.delenv("PAT_PDL")
    monkeypatch.setattr(dl, "device_supports", lambda device: True)
    assert not triton_ops.launches_with_pdl(CUDA)  # not asked


@needs_triton
def test_the_launch_policy_scopes_the_ask(dl):
    with triton_ops.launch_policy(True):
        assert dl.pdl_options(CUDA)["PDL"]
    with triton_ops.launch_policy(False):
        assert not dl.pdl_options(CUDA)["PDL"]
    assert not dl.pdl_options(CUDA)["PDL"]


@needs_triton
def test_an_executor_runs_its_steps_inside_its_own_ask(model_dir, dl, monkeypatch):
    """The forward (where the kernels launch and graphs capture them) sees what ``InferExecutor.pdl`` says, each
    step anew, and nothing leaks out of the step."""
    path = model_dir("llama")
    ex = InferExecutor(load_model_arch(path), Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), torch.float32,
                       CPU, block_size=4, num_blocks=32)
    ex.load_weights(path)
    assert not ex.pdl  # PAT_PDL asks CUDA models only
    seen = []
    forward = ex.model.forward

    def spying(*args, **kwargs):
        seen.append(dl.pdl_options(CUDA)["PDL"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(ex.model, "forward", spying)
    greedy = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=False)
    for step, pdl in enumerate((True, False, True)):
        ex.pdl = pdl
        ex.execute(StepCommand(step, True, [SeqStep(step, [3, 5, 7], 0, [step], sampling=greedy)]))
    assert seen == [True, False, True] and not dl.pdl_options(CUDA)["PDL"]
