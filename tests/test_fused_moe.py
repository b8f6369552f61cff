"""The fused Triton experts (pat_kernels/fused_moe.py) under Triton's CPU interpreter: the grouping of rows by
expert (on the meta device too: nothing read on the host), the kernels against the per-expert torch path, a
row's bits whatever the batch, the rule for when a layer takes them (and CUDA graphs with it), the weight
tables after a write that moves the weights, and (slow tier) a model's tokens through them, eager, through
the decode graphs' stand-in and across live switches; ``gpu``: compiled, captured in a CUDA graph, no host
sync.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams
from pat_engine.config import EngineConfig
from pat_engine.model.arch import load_model_arch
from pat_engine.model.layers.moe import SparseMoE, refresh_expert_tables, route
from pat_engine.model.weights import load_shard_from_tensors
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model
from thread_ranks import single_rank

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = TinyModelSpec(arch="qwen3_moe", num_layers=2, num_kv_heads=2, num_experts=16, experts_per_token=4,
                     moe_intermediate_size=128, seed=11)


SHORT = [m // 2 for m in MAX_NEW]  # the slow tier's responses: every step of every expert runs in numpy


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("fused_moe"), SPEC))


@pytest.fixture
def fused_on(monkeypatch):
    monkeypatch.setenv("PAT_FUSED_MOE", "on")


def _layer(path: str, dtype: torch.dtype, device: str = DEV, row_chunks: int | None = None) -> SparseMoE:
    """Layer 0's experts (TP1), loaded by the engine's loader; fused or not as ``PAT_FUSED_MOE`` says now."""
    holder = nn.Module()
    holder.layers = nn.ModuleList([nn.Module()])
    holder.layers[0].mlp = SparseMoE(load_model_arch(path), 1, dtype, device, row_chunks)
    tensors = load_file(str(Path(path, "model.safetensors")))
    load_shard_from_tensors(holder, [(n, t.to(dtype)) for n, t in tensors.items() if n.startswith("model.layers.0.mlp.")],
                            0, 1)
    return holder.layers[0].mlp


def _hidden(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, SPEC.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


# ---- the grouping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,top_k,num_experts,bm", [(1, 4, 16, 16), (9, 2, 8, 16), (70, 4, 16, 32), (3, 8, 64, 16)])
def test_align_puts_every_row_once_in_blocks_of_its_expert(tokens, top_k, num_experts, bm):
    from pat_kernels.fused_moe import align, padded_rows

    g = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k].sort().values for _ in range(tokens)])
    sorted_rows, block_expert = align(experts, num_experts, bm)
    n = tokens * top_k
    assert sorted_rows.numel() == padded_rows(n, num_experts, bm) == block_expert.numel() * bm
    real = sorted_rows[sorted_rows < n]
    assert sorted(real.tolist()) == list(range(n))  # each row once; the rest is padding (= n)
    flat = experts.flatten()
    last = -1
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_rows[b * bm : (b + 1) * bm]
        rows = rows[rows < n]
        if e < 0:
            assert rows.numel() == 0  # past the last group
            continue
        assert e >= last and rows.numel() > 0 and bool((flat[rows.long()] == e).all())
        assert rows.tolist() == sorted(rows.tolist())  # a token's rows keep their order
        last = e


def test_routing_and_grouping_read_nothing_on_the_host(moe_path):
    """On the meta device a tensor has no values, so any host read would raise: sizes follow from shapes."""
    from pat_kernels.fused_moe import align, padded_rows

    weights, experts = route(torch.empty(5, 16, device="meta"), load_model_arch(moe_path).moe)
    sorted_rows, block_expert = align(experts, 16, 16)
    assert weights.shape == experts.shape == (5, 4) and sorted_rows.shape == (padded_rows(20, 16, 16),) == (272,)
    assert block_expert.shape == (272 // 16,)


# ---- the kernels -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,per_sm", [(torch.float32, 2), pytest.param(torch.float32, 64, marks=pytest.mark.slow),
                                           pytest.param(torch.bfloat16, 2, marks=pytest.mark.slow)])
def test_the_kernels_compute_what_the_experts_compute_in_turn(moe_path, dtype, per_sm, monkeypatch):
    """At the interpreter's tiles (64 columns a program) and at the narrowest (16: as many programs as an H100
    wants of a decode step)."""
    from pat_kernels import fused_moe

    monkeypatch.setattr(fused_moe, "PROGRAMS_PER_SM", per_sm)
    monkeypatch.setenv("PAT_FUSED_MOE", "off")
    in_turn = _layer(moe_path, dtype)
    monkeypatch.setenv("PAT_FUSED_MOE", "on")
    fused = _layer(moe_path, dtype)
    assert fused.fused and not in_turn.fused
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for tokens in (0, 1, 6, 50):  # 50 x 4 rows over 16 experts: blocks of 16 and of 32 rows
        x = _hidden(tokens, dtype, seed=tokens)
        torch.testing.assert_close(fused(x, single_rank()), in_turn(x, single_rank()), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_a_rows_bits_do_not_follow_the_batch(moe_path, dtype, fused_on):
    """The kernels' output for a token, given its routing, alone, in a batch, in another order (the router's
    own GEMM is the layer's linear, whose CPU kernel follows the row count: the routing is taken once)."""
    from pat_kernels.fused_moe import routed_experts

    layer = _layer(moe_path, dtype)
    x = _hidden(9, dtype, seed=3)
    weights, experts = route(layer.gate(x), layer.spec)
    weights = weights.to(dtype)

    def run(rows) -> torch.Tensor:
        return routed_experts(x[rows], weights[rows], experts[rows], *layer.expert_tables, 128)

    batched = run(slice(None))
    for i in (0, 4, 8):
        assert torch.equal(run(slice(i, i + 1)), batched[i : i + 1])
    reordered = torch.tensor([8, 2, 5, 0, 7, 1, 6, 3, 4])
    assert torch.equal(run(reordered), batched[reordered])


