"""The Triton layer kernels (RMSNorm with the residual add, q/k norm + rotary + KV write, SiLU-mul)
against the torch formulas they replace, run by Triton's CPU interpreter; and a model built with them.

Bitwise where the kernel's contract says so (rotary and the KV write: elementwise, every product
and sum rounded as torch rounds it; bfloat16 norms and SiLU-mul, whose float32 inside rounds away
the order of one sum). Within float32 rounding where the interpreter's numpy differs from torch
(the order of the norm's sum of squares, numpy's ``exp``). Always bitwise: a row alone equals the
same row in a batch (batch invariance). The model tests compare greedy tokens with the default
CPU path (slow tier: every kernel runs in numpy). ``gpu`` tests repeat the formulas compiled.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import MAX_NEW, PROMPTS
from pat_engine.model.arch import load_model_arch
from pat_engine.model.layers import triton_ops
from pat_engine.model.llama import ForwardContext
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.infer_executor import InferExecutor

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift).to(dtype).to(DEV)


def norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, as pat_engine/model/layers/norm.py writes it."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotary_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _close(dtype: torch.dtype) -> dict:
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-8)


# ---- RMSNorm --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 128])  # 96: the row is padded to 128 inside the program
def test_add_rms_norm_is_the_formula_and_batch_invariant(dtype, width):
    from pat_kernels.triton_norm import add_rms_norm, rms_norm

    x, residual = _randn(9, width, seed=1, dtype=dtype, scale=3), _randn(9, width, seed=2, dtype=dtype)
    weight = _randn(width, seed=3, dtype=dtype, scale=0.1, shift=1.0)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)  # the residual stream, rounded as torch rounds it
    want = norm_formula(x + residual, weight, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, want)
    torch.testing.assert_close(normed, want, **_close(dtype))
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), norm_formula(x, weight, 1e-6), **_close(dtype))
    for row in (0, 4, 8):  # a row alone: the same bits as inside the batch
        alone, alone_sum = add_rms_norm(x[row : row + 1], residual[row : row + 1], weight, 1e-6)
        assert torch.equal(alone[0], normed[row]) and torch.equal(alone_sum[0], summed[row])


def test_rms_norm_reads_strided_rows_and_empty_batches():
    from pat_kernels.triton_norm import rms_norm

    wide = _randn(5, 256, seed=4, dtype=torch.float32)
    weight = _randn(128, seed=5, dtype=torch.float32)
    assert torch.equal(rms_norm(wide[:, :128], weight, 1e-5), rms_norm(wide[:, :128].contiguous(), weight, 1e-5))
    assert rms_norm(wide[:0, :128], weight, 1e-5).shape == (0, 128)


# ---- SiLU-mul -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_formula(dtype):
    from pat_kernels.triton_activation import silu_and_mul

    gate_up = _randn(7, 2 * 1100, seed=6, dtype=dtype, scale=4)  # 1100 columns: two programs a row, the second partial
    got = silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, **_close(dtype))
    assert torch.equal(silu_and_mul(gate_up[3:4])[0], got[3])


# ---- rotary + KV write ------------------------------------------------------------------------------------------


def _rope_tables(positions: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(positions)[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 24)])  # d 24: padded inside, half 12
def test_rotary_kv_write_is_the_formula(dtype, qk_norm, heads, kv_heads, d):
    from pat_kernels.triton_rotary import rotary_kv_write

    t, page, blocks = 5, 4, 6
    qkv = _randn(t, (heads + 2 * kv_heads) * d, seed=7, dtype=dtype, scale=2)
    positions = torch.tensor([0, 3, 17, 4, 9], device=DEV)
    cos, sin = _rope_tables(32, d, dtype)
    slots = torch.tensor([5, 0, 22, 13], device=DEV)  # the fifth row is decode padding: it writes nothing
    q_w = _randn(d, seed=8, dtype=dtype, scale=0.2, shift=1.0) if qk_norm else None
    k_w = _randn(d, seed=9, dtype=dtype, scale=0.2, shift=1.0) if qk_norm else None
    cache = torch.zeros(2, blocks, page, kv_heads, d, dtype=dtype, device=DEV)
    work = qkv.clone()
    q = rotary_kv_write(work, heads, kv_heads, positions, cos, sin, cache, slots, q_w, k_w, 1e-6)
    assert q.data_ptr() == work.data_ptr() and q.shape == (t, heads, d)  # rotated in place, a view

    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    if qk_norm:
        qk = torch.cat((norm_formula(qk[:, :heads], q_w, 1e-6), norm_formula(qk[:, heads:], k_w, 1e-6)), dim=1)
    want = rotary_formula(qk, cos[positions][:, None], sin[positions][:, None])
    keys, values = cache[0].view(-1, kv_heads, d), cache[1].view(-1, kv_heads, d)
    written = torch.zeros(blocks * page, dtype=torch.bool, device=DEV).index_fill_(0, slots, True)
    assert not keys[~written].any() and not values[~written].any()
    assert torch.equal(values[slots], v[:4])
    exact = not qk_norm or dtype == torch.bfloat16  # the norm's float32 sum: numpy's order here
    if exact:
        assert torch.equal(q, want[:, :heads]) and torch.equal(keys[slots], want[:4, heads:])
    torch.testing.assert_close(q, want[:, :heads], **_close(dtype))
    torch.testing.assert_close(keys[slots], want[:4, heads:], **_close(dtype))


# ---- a model built with them ----------------------------------------------------------------------------------


BLOCK, BLOCKS_PER_SEQ = 4, 24
GREEDY = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=True)


def _executor(path: str, dtype: torch.dtype, attention: str, graphs: bool = False) -> InferExecutor:
    arch = load_model_arch(path)
    settings = GraphSettings("cuda" if DEV == "cuda" else "standin", (1, 2, 4, 8), 512) if graphs else None
    ex = InferExecutor(arch, Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), dtype, torch.device(DEV),
                       block_size=BLOCK, num_blocks=len(PROMPTS) * BLOCKS_PER_SEQ, attention=attention, graphs=settings)
    ex.load_weights(path)
    return ex


def _greedy(ex: InferExecutor, new: int, logprobs: list | None = None,
            prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Prefill every prompt, then decode them together ``new`` tokens (each step's log-probs appended to
    ``logprobs`` when given)."""
    tables = {i: list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))}
    res = ex.execute(StepCommand(0, True, [SeqStep(i, list(p), 0, tables[i], sampling=GREEDY)
                                           for i, p in enumerate(prompts)]))
    out = [[t] for t in res.tokens]
    for step in range(1, new):
        res = ex.execute(StepCommand(step, False, [SeqStep(i, [out[i][-1]], len(p) + step - 1)
                                                   for i, p in enumerate(prompts)]))
        if logprobs is not None:
            logprobs.append(res.logprobs)
        for i, t in enumerate(res.tokens):
            out[i].append(t)
    ex.seqs.clear()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, QKV bias, q/k norm
