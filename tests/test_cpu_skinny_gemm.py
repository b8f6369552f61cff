"""The CPU skinny GEMM (``pat_kernels/cpu/skinny_gemm.cpp``): the fast mode's GEMM of decode steps of a few rows.

Its numerics contract is one fixed float32 sequence per output (16 lanes over k, a tree of adjacent pairs,
the k tail in order, then the bias, each operation rounded on its own); ``twin`` writes that sequence with
torch ops and the kernel must equal it bit for bit, so a row's result cannot depend on the other rows, the
row count or the thread count.
"""

from __future__ import annotations

import pytest
import torch

from pat_engine.model import cpu_gemm

cpu_skinny_gemm = pytest.importorskip("pat_kernels.cpu_skinny_gemm")
LANES = 16


def _built() -> bool:
    return cpu_skinny_gemm.usable(torch.zeros(1, 16), torch.zeros(4, 16))


pytestmark = pytest.mark.skipif(not _built(), reason="the CPU kernels are not built here")


def twin(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's sequence in torch: every product and sum a separate, exactly rounded float32 op."""
    xf, wf = x.float(), w.float()
    k = x.shape[1]
    k_lanes = k - k % LANES
    acc = torch.zeros(x.shape[0], w.shape[0], LANES)
    for k0 in range(0, k_lanes, LANES):
        acc = acc + xf[:, None, k0:k0 + LANES] * wf[None, :, k0:k0 + LANES]
    while acc.shape[-1] > 1:  # adjacent pairs, level by level
        acc = acc[..., 0::2] + acc[..., 1::2]
    s = acc[..., 0]
    for i in range(k_lanes, k):
        s = s + xf[:, None, i] * wf[None, :, i]
    if bias is not None:
        s = s + bias.float()
    return s.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [16, 40, 773])
def test_the_kernel_is_its_sequence_bit_for_bit(dtype, k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=g).to(dtype)
    bias = torch.randn(37, generator=g).to(dtype)
    for rows in range(1, cpu_skinny_gemm.MAX_ROWS + 1):
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        for b in (None, bias):
            assert torch.equal(cpu_skinny_gemm.linear(x, w, b), twin(x, w, b)), (rows, b is not None)


def test_a_row_alone_equals_it_among_others_on_any_thread_count():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 512, generator=g)
    x = torch.randn(8, 512, generator=g)
    together = cpu_skinny_gemm.linear(x, w, None)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(8):
                assert torch.equal(cpu_skinny_gemm.linear(x[r:r + 1], w, None), together[r:r + 1])
    finally:
        torch.set_num_threads(threads)


def test_a_strided_row_view_is_read_as_its_values():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(20, 64, generator=g)
    base = torch.randn(2, 128, generator=g)
    view = base[:, ::2]  # not unit stride along K: the accessor makes it contiguous
    assert torch.equal(cpu_skinny_gemm.linear(view, w, None), twin(view.contiguous(), w, None))


def test_what_the_kernel_refuses_is_named():
    w = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        torch.ops.pat_kernels.skinny_linear_cpu(torch.zeros(9, 16), w, torch.empty(0))
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.pat_kernels.skinny_linear_cpu(torch.zeros(1, 16), w.bfloat16(), torch.empty(0))
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.pat_kernels.skinny_linear_cpu(torch.zeros(1, 16), w, torch.zeros(3))
    assert not cpu_skinny_gemm.usable(torch.zeros(9, 16), w)
    assert not cpu_skinny_gemm.usable(torch.zeros(1, 16, dtype=torch.float64), w.double())


def test_the_engine_gemm_takes_it_for_few_rows_in_the_fast_mode_only(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 1100, generator=g)
    bias = torch.randn(96, generator=g)
    cpu_gemm.attach_pack(w)
    for rows in range(1, 6):
        x = torch.randn(rows, 1100, generator=g)
        fast = cpu_gemm.linear(x, w, bias, invariant=False)
        if rows <= cpu_gemm.SKINNY_ROWS[torch.float32]:
            assert torch.equal(fast, twin(x, w, bias))
        invariant = cpu_gemm.linear(x, w, bias, invariant=True)  # the row floor of the invariant mode, never skinny
        x4 = torch.nn.functional.pad(x, (0, 0, 0, max(0, cpu_gemm.ROW_ALIGN - rows)))
        assert torch.equal(invariant, cpu_gemm.packed_linear(x4, w, bias)[:rows])
    monkeypatch.setenv("PAT_CPU_SKINNY_GEMM", "torch")
    x = torch.randn(1, 1100, generator=g)
    assert torch.equal(cpu_gemm.linear(x, w, bias, invariant=False), cpu_gemm.packed_linear(x, w, bias))
