"""Routed experts (Qwen3-MoE, model/layers/moe.py): read from HF configs and checkpoints, the layer equal to
transformers' block, the invariant mode's bits the same at every TP and in any batch, and (slow tier) engines
token for token with transformers in float64 under every kind of layout and live switches.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import MAX_NEW, PROMPTS, SPECS, hf_greedy_batch
from pat_engine import Engine, SamplingParams, reference_logprobs
from pat_engine.errors import LayoutError, ModelLoadError
from pat_engine.model.arch import MoESpec, arch_from_hf_config, load_model_arch
from pat_engine.model.layers.moe import SparseMoE, route
from pat_engine.model.weights import hf_to_local, load_shard_from_tensors
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model
from thread_ranks import run_ranks, single_rank

try:
    from pat_kernels.cpu_moe import experts as EXPERTS  # the kernel's entry, before a test wraps it
except ImportError:  # pragma: no cover
    EXPERTS = None

# 16 experts, 4 per token, experts 128 wide (chunks of 32 at max_tp 4), every layer sparse (conftest's qwen3_moe
# keeps a dense layer 1)
SPEC = TinyModelSpec(arch="qwen3_moe", num_layers=2, num_kv_heads=2, num_experts=16, experts_per_token=4,
                     moe_intermediate_size=128, seed=11)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("moe"), SPEC))


def _config(path: str) -> dict:
    return json.loads(Path(path, "config.json").read_text())


# ---- the configuration -----------------------------------------------------------------------------


def test_experts_are_read_from_the_config(moe_path):
    arch = load_model_arch(moe_path)
    assert arch.moe is not None and arch.qk_norm and arch.routes_on_host("cpu", "fast", torch.float32)
    assert (arch.moe.num_experts, arch.moe.experts_per_token, arch.moe.intermediate_size) == (16, 4, 128)
    assert arch.moe.norm_topk_prob and arch.moe.dense_layers == ()
    cfg = _config(moe_path)
    # transformers >= 5 writes num_local_experts; HF's rule for dense layers: mlp_only_layers, or a layer
    # whose number is not a multiple of decoder_sparse_step
    v5 = {k: v for k, v in cfg.items() if k != "num_experts"} | {"num_local_experts": 16, "num_hidden_layers": 6,
                                                                  "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = arch_from_hf_config(v5).moe
    assert spec.num_experts == 16 and spec.dense_layers == (0, 2, 3, 4)
    assert [arch_from_hf_config(v5).is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert arch_from_hf_config(cfg | {"architectures": ["Qwen3ForCausalLM"]}).moe is None


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 17}, "num_experts_per_tok=17 exceeds num_experts=16"),
    ({"num_experts": 0}, "num_experts must be a positive integer"),
    ({"moe_intermediate_size": "128"}, "moe_intermediate_size must be a positive integer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive integer, got None"),
])
def test_a_bad_expert_config_is_refused_by_name(moe_path, change, message):
    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config(_config(moe_path) | change)


def test_a_tp_must_divide_the_experts_width(moe_path):
    arch = arch_from_hf_config(_config(moe_path) | {"moe_intermediate_size": 90})
    assert [layout.tp for layout in arch.valid_layouts(8)] == [1, 2]  # 90 = 2 * 45: no TP4 or TP8
    with pytest.raises(LayoutError, match="tp=4 does not divide moe_intermediate_size=90"):
        arch.layout(4, 4)
    assert arch.reduction_width(8) == 2
    # every layer sparse: the dense MLP's width (never built) does not limit the TP
    assert [layout.tp for layout in arch_from_hf_config(_config(moe_path) | {"intermediate_size": 90})
            .valid_layouts(8)] == [1, 2, 4, 8]


def test_expert_tensors_map_onto_the_fused_local_parameters():
    assert hf_to_local("model.layers.3.mlp.experts.17.gate_proj.weight") == ("layers.3.mlp.experts.17.gate_up_proj.weight", 0)
    assert hf_to_local("model.layers.3.mlp.experts.17.up_proj.weight") == ("layers.3.mlp.experts.17.gate_up_proj.weight", 1)
    assert hf_to_local("model.layers.3.mlp.experts.17.down_proj.weight") == ("layers.3.mlp.experts.17.down_proj.weight", None)
    assert hf_to_local("model.layers.3.mlp.gate.weight") == ("layers.3.mlp.gate.weight", None)


# ---- the layer ------------------------------------------------------------------------------------


def _layer(path: str, rank: int, tp: int, dtype: torch.dtype, row_chunks: int | None) -> SparseMoE:
    """Layer 0's experts, rank ``rank``'s shard of TP ``tp``, loaded by the engine's loader from the checkpoint."""
    arch = load_model_arch(path)
    holder = nn.Module()  # named as in the model, so the checkpoint's names find the parameters
    holder.layers = nn.ModuleList([nn.Module()])
    holder.layers[0].mlp = SparseMoE(arch, tp, dtype, "cpu", row_chunks)
    tensors = load_file(str(Path(path, "model.safetensors")))
    named = [(n, t.to(dtype)) for n, t in tensors.items() if n.startswith("model.layers.0.mlp.")]
    assert len(load_shard_from_tensors(holder, named, rank, tp)) == 1 + 3 * arch.moe.num_experts
    return holder.layers[0].mlp