def test_model_with_triton_kernels_gives_the_default_paths_tokens(model_dir, monkeypatch, arch):
    """float32, greedy: the Triton layer kernels and attention give the tokens of the CPU kernels / torch
    formulas; with stand-in decode graphs (one architecture: the same kernels), the bits of the eager run."""
    path = model_dir(arch)
    new = 3  # the prefill and two decode steps: a graph captured, then replayed
    want = _greedy(_executor(path, torch.float32, "torch"), new)
    monkeypatch.setenv("PAT_TRITON_LAYERS", "on")
    eager = _executor(path, torch.float32, "triton")
    assert eager.model.layers[0].mlp.triton is not None and eager.model.norm.triton is not None
    got = _greedy(eager, new)
    assert got == want
    if arch == "llama":
        graphed = _executor(path, torch.float32, "triton", graphs=True)
        assert _greedy(graphed, new) == got and graphed.graphs.stats.replays > 0


def _launches(monkeypatch) -> list[str]:
    """The names of the Triton kernels launched from now on (the interpreter's grid calls), in order."""
    from triton.runtime.interpreter import GridExecutor

    launched: list[str] = []
    launch = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(GridExecutor, "__call__", counted)
    return launched


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # plain, QKV bias
def test_model_with_the_skinny_gemm_gives_the_default_paths_tokens(model_dir, monkeypatch, arch):
    """float32, greedy, ``PAT_SKINNY_GEMM=on``: decode steps (at most 16 rows) multiply through the skinny
    Triton GEMM and give the default path's tokens, eagerly and with stand-in decode graphs."""
    path = model_dir(arch)
    new = 4
    want = _greedy(_executor(path, torch.float32, "torch"), new)
    monkeypatch.setenv("PAT_SKINNY_GEMM", "on")
    launched = _launches(monkeypatch)
    eager = _executor(path, torch.float32, "torch")
    assert eager.model.layers[0].mlp.down_proj.skinny_rows == 16 and eager.model.lm_head.skinny_rows == 16
    assert _greedy(eager, new) == want
    assert launched.count("_skinny_matmul_kernel") >= (new - 1) * (4 * eager.arch.num_layers + 1)
    if arch == "llama":
        assert _greedy(_executor(path, torch.float32, "torch", graphs=True), new) == want


