"""The CPU chunk GEMM (``pat_kernels/cpu/chunk_gemm.cpp``): a rank's node of the reduction tree in one call.

Its contract: an output element's bits depend only on its row of x, its column of the weight and the
chunks, not on the row count, the row's position, the other columns or the thread count; a TP
rank's node over half the chunks, added to the other half's, is the whole node (the tree's top
level); and the values are x @ W.T within float32 rounding. ``PAT_CPU_CHUNK_GEMM=torch`` (oneDNN
chunk by chunk) is invariant too, with other bits.
"""

from __future__ import annotations

import pytest
import torch

from pat_engine.model import chunk_weights
from pat_engine.model.layers.linear import RowParallelLinear
from pat_engine.parallel.comm import TPGroup

cpu_chunk_gemm = pytest.importorskip("pat_kernels.cpu_chunk_gemm")
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _node(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    return cpu_chunk_gemm.node(x, cpu_chunk_gemm.panels(w), w.shape[0], chunks)


@pytest.fixture(autouse=True)
def _kernel_built():
    if not cpu_chunk_gemm.usable(torch.zeros(16, 16), 2):
        pytest.skip("the CPU kernels are not built here")


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_output_has_the_same_bits_whatever_surrounds_it(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(150, 8 * 24, generator=g).to(dtype)  # 150 columns: a partial last panel
    x = torch.randn(140, 8 * 24, generator=g).to(dtype)  # 140 rows: a partial last tile and block
    full = _node(x, w, 8)
    assert full.dtype == chunk_weights.accumulate_dtype(dtype) and full.shape == (140, 150)
    for m in (1, 2, 3, 7, 8, 9, 63, 64, 65, 139):
        assert torch.equal(_node(x[:m], w, 8), full[:m]), m
    perm = torch.randperm(140, generator=g)
    assert torch.equal(_node(x[perm], w, 8), full[perm])  # another row block, another tile
    assert torch.equal(_node(x, w[7:100].contiguous(), 8), full[:, 7:100])  # other columns around it
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_node(x, w, 8), full)
    finally:
        torch.set_num_threads(previous)
    exact = x.double() @ w.double().T
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    assert (full.double() - exact).abs().max() <= tol * exact.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ranks_nodes_add_up_to_the_whole_node(dtype):
    """TP2: each rank's node over its 4 of the 8 chunks; their sum (the tree's top level) is TP1's node."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 8 * 10, generator=g).to(dtype)
    x = torch.randn(5, 8 * 10, generator=g).to(dtype)
    halves = [_node(x[:, h * 40 : (h + 1) * 40].contiguous(), w[:, h * 40 : (h + 1) * 40].contiguous(), 4)
              for h in (0, 1)]
    assert torch.equal(halves[0] + halves[1], _node(x, w, 8))


def test_bad_shapes_are_refused():
    w, x = torch.randn(16, 12), torch.randn(3, 12)
    with pytest.raises(RuntimeError, match="power of two"):
        _node(x, w, 3)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_chunk_gemm.node(x.double(), cpu_chunk_gemm.panels(w), 16, 1)
    assert not cpu_chunk_gemm.usable(w.bfloat16(), 3)  # bfloat16 takes k in pairs: even widths only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_onednn_fallback_is_invariant_too(dtype, monkeypatch):
    """With the kernel switched off the layer multiplies chunk pieces through oneDNN: other bits, the same
    independence of the row count."""
    g = torch.Generator().manual_seed(2)
    layer = RowParallelLinear(512, 96, 1, 1, dtype, "cpu", chunks=8)
    layer.weight.data.copy_(torch.randn(96, 512, generator=g))
    x = torch.randn(40, 512, generator=g).to(dtype)
    group = TPGroup(rank=0, size=1, ranks=(0,))
    with_kernel = layer(x, group)
    monkeypatch.setenv("PAT_CPU_CHUNK_GEMM", "torch")  # read on every call: the pieces replace the panels
    fallback = layer(x, group)
    assert isinstance(chunk_weights.derived(layer.weight, layer.chunk_width), list)
    assert all(torch.equal(layer(x[:m], group), fallback[:m]) for m in (1, 2, 5, 39))
    torch.testing.assert_close(fallback.float(), with_kernel.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-1 if dtype == torch.bfloat16 else 1e-4)
