"""The invariant mode's Triton GEMM (``pat_kernels/invariant_matmul.py``), run by Triton's CPU interpreter.

A row's bits must not depend on the rows around it (how many, in which order, padding rows of any
content), a column's not on the other columns (a column-parallel TP shard), a chunk partial not on
the other chunks (a row-parallel rank's share); the values equal torch's GEMM within rounding.
Under the interpreter every tile's dot runs in numpy, so these prove the kernel's structure (the K
walk, the masks, the grid); the ``gpu`` tests repeat them compiled, and check that the layers route
through the kernel on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from triton_markers import DEV, gemm_data, gemm_tol, gpu, needs_triton

DTYPES = [torch.float32, torch.bfloat16]


def _kernel():
    from pat_kernels import invariant_matmul

    return invariant_matmul


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_whatever_the_rows_around_it(dtype):
    mm = _kernel().invariant_matmul
    x, w, b = gemm_data(130, 96, 200, dtype)  # K = 200: three full K tiles and a masked tail
    full = mm(x, w, b)
    assert full.dtype == dtype and full.shape == (130, 96)
    for m in (1, 2, 3, 17, 64, 65, 129):  # fewer rows, fewer tiles
        assert torch.equal(mm(x[:m], w, b), full[:m]), m
    perm = torch.randperm(130, generator=torch.Generator().manual_seed(1)).to(DEV)
    assert torch.equal(mm(x[perm], w, b), full[perm])  # another position in the batch, another tile
    padded = torch.cat([x[:5], torch.full((59, 200), 7.0, dtype=dtype, device=DEV)])  # graph padding rows
    assert torch.equal(mm(padded, w, b)[:5], full[:5])
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(full.float(), ref, **gemm_tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_column_has_the_same_bits_in_any_shard_of_the_output(dtype):
    mm = _kernel().invariant_matmul
    x, w, b = gemm_data(9, 160, 96, dtype, seed=2)
    full = mm(x, w, b)
    for lo, hi in ((0, 80), (80, 160), (40, 120)):  # TP2 shards, and one that cuts a tile
        assert torch.equal(mm(x, w[lo:hi], b[lo:hi]), full[:, lo:hi])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_partials_are_each_chunk_alone(dtype):
    """``chunks``: the (C, M, N) float32 leaves of a row-parallel product; chunk c's partial is what a
    rank holding only chunk c computes, and its rows do not depend on the row count either."""
    mm = _kernel().invariant_matmul
    x, w, _ = gemm_data(33, 48, 4 * 72, dtype, seed=3)  # four chunks of 72: a partial K tile in each
    parts = mm(x, w, chunks=4)
    assert parts.shape == (4, 33, 48) and parts.dtype == torch.float32
    for c in range(4):
        cols = slice(c * 72, (c + 1) * 72)
        alone = mm(x[:, cols].contiguous(), w[:, cols].contiguous(), out_dtype=torch.float32)
        assert torch.equal(alone, parts[c]), c
    halves = mm(x[:, 144:].contiguous(), w[:, 144:].contiguous(), chunks=2)  # the second TP2 rank's share
    assert torch.equal(halves, parts[2:])
    assert torch.equal(mm(x[:1], w, chunks=4), parts[:, :1])
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(parts.sum(0), ref, atol=1e-3, rtol=1e-5)


@needs_triton
def test_bad_arguments_are_refused():
    mm = _kernel().invariant_matmul
    x, w, b = gemm_data(4, 8, 96, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        mm(x, w.bfloat16())
    with pytest.raises(ValueError, match="chunks"):
        mm(x, w, chunks=5)
    with pytest.raises(ValueError, match="with a bias"):
        mm(x, w, b, chunks=2)
    assert mm(x[:0], w).shape == (0, 8)


# ---- compiled, on a GPU ---------------------------------------------------------------------------------


@gpu
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_linear_layers_route_through_the_invariant_gemm(dtype):
    """On CUDA ``linear(..., invariant=True)`` is the kernel, bit for bit, at decode and prefill row
    counts; cuBLAS (the fast mode) is not required to be, and is not compared."""
    from pat_engine.model.layers.linear import linear

    mm = _kernel().invariant_matmul
    x, w, b = gemm_data(512, 1024, 4096, dtype, seed=4)
    full = linear(x, w, b, invariant=True)
    assert torch.equal(full, mm(x, w, b))
    for m in (1, 2, 7, 64, 200):
        assert torch.equal(linear(x[:m], w, b, invariant=True), full[:m]), m


@gpu
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_engine_graphs_equal_eager_alone_equals_batched_equals_reference(tmp_path, dtype):
    """On CUDA in the invariant mode: decode graphs (batches padded to the ladder) give eager's bits, a
    request alone gives its bits inside a batch of 24, and ``reference_logprobs(device="cuda")`` the
    engine's log-probs; greedy and seeded sampling."""
    from pat_engine import Engine, SamplingParams, reference_logprobs
    from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

    path = str(write_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen2", hidden_size=1152, intermediate_size=1408,
                                                              num_layers=2, num_heads=8, num_kv_heads=2, seed=9)))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 380, (int(n),), generator=g).tolist() for n in torch.randint(3, 90, (24,), generator=g)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, seed=40 + i, temperature=float(i % 2))
              for i in range(24)]
    outs = {}
    for eager in (False, True):
        with Engine(path, device="cuda", dtype=dtype, numerics="invariant", enforce_eager=eager,
                    gpu_memory_utilization=0.3) as engine:
            outs[eager] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params, use_tqdm=False)]
            if not eager:
                alone = [(o.token_ids, o.logprobs) for i in range(4)
                         for o in engine.generate([prompts[i]], params[i], use_tqdm=False)]
    assert outs[False] == outs[True], "graphs and eager differ"
    assert alone == outs[False][:4], "a request alone differs from the same request in the batch"
    ref = reference_logprobs(path, [(p, t) for p, (t, _) in zip(prompts, outs[True])], dtype=dtype, device="cuda")
    assert ref == [lps for _, lps in outs[True]]