def _hidden(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, SPEC.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_layer_computes_transformers_block(moe_path, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_path, dtype=dtype, experts_implementation="eager").eval()
    x = _hidden(23, dtype)
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x[None])[0]
    got = _layer(moe_path, 0, 1, dtype, None)(x, single_rank())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_computes_what_the_experts_compute_in_turn(moe_path, dtype, monkeypatch):
    """Fast mode over oneDNN's packs: the kernel (each core whole experts) within rounding of the experts run
    one after another through ``layers/linear.py``, at a few rows and at many; a step of one row an expert
    (a token alone) stays with the latter."""
    from pat_engine.model import cpu_gemm
    from pat_kernels import cpu_moe

    layer = _layer(moe_path, 0, 1, dtype, None)
    if not cpu_gemm.packing_enabled("cpu", dtype) or not cpu_moe.usable(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"no oneDNN pack or CPU kernel for {dtype} here")
    assert cpu_gemm.pack(layer) == 1 + 2 * SPEC.num_experts
    calls, served = [], []
    monkeypatch.setattr(cpu_moe, "experts", lambda *a: calls.append(len(a[1])) or EXPERTS(*a))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for tokens in (1, 6, 50):
        x = _hidden(tokens, dtype, seed=tokens)
        chosen = route(layer.gate(x), layer.spec)[1].flatten()
        served.append(chosen.unique().numel() < chosen.numel())  # some expert has two rows: the kernel's case
        with torch.inference_mode():  # as a worker's steps run: the kernel's threads take the caller's mode
            fused = layer(x, single_rank())
        monkeypatch.setenv(cpu_moe.ENV_SWITCH, "torch")
        in_turn = layer(x, single_rank())
        monkeypatch.delenv(cpu_moe.ENV_SWITCH)
        torch.testing.assert_close(fused, in_turn, **tol)
    assert served == [False, True, True] and len(calls) == 2 and calls[-1] > 8, (served, calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_one_thread_the_cpu_kernel_has_the_bits_of_the_experts_in_turn(moe_path, dtype, monkeypatch):
    """The same operations in the same order: the packs' GEMMs at each expert's row count, SiLU-mul with the
    formula's bits, the weight in the dtype, a token's shares added from zero in ascending expert order (the
    kernel gathers and adds up itself). One thread, so each of the torch path's GEMMs runs as the kernel's do,
    and the torch path's experts of one or two rows through their packs too, not the skinny GEMM."""
    from pat_engine.model import cpu_gemm
    from pat_kernels import cpu_moe, cpu_skinny_gemm

    layer = _layer(moe_path, 0, 1, dtype, None)
    if not cpu_gemm.packing_enabled("cpu", dtype) or not cpu_moe.usable(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"no oneDNN pack or CPU kernel for {dtype} here")
    cpu_gemm.pack(layer)
    monkeypatch.setenv(cpu_skinny_gemm.ENV_SWITCH, "torch")
    monkeypatch.setattr(cpu_gemm, "expert_rows", lambda rows: rows)  # each expert's own row count, as in turn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for tokens in (6, 50, 200):
            x = _hidden(tokens, dtype, seed=tokens + 1)
            with torch.inference_mode():
                fused = layer(x, single_rank())
                monkeypatch.setenv(cpu_moe.ENV_SWITCH, "torch")
                in_turn = layer(x, single_rank())
                monkeypatch.delenv(cpu_moe.ENV_SWITCH)
            assert torch.equal(fused, in_turn), (tokens, (fused - in_turn).abs().max())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_runs_each_experts_gemms_on_its_rounded_rows(moe_path, dtype, monkeypatch):
    """Each expert's GEMMs run on ``cpu_gemm.expert_rows`` of its rows (zeros appended: few distinct row counts,
    so oneDNN builds few kernels), and only its own rows come back: within rounding of the rows run as given
    (on this host's oneDNN, the same bits)."""
    from pat_engine.model import cpu_gemm
    from pat_kernels import cpu_moe

    layer = _layer(moe_path, 0, 1, dtype, None)
    if not cpu_gemm.packing_enabled("cpu", dtype) or not cpu_moe.usable(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"no oneDNN pack or CPU kernel for {dtype} here")
    cpu_gemm.pack(layer)
    rule, seen = cpu_gemm.expert_rows, []
    monkeypatch.setattr(cpu_moe, "experts", lambda *a: seen.append((a[5], a[6])) or EXPERTS(*a))
    x = _hidden(300, dtype, seed=9)  # 1200 rows over 16 experts: every expert above the exact range
    with torch.inference_mode():
        rounded = layer(x, single_rank())
        monkeypatch.setattr(cpu_gemm, "expert_rows", lambda rows: rows)
        exact = layer(x, single_rank())
    (offsets, gemm_rows), (_, exact_rows) = seen
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    assert gemm_rows == [rule(n) for n in counts]
    assert exact_rows == counts and any(r > n for r, n in zip(gemm_rows, counts))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rounded, exact, **tol)