@pytest.mark.slow
def test_norms_and_silu_in_the_gemms_prologue_keep_the_skinny_paths_bits(model_dir, monkeypatch):
    """``PAT_GEMM_PROLOGUE=fused``: decode steps (4 rows, at most 8) compute every layer's norms and SiLU-mul
    in the skinny GEMM's prologue, so none of their kernels launch, and give the unfused skinny path's tokens
    and log-probs bit for bit (the interpreter sums a norm's row in one order both ways); the prefill (more
    rows) runs them as before."""
    path, dtype = model_dir("qwen2"), torch.bfloat16  # QKV bias: the prologue GEMM adds it too
    new = 2  # the prefill, then a decode step: every layer's residual handed on through the prologues
    monkeypatch.setenv("PAT_TRITON_LAYERS", "on")
    monkeypatch.setenv("PAT_SKINNY_GEMM", "on")
    want_lp: list = []
    prompts = [PROMPTS[i] for i in (0, 2, 4, 5)]  # short ones: the prefill's rotary is the interpreter's time
    want = _greedy(_executor(path, dtype, "torch"), new, want_lp, prompts)
    monkeypatch.setenv("PAT_GEMM_PROLOGUE", "fused")
    launched = _launches(monkeypatch)
    fused = _executor(path, dtype, "torch")
    assert fused.model.layers[0].mlp.down_proj.prologue_rows == 8
    got_lp: list = []
    assert _greedy(fused, new, got_lp, prompts) == want and got_lp == want_lp
    layers = fused.arch.num_layers
    assert launched.count("_rms_norm_kernel") == (2 * layers + 1) + (new - 1)  # the prefill's, then the final norm
    assert launched.count("_silu_mul_kernel") == layers  # the prefill's only


class _KernelCount(TorchDispatchMode):
    """Counts what a GPU would launch: every aten op that computes (views and allocations do not) and every
    Triton kernel launch (the interpreter's own copies of the launch's arguments are not counted)."""

    FREE = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "_to_copy"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_decode_layer_is_at_most_twelve_kernels(model_dir, monkeypatch, arch):
    """Issue 30's budget, counted on the CPU stand-in: each decode layer launches at most 12 kernels
    (today: add+norm, QKV GEMM, rotary+KV write, attention, o GEMM, add+norm, gate/up GEMM, SiLU-mul,
    down GEMM; with a split, the attention's reduce)."""
    from triton.runtime.interpreter import GridExecutor
    from torch.utils._python_dispatch import _disable_current_modes

    monkeypatch.setenv("PAT_TRITON_LAYERS", "on")
    ex = _executor(model_dir(arch), torch.float32, "triton")
    ex.execute(StepCommand(0, True, [SeqStep(0, list(PROMPTS[3]), 0, list(range(BLOCKS_PER_SEQ)), sampling=GREEDY)]))
    with torch.inference_mode():
        step = ex.inputs.build(StepCommand(1, False, [SeqStep(0, [5], len(PROMPTS[3]))]), samples=False)
    counter = _KernelCount()
    launch = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        counter.ops.append(self.fn.__name__)
        with _disable_current_modes():
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(GridExecutor, "__call__", counted)
    ctx = ForwardContext(tp=ex.tp, kv_caches=ex.kv.layers, attn=step.attn, attn_backend=ex.attention)
    with torch.inference_mode(), counter:
        ex.model(step.input_ids, step.positions, ctx)
    layers = ex.arch.num_layers
    per_layer = (len(counter.ops) - 2) / layers  # the embedding lookup and the final norm are once per step
    assert per_layer <= 12, counter.ops
    assert counter.ops.count("_rotary_kv_kernel") == layers and counter.ops.count("_silu_mul_kernel") == layers
    assert counter.ops.count("_rms_norm_kernel") == 2 * layers + 1


def test_kernels_serve_gpu_models_and_cpu_models_only_when_asked(monkeypatch):
    monkeypatch.delenv("PAT_TRITON_LAYERS", raising=False)
    assert triton_ops.kernels_for("cpu", torch.float32) is None
    assert triton_ops.serves("cuda", torch.bfloat16) and not triton_ops.serves("cuda", torch.float64)
    monkeypatch.setenv("PAT_TRITON_LAYERS", "on")
    kernels = triton_ops.kernels_for("cpu", torch.bfloat16)
    assert kernels is not None and callable(kernels.rotary_kv_write)
    assert triton_ops.kernels_for("cpu", torch.float64) is None
    monkeypatch.setenv("PAT_TRITON_LAYERS", "off")
    assert not triton_ops.serves("cuda", torch.bfloat16)