def test_the_tiles_follow_the_step():
    from pat_kernels.fused_moe import block_m, block_n

    # Qwen3-30B-A3B (128 experts, 8 a token, 768 wide, hidden 2048): one token, 8, 64, a prefill chunk
    assert [block_m(t * 8, 128) for t in (1, 8, 64, 2048)] == [16, 16, 16, 64]
    h100 = 2 * 132
    assert [block_n(t * 8, 128, 768, h100) for t in (1, 8, 64)] == [16, 64, 64]  # 8 blocks x 48 tiles of 16
    assert block_n(8, 128, 2048, h100) == 32 and block_n(64, 128, 2048, h100) == 64  # the down kernel's
    assert block_n(8, 128, 768, 2 * 4) == 64  # the interpreter's grid is a loop: wide tiles


def test_the_kernels_refuse_a_bad_shape(moe_path, fused_on):
    from pat_kernels.fused_moe import routed_experts

    layer = _layer(moe_path, torch.float32)
    x = _hidden(3, torch.float32)
    weights, experts = route(layer.gate(x), layer.spec)
    gate_up, down = layer.expert_tables
    with pytest.raises(ValueError, match="must be \\(T, k\\)"):
        routed_experts(x, weights[:2], experts[:2], gate_up, down, 128)
    with pytest.raises(ValueError, match="unit stride"):
        routed_experts(x.t().contiguous().t(), weights, experts, gate_up, down, 128)


# ---- when a layer takes them ---------------------------------------------------------------------------