def test_expert_rows_round_up_by_at_most_a_sixteenth():
    from pat_engine.model.cpu_gemm import EXACT_EXPERT_ROWS, expert_rows

    rounded = [expert_rows(n) for n in range(1, 4097)]
    assert all(n <= r <= n * 17 / 16 for n, r in zip(range(1, 4097), rounded))
    assert rounded[:EXACT_EXPERT_ROWS - 1] == list(range(1, EXACT_EXPERT_ROWS))
    for low in (32, 64, 128, 256, 512, 1024, 2048):  # at most 16 row counts an octave
        assert len({expert_rows(n) for n in range(low, 2 * low)} - {2 * low}) <= 16
    assert all(expert_rows(r) == r for r in rounded)  # a rounded count is its own rounding


def test_the_cpu_kernel_refuses_bad_arguments():
    from pat_kernels import cpu_moe

    if not cpu_moe.usable(torch.zeros(1, 1)):
        pytest.skip("no CPU kernels here")
    x, w = torch.randn(2, 8), torch.ones(2, 2)  # two tokens, two choices each: four grouped rows
    gate_up, down = [torch.randn(6, 8)], [torch.randn(8, 3)]
    order = torch.tensor([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="offsets must span the rows"):
        cpu_moe.experts(x, order, w, gate_up, down, [0, 3])
    with pytest.raises(RuntimeError, match="one gate_up and one down pack per expert"):
        cpu_moe.experts(x, order, w, gate_up, down, [0, 2, 4])
    with pytest.raises(RuntimeError, match="a permutation"):
        cpu_moe.experts(x, torch.tensor([0, 1, 1, 3]), w, gate_up, down, [0, 4])
    with pytest.raises(RuntimeError, match="order must be"):
        cpu_moe.experts(x, order[:3], w, gate_up, down, [0, 3])
    with pytest.raises(RuntimeError, match="weights must be"):
        cpu_moe.experts(x, order, w.double(), gate_up, down, [0, 4])
    with pytest.raises(RuntimeError, match="gemm_rows must hold"):
        cpu_moe.experts(x, order, w, gate_up, down, [0, 4], [3])


@pytest.mark.parametrize("row_chunks", [None, 4])
def test_a_step_without_tokens_gives_nothing(moe_path, row_chunks):
    out = _layer(moe_path, 0, 1, torch.float32, row_chunks)(_hidden(0, torch.float32), single_rank())
    assert out.shape == (0, SPEC.hidden_size) and out.dtype == torch.float32


def test_routing_takes_the_softmax_best_renormalised_in_expert_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]], dtype=torch.bfloat16)
    weights, experts = route(logits, MoESpec(num_experts=4, experts_per_token=2, intermediate_size=8,
                                             norm_topk_prob=True))
    assert experts.tolist() == [[1, 3], [0, 3]]  # the two best, ascending
    probs = torch.softmax(logits.float(), dim=-1)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights[0], probs[0, [1, 3]] / probs[0, [1, 3]].sum())
    raw, _ = route(logits, MoESpec(num_experts=4, experts_per_token=2, intermediate_size=8, norm_topk_prob=False))
    torch.testing.assert_close(raw[1], probs[1, [0, 3]])