# ---- compiled ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_layer_kernels_keep_the_formulas_bits(dtype):
    """On the device torch's kernels and these compute the same roundings; only the norm's sum order may differ."""
    from pat_kernels.triton_activation import silu_and_mul
    from pat_kernels.triton_norm import add_rms_norm

    x, residual = _randn(64, 4096, seed=1, dtype=dtype), _randn(64, 4096, seed=2, dtype=dtype)
    weight = _randn(4096, seed=3, dtype=dtype, scale=0.1, shift=1.0)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, norm_formula(x + residual, weight, 1e-5), **_close(dtype))
    gate_up = _randn(64, 2 * 14336, seed=4, dtype=dtype, scale=3)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)  # libdevice expf and IEEE division, as torch


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_fused_unfused_graphs_and_eager_give_the_same_greedy_tokens(model_dir, monkeypatch, arch):
    """Issue 30's bar on the device, float32: the Triton layer kernels with CUDA graphs, the same eagerly,
    and the torch formulas (``PAT_TRITON_LAYERS=off``) give the same greedy tokens."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after the test
    path = model_dir(arch)
    new = min(MAX_NEW)
    fused_graphs = _greedy(_executor(path, torch.float32, "triton", graphs=True), new)
    assert fused_graphs == _greedy(_executor(path, torch.float32, "triton"), new)
    monkeypatch.setenv("PAT_TRITON_LAYERS", "off")
    unfused = _executor(path, torch.float32, "triton")
    assert unfused.model.norm.triton is None
    assert _greedy(unfused, new) == fused_graphs


@pytest.mark.gpu
@gpu
def test_gpu_skinny_gemm_gives_cublas_greedy_tokens_with_graphs_and_eagerly(model_dir, monkeypatch):
    """float32 (IEEE in both: no TF32): decode steps through the skinny GEMM (``PAT_SKINNY_GEMM=on``), then
    with the norms and SiLU-mul in its prologue (``PAT_GEMM_PROLOGUE=fused``), with CUDA graphs and eagerly,
    give the greedy tokens of cuBLAS's GEMMs."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after the test
    path = model_dir("llama")
    new = min(MAX_NEW)
    cublas = _greedy(_executor(path, torch.float32, "triton", graphs=True), new)
    monkeypatch.setenv("PAT_SKINNY_GEMM", "on")
    graphed = _executor(path, torch.float32, "triton", graphs=True)
    assert graphed.model.layers[0].self_attn.o_proj.skinny_rows == 16
    assert _greedy(graphed, new) == cublas and graphed.graphs.stats.replays > 0
    assert _greedy(_executor(path, torch.float32, "triton"), new) == cublas
    monkeypatch.setenv("PAT_GEMM_PROLOGUE", "fused")  # the norms and SiLU-mul in the GEMMs' prologues too
    graphed = _executor(path, torch.float32, "triton", graphs=True)
    assert graphed.model.layers[0].mlp.down_proj.prologue_rows == 8
    assert _greedy(graphed, new) == cublas and graphed.graphs.stats.replays > 0
    assert _greedy(_executor(path, torch.float32, "triton"), new) == cublas


@pytest.mark.gpu
@gpu
def test_gpu_pdl_changes_no_bit_of_the_step(model_dir, monkeypatch):
    """``PAT_PDL=on`` moves where each kernel of a step starts, never what it computes: bfloat16 decode steps
    with every GEMM through the skinny GEMM, its prologues and the fused attention reduce, with CUDA graphs and
    eagerly, give the tokens and log-probs of the same engine launched plainly, bit for bit. (On a device
    without PDL, pre-sm_90 or an older Triton, both launch plainly and the test says nothing more.)"""
    for name, value in (("PAT_SKINNY_GEMM", "on"), ("PAT_GEMM_PROLOGUE", "fused"), ("PAT_DECODE_REDUCE", "fused")):
        monkeypatch.setenv(name, value)
    path = model_dir("llama")
    new = min(MAX_NEW)
    plain_logprobs: list = []
    plain = _greedy(_executor(path, torch.bfloat16, "triton", graphs=True), new, plain_logprobs)
    monkeypatch.setenv("PAT_PDL", "on")
    from pat_kernels.dependent_launch import device_supports

    for graphs in (True, False):
        ex, logprobs = _executor(path, torch.bfloat16, "triton", graphs=graphs), []
        assert ex.pdl == device_supports(torch.device(DEV))
        assert _greedy(ex, new, logprobs) == plain and logprobs == plain_logprobs
        assert not graphs or ex.graphs.stats.replays > 0