def test_the_rule_decides_the_layer_and_the_graphs(moe_path, monkeypatch):
    arch = load_model_arch(moe_path)
    monkeypatch.setenv("PAT_FUSED_MOE", "auto")
    assert not arch.routes_on_host("cuda", "fast", torch.bfloat16)  # the default on CUDA
    assert arch.routes_on_host("cuda", "invariant", torch.bfloat16)  # the invariant tree stays per row
    assert arch.routes_on_host("cuda", "fast", torch.float64)  # tl.dot has no float64
    assert arch.routes_on_host("cpu", "fast", torch.float32)  # the CPU's own kernel, unless asked
    assert EngineConfig(moe_path, device="cuda").graphs(arch) == "cuda"
    assert EngineConfig(moe_path, device="cuda", numerics="invariant").graphs(arch) is None
    monkeypatch.setenv("PAT_FUSED_MOE", "off")
    assert arch.routes_on_host("cuda", "fast", torch.bfloat16)
    assert EngineConfig(moe_path, device="cuda").graphs(arch) is None
    assert EngineConfig(moe_path, device="cuda").decode_graph_ladder(arch) == ()
    monkeypatch.setenv("PAT_FUSED_MOE", "on")
    assert _layer(moe_path, torch.float32).fused and not _layer(moe_path, torch.float32, row_chunks=4).fused
    assert not _layer(moe_path, torch.float64).fused


def test_the_tables_follow_weights_that_moved(moe_path, fused_on):
    """A switch or a wake-up gives a weight new storage (``p.data = ...``); the tables are updated in place."""
    layer = _layer(moe_path, torch.float32)
    table = layer.expert_tables
    x = _hidden(5, torch.float32, seed=1)
    before = layer(x, single_rank())
    for expert in layer.experts:
        for p in expert.parameters():
            p.data = p.data.clone()
    refresh_expert_tables(layer)
    assert layer.expert_tables is table
    assert table[0, 3].item() == layer.experts[3].gate_up_proj.weight.data_ptr()
    assert table[1, 15].item() == layer.experts[15].down_proj.weight.data_ptr()
    assert torch.equal(layer(x, single_rank()), before)


# ---- a model through them ----------------------------------------------------------------------------


@pytest.mark.slow  # every expert's GEMMs run in numpy
def test_a_model_through_the_fused_experts_gives_transformers_tokens(moe_path, fused_on):
    """Float32, greedy, one in-process worker: eager and through the decode graphs' stand-in, the tokens of
    transformers in float64."""
    from local_workers import local_driver

    expected = hf_greedy_batch(moe_path, PROMPTS, SHORT)
    greedy = [SamplingParams(max_new_tokens=m) for m in SHORT]
    for config in (dict(enforce_eager=True), dict(graph_backend="standin", max_graph_batch=8)):
        driver = local_driver(moe_path, dtype="float32", **config)
        assert [f[0].output_ids for f in driver.generate(PROMPTS, greedy)] == expected, config


@pytest.mark.slow  # worker processes, every expert's GEMMs in numpy
def test_live_switches_reshard_what_the_fused_experts_read(moe_path, fused_on):
    """Float32, greedy: TP1xDP2 -> TP2 -> TP1xDP2 mid-batch (the experts resharded into new storage, the tables
    refreshed by the weight write), both KV paths: the tokens of transformers in float64."""
    expected = hf_greedy_batch(moe_path, PROMPTS, SHORT)
    greedy = [SamplingParams(max_new_tokens=m) for m in SHORT]
    with Engine(moe_path, tp=1, dp=2, dtype="float32") as engine:
        for kv in ("migrate", "recompute"):
            outs = engine.generate(PROMPTS, greedy, switch_schedule=[(4, 2), (11, 1)], kv_transfer=kv, use_tqdm=False)
            assert [o.token_ids for o in outs] == expected, kv
        assert [e.to_layout for e in engine.switches[-2:]] == ["TP2xDP1", "TP1xDP2"]


# ---- on a GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_graph_captures_the_fused_layer_without_a_host_sync(moe_path):
    layer = _layer(moe_path, torch.bfloat16, "cuda")
    assert layer.fused
    x = _hidden(8, torch.bfloat16, seed=2)
    eager = layer(x, single_rank())
    torch.cuda.set_sync_debug_mode("error")  # any host read of a device value raises
    try:
        layer(x, single_rank())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, single_rank())
    graph.replay()
    assert torch.equal(out, eager)
    x.copy_(_hidden(8, torch.bfloat16, seed=3))  # another routing through the same graph
    graph.replay()
    assert torch.equal(out, layer(x, single_rank()))