def _tp_outputs(path: str, tp: int, x: torch.Tensor, row_chunks: int | None) -> list[torch.Tensor]:
    return run_ranks(tp, lambda r, group: _layer(path, r, tp, x.dtype, row_chunks)(x, group))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_experts_have_the_same_bits_at_every_tp_and_in_any_batch(moe_path, dtype):
    x = _hidden(19, dtype, seed=1)
    outs = {tp: _tp_outputs(moe_path, tp, x, row_chunks=4) for tp in (1, 2, 4)}
    for tp, ranks in outs.items():
        assert all(torch.equal(o, outs[1][0]) for o in ranks), f"TP{tp} differs from TP1"
    layer = _layer(moe_path, 0, 1, dtype, 4)
    group = single_rank()
    alone = torch.cat([layer(x[i : i + 1], group) for i in range(x.shape[0])])
    assert torch.equal(alone, outs[1][0]), "a token alone differs from the same token in a batch"
    reordered = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x[reordered], group), outs[1][0][reordered])
    fast = {tp: _tp_outputs(moe_path, tp, x, row_chunks=None)[0] for tp in (1, 2, 4)}
    assert not all(torch.equal(fast[tp], fast[1]) for tp in (2, 4))  # without the mode the TP shows


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_worker_alone_equals_batched_equals_graphs_equals_reference(moe_path, dtype):
    """The real driver over one in-process worker (invariant): requests alone, all together, through the decode
    graphs' stand-in, and ``reference_logprobs``: the same tokens and log-probs, greedy and seeded."""
    from local_workers import local_driver

    prompts = [[(31 * i + 7 * j) % 380 + 5 for j in range(2 + (17 * i) % 23)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=5 + i % 3, ignore_eos=True, logprobs=True, seed=50 + i,
                             temperature=float(i % 2)) for i in range(8)]

    def run(d, which: list[int]) -> list:
        families = d.generate([prompts[i] for i in which], [params[i] for i in which])
        return [(f[0].output_ids, f[0].logprobs) for f in families]

    eager = local_driver(moe_path, dtype=dtype, numerics="invariant", enforce_eager=True)
    alone = [run(eager, [i])[0] for i in (0, 1)]
    batched = run(eager, list(range(8)))
    assert alone == batched[:2]
    graphs = local_driver(moe_path, dtype=dtype, numerics="invariant", graph_backend="standin", max_graph_batch=8)
    assert run(graphs, list(range(8))) == batched
    ref = reference_logprobs(moe_path, [(p, toks) for p, (toks, _) in zip(prompts, batched)], dtype=dtype)
    assert ref == [lps for _, lps in batched]


# ---- slow tier: engines ----------------------------------------------------------------------------


