"""oneDNN-packed CPU GEMM weights (model/cpu_gemm.py): same products as ``F.linear``, and never stale.

The packs are derived from the plain weights, so every way the weights change (a load, an RL
update, sleep and wake-up, a layout switch) must leave the model computing with the new
weights. Float32, the only dtype that packs; the float64 exactness suite runs unpacked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import MAX_NEW, PROMPTS
from pat_engine import Engine, SamplingParams
from pat_engine.model import cpu_gemm
from pat_engine.model.arch import load_model_arch
from pat_engine.model.layers.linear import linear
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.infer_executor import InferExecutor
from rl_helpers import fresh_tensors, perturbed_checkpoint

needs_onednn = pytest.mark.skipif(not cpu_gemm.packing_enabled("cpu", torch.float32),
                                  reason="oneDNN unavailable or PAT_CPU_GEMM=torch")


def _packed_param(out_features: int, in_features: int, seed: int) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(out_features, in_features, generator=g), requires_grad=False)
    module = torch.nn.Module()
    module.weight = w
    module.is_gemm_weight = True
    assert cpu_gemm.pack(module) == 1
    return w


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 7, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_plain(rows: int, bias: bool) -> None:
    w = _packed_param(96, 64, seed=rows)
    x = torch.randn(rows, 64)
    b = torch.randn(96) if bias else None
    out = linear(x, w, b)
    assert cpu_gemm.packed_linear(x, w, b) is not None  # the packed path ran
    assert out.is_contiguous()  # row-parallel layers all-reduce it in place
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_bfloat16_is_packed_where_the_cpu_has_bfloat16_dot_products(rows: int) -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not cpu_gemm.packing_enabled("cpu", torch.bfloat16)
        pytest.skip("no native bfloat16 on this CPU: bfloat16 weights stay plain")
    g = torch.Generator().manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=g).bfloat16(), requires_grad=False)
    module = torch.nn.Module()
    module.weight, module.is_gemm_weight = w, True
    assert cpu_gemm.pack(module) == 1
    x, b = torch.randn(rows, 64).bfloat16(), torch.randn(96).bfloat16()
    out = cpu_gemm.packed_linear(x, w, b)
    assert out is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_replaced_data_is_never_served_from_the_old_pack() -> None:
    w = _packed_param(32, 16, seed=0)
    w.data = torch.randn(32, 16)  # a write behind the executor's back
    x = torch.randn(4, 16)
    assert cpu_gemm.packed_linear(x, w, None) is None
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def test_float64_is_not_packed() -> None:
    assert not cpu_gemm.packing_enabled("cpu", torch.float64)


def _executor(path: str) -> InferExecutor:
    arch = load_model_arch(path)
    ex = InferExecutor(arch, Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), torch.float32,
                       torch.device("cpu"), block_size=4, num_blocks=64)
    ex.load_weights(path)
    return ex


def _first_token(ex: InferExecutor, prompt: list[int]) -> torch.Tensor:
    """Greedy first token and its log-prob for ``prompt``, through the executor's full step."""
    greedy = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=True)
    cmd = StepCommand(step_id=0, is_prefill=True,
                      seqs=[SeqStep(seq_id=1, token_ids=list(prompt), start_pos=0, block_table=list(range(8)),
                                    sampling=greedy)])
    result = ex.execute(cmd)
    ex.seqs.clear()
    return torch.tensor([result.tokens[0], result.logprobs[0]])


@needs_onednn
def test_every_weight_write_repacks(model_dir, tmp_path: Path) -> None:
    base = model_dir("llama")
    moved = perturbed_checkpoint(base, tmp_path / "moved", seed=3, scale=0.5)
    prompt = PROMPTS[0]
    ex = _executor(base)
    assert all(hasattr(p, cpu_gemm.PACKED_ATTR) for p in cpu_gemm._gemm_weights(ex.model))
    before = _first_token(ex, prompt)
    want = _first_token(_executor(moved), prompt)
    assert not torch.equal(before, want)  # the update changes what the model computes

    ex.load_tensors(list(fresh_tensors(moved)))  # an RL weight update
    torch.testing.assert_close(_first_token(ex, prompt), want, rtol=0, atol=0)

    ex.release_memory(kv=True, weights="discarded")  # sleep, then wake up and reload the base weights
    ex.restore_memory(kv_blocks=64, weights=True)
    ex.load_weights(base)
    torch.testing.assert_close(_first_token(ex, prompt), before, rtol=0, atol=0)


@pytest.mark.slow  # starts worker processes
@needs_onednn
def test_float32_update_and_switch_equal_a_fresh_engine(model_dir, tmp_path: Path) -> None:
    """An RL update, then a stage with a live switch that reshards the new weights: the same tokens
    as a fresh engine started from the updated checkpoint with the same switch (both packed)."""
    moved = perturbed_checkpoint(model_dir("llama"), tmp_path / "moved", seed=5)
    params = [SamplingParams(max_new_tokens=m, logprobs=True) for m in MAX_NEW]
    schedule = [(3, 2)]  # TP1xDP2 -> TP2xDP1 at decode step 3

    def run(engine: Engine):
        return [o.token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False, switch_schedule=schedule, from_base_layout=True)]

    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float32") as engine:
        run(engine)
        engine.update_weights(fresh_tensors(moved))
        got = run(engine)
    with Engine(moved, tp=1, dp=2, dtype="float32") as fresh:
        want = run(fresh)
    assert got == want