@pytest.mark.slow
def test_every_kind_of_layout_and_switch_matches_transformers(model_dir):
    """float64, greedy: TP1, TP2, DP2 and TP1xDP2 -> TP2 -> TP1xDP2 mid-batch, both KV paths."""
    path = model_dir("qwen3_moe")
    expected = hf_greedy_batch(path)
    greedy = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    for tp, dp in [(1, 1), (2, 1)]:
        with Engine(path, tp=tp, dp=dp, dtype="float64") as engine:
            assert [o.token_ids for o in engine.generate(PROMPTS, greedy, use_tqdm=False)] == expected, f"TP{tp}xDP{dp}"
    with Engine(path, tp=1, dp=2, dtype="float64") as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy, use_tqdm=False)] == expected, "TP1xDP2"
        for kv in ("migrate", "recompute"):
            outs = engine.generate(PROMPTS, greedy, switch_schedule=[(4, 2), (11, 1)], kv_transfer=kv, use_tqdm=False)
            assert [o.token_ids for o in outs] == expected, kv
        assert [e.to_layout for e in engine.switches[-2:]] == ["TP2xDP1", "TP1xDP2"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_invariant_switches_give_the_same_bits_as_the_trainer(moe_path, dtype):
    """Seeded sampling, n=2, temperature 1: TP1xDP2, TP2, a live switch each way; = ``reference_logprobs``."""
    prompts = [list(range(40, 58)) + [100 + i, 7 * i + 3] for i in range(4)] + [[5, 6, 7], [300, 12, 13]]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, logprobs=True, n=2, seed=80 + i,
                             temperature=1.0) for i in range(len(prompts))]

    def run(engine: Engine, start_tp: int, schedule=None, kv=None) -> list:
        engine.reconfigure(tp=start_tp)
        outs = engine.generate(prompts, params, switch_schedule=schedule, kv_transfer=kv, use_tqdm=False)
        return [[(s.token_ids, s.logprobs) for s in o.samples] for o in outs]

    with Engine(moe_path, tp=1, dp=2, dtype=dtype, numerics="invariant") as engine:
        runs = {"TP1xDP2": run(engine, 1), "TP2xDP1": run(engine, 2),
                "switch TP1->TP2 migrate": run(engine, 1, [(4, 2)], "migrate"),
                "switch TP2->TP1 recompute": run(engine, 2, [(7, 1)], "recompute")}
    base = runs["TP1xDP2"]
    assert all(run_ == base for run_ in runs.values()), [name for name, run_ in runs.items() if run_ != base]
    pairs = [(p, tokens) for p, samples in zip(prompts, base) for tokens, _ in samples]
    assert reference_logprobs(moe_path, pairs, dtype=dtype, world=2) == [lps for s in base for _, lps in s]


@pytest.mark.slow
def test_update_weights_reaches_every_expert(model_dir, tmp_path):
    """A trainer's update (HF names, every expert of every layer) gives what transformers gives on it."""
    path = model_dir("qwen3_moe")
    other = str(write_tiny_model(tmp_path / "other", replace(SPECS["qwen3_moe"], seed=12)))
    greedy = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    with Engine(path, tp=1, dp=2, dtype="float64") as engine:
        engine.reconfigure(tp=2)
        engine.update_weights(load_file(str(Path(other, "model.safetensors"))).items())
        got = [o.token_ids for o in engine.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == hf_greedy_batch(other) != hf_greedy_batch(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_experts_give_transformers_tokens(model_dir, monkeypatch):
    """Float32 on one GPU: through the fused experts and the decode graphs (the default), and per expert,
    eagerly (``PAT_FUSED_MOE=off``), the tokens of transformers in float64; invariant bfloat16 (per expert,
    eager) alone = batched."""
    path = model_dir("qwen3_moe")
    greedy = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
    for fused in ("auto", "off"):
        monkeypatch.setenv("PAT_FUSED_MOE", fused)
        with Engine(path, device="cuda", dtype="float32") as engine:
            assert [o.token_ids for o in engine.generate(PROMPTS, greedy, use_tqdm=False)] == hf_greedy_batch(path)
    params = [SamplingParams(max_new_tokens=m, temperature=1.0, seed=5 + i, logprobs=True)
              for i, m in enumerate(MAX_NEW)]
    with Engine(path, device="cuda", dtype="bfloat16", numerics="invariant") as engine:
        batched = [(o.token_ids, o.logprobs) for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        alone = [(o.token_ids, o.logprobs) for i in (0, 1)
                 for o in engine.generate([PROMPTS[i]], params[i], use_tqdm=False)]
    assert alone == batched[:2]
