"""The C++ CPU paged decode attention kernel equals the torch path (gather + SDPA).

The kernel is compiled on first use (about 15 s on 2 cores) and cached in the torch extensions
directory; later runs load it in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pat_engine.model.layers.attention import AttentionMetadata, paged_attention
from pat_kernels import cpu_attention, cpu_extension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernel():
    k = cpu_attention.load_kernel()
    if k is None:
        pytest.skip(f"the CPU extension cannot be built: {cpu_extension._failed}")
    return k


def decode_case(lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, padding_rows: int = 0, seed: int = 0):
    """q, pool, tables, lens and metadata as a decode step builds them; tables use shuffled blocks,
    padding rows (context 1, table of zeros) follow the real ones."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 3
    blocks = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lengths) + padding_rows, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[row, :used] = blocks[row * width: row * width + used]
    lens = torch.tensor(lengths + [1] * padding_rows)
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(0, dtype=torch.long), query_len=1,
                             block_tables=tables, context_lens=lens)
    return q, pool, meta


def torch_path(q, pool, meta, scale, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv(cpu_attention.ENV_SWITCH, "torch")
        return paged_attention(q, q[:0, : pool.shape[3]], q[:0, : pool.shape[3]], pool, meta, scale)


def on_one_thread(kernel, q, pool, meta, scale: float) -> torch.Tensor:
    """The kernel's output computed with one torch thread (work items are independent, so any
    thread count must give the same bits)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return kernel(q, pool, meta.block_tables, meta.context_lens, scale)
    finally:
        torch.set_num_threads(threads)


TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 3e-2}
LENGTHS = [1, 15, 16, 17, 32, 33, 100, 7]  # block boundaries of block_size 16 and several blocks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2)])  # GQA groups 1, 2, 4
def test_kernel_matches_torch_path(kernel, dtype, heads, kv_heads, monkeypatch):
    q, pool, meta = decode_case(LENGTHS, heads, kv_heads, 64, 16, dtype, padding_rows=3)
    scale = 64**-0.5
    expected = torch_path(q, pool, meta, scale, monkeypatch)
    got = kernel(q, pool, meta.block_tables, meta.context_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("rows", ["few", "many"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 2)])
def test_row_and_head_work_items_in_parallel(kernel, rows, heads, kv_heads, monkeypatch):
    """Few rows: work items of a row's KV heads (as many items as threads need); many rows: one item per
    row, and enough work to run in parallel. Items are independent, so any thread count gives the same bits."""
    n = 2 if rows == "few" else 4 * max(torch.get_num_threads(), 2) + 1
    lengths = [150 + 37 * i % 90 for i in range(n)]
    q, pool, meta = decode_case(lengths, heads, kv_heads, 64, 16, torch.float64, padding_rows=1, seed=3)
    expected = torch_path(q, pool, meta, 0.125, monkeypatch)
    got = kernel(q, pool, meta.block_tables, meta.context_lens, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-13, rtol=1e-13)
    assert torch.equal(on_one_thread(kernel, q, pool, meta, 0.125), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_tail_batch_shared_out_by_work(kernel, dtype, monkeypatch):
    """One long row among many short ones (a rollout's tail): the threads' runs are cut by total
    context, so the long row gets a run of its own; the result is still the torch path's, and the
    same whatever the thread count. float32 takes the vectorised exponential (lengths not multiples
    of 8 exercise its scalar tail)."""
    lengths = [3 + i % 5 for i in range(40)] + [611] + [2 + i % 3 for i in range(23)]
    q, pool, meta = decode_case(lengths, 8, 4, 64, 16, dtype, seed=4)
    expected = torch_path(q, pool, meta, 0.125, monkeypatch)
    got = kernel(q, pool, meta.block_tables, meta.context_lens, 0.125)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(on_one_thread(kernel, q, pool, meta, 0.125), got)


@pytest.mark.parametrize("head_dim,block_size", [(24, 4), (128, 16), (40, 8)])  # unspecialised head dims, odd tails
def test_other_head_dims_and_block_sizes(kernel, head_dim, block_size, monkeypatch):
    lengths = [1, block_size, block_size + 1, 5 * block_size + 2]
    q, pool, meta = decode_case(lengths, 6, 2, head_dim, block_size, torch.float64, padding_rows=1, seed=1)
    expected = torch_path(q, pool, meta, 0.3, monkeypatch)
    torch.testing.assert_close(kernel(q, pool, meta.block_tables, meta.context_lens, 0.3), expected,
                               atol=1e-13, rtol=1e-13)


# query heads per KV head 1..8 (the register tiles take four at a time, then what is left); head dims that
# are multiples of 16, of 8 only (the tiles' last eight dims alone) and of neither (the scalar loops)
GROUPINGS = [(4, 4, 64), (6, 2, 64), (7, 1, 40), (14, 2, 24), (16, 2, 128), (10, 2, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GROUPINGS)
def test_head_groupings_match_the_torch_path(kernel, dtype, heads, kv_heads, head_dim, monkeypatch):
    q, pool, meta = decode_case([1, 2, 15, 16, 17, 50], heads, kv_heads, head_dim, 16, dtype, padding_rows=1, seed=5)
    scale = head_dim**-0.5
    got = kernel(q, pool, meta.block_tables, meta.context_lens, scale)
    torch.testing.assert_close(got, torch_path(q, pool, meta, scale, monkeypatch), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (14, 2, 24), (10, 2, 20)])
def test_a_row_alone_has_the_bits_it_has_in_a_batch(kernel, dtype, heads, kv_heads, head_dim):
    """The invariant mode's contract (docs/numerics.md): a row's output bits do not depend on the batch it
    runs in (alone, or among rows that take threads of their own), nor on the thread count."""
    lengths = [40 + 29 * i % 300 for i in range(4 * max(torch.get_num_threads(), 2) + 3)]
    q, pool, meta = decode_case(lengths, heads, kv_heads, head_dim, 16, dtype, seed=6)
    together = kernel(q, pool, meta.block_tables, meta.context_lens, 0.2)
    for row in (0, 5, len(lengths) - 1):
        alone = kernel(q[row:row + 1], pool, meta.block_tables[row:row + 1], meta.context_lens[row:row + 1], 0.2)
        assert torch.equal(alone[0], together[row])
        assert torch.equal(on_one_thread(kernel, q[row:row + 1], pool, AttentionMetadata(
            is_prefill=False, slot_mapping=meta.slot_mapping, query_len=1, block_tables=meta.block_tables[row:row + 1],
            context_lens=meta.context_lens[row:row + 1]), 0.2)[0], together[row])
    assert torch.equal(on_one_thread(kernel, q, pool, meta, 0.2), together)


def with_threads(n: int, fn):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_row_cut_by_heads_keeps_its_bits(kernel, dtype):
    """A long row is cut into work items of 8, 4 or 2 of its 8 KV heads on 1, 2 or 3 threads (each thread
    takes at most its share of the work), and among short rows into fewer cuts: the bits stay the same."""
    q, pool, meta = decode_case([1500] + [20 + i for i in range(12)], 16, 8, 64, 16, dtype, seed=7)
    def run(rows: int, threads: int) -> torch.Tensor:
        return with_threads(threads, lambda: kernel(q[:rows], pool, meta.block_tables[:rows], meta.context_lens[:rows],
                                                    0.125))
    alone = run(1, 1)
    for threads in (2, 3):
        assert torch.equal(run(1, threads), alone)
        assert torch.equal(run(13, threads)[0], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 5, 8])
def test_register_tiles_at_other_block_sizes(kernel, dtype, block_size, monkeypatch):
    """Blocks of an odd token count end on a token of their own, with the next block asked for."""
    lengths = [1, block_size, block_size + 1, 7 * block_size + 3, 40]
    q, pool, meta = decode_case(lengths, 12, 4, 24, block_size, dtype, padding_rows=1, seed=8)
    got = kernel(q, pool, meta.block_tables, meta.context_lens, 0.3)
    torch.testing.assert_close(got, torch_path(q, pool, meta, 0.3, monkeypatch), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_paged_attention_uses_kernel_with_new_kv(kernel, monkeypatch):
    """Through paged_attention: the new token's K/V are written first, then read by the kernel; the
    query is a strided view (as split from the fused projection)."""
    q, pool, meta = decode_case([3, 20, 47], 8, 4, 64, 16, torch.float64, seed=2)
    lens = meta.context_lens
    pos = lens - 1
    meta.slot_mapping = meta.block_tables[torch.arange(3), pos // 16] * 16 + pos % 16
    qkv = torch.randn(3, 8 + 4 + 4, 64, dtype=torch.float64)
    q, k, v = qkv.split([8, 4, 4], dim=1)
    pool_ref = pool.clone()
    with monkeypatch.context() as m:
        m.setenv(cpu_attention.ENV_SWITCH, "torch")
        expected = paged_attention(q, k, v, pool_ref, meta, 0.125)
    calls = []
    monkeypatch.setattr("pat_engine.model.layers.attention.cpu_decode_kernel",
                        lambda dtype: (lambda *a: calls.append(1) or kernel(*a)))
    got = paged_attention(q, k, v, pool, meta, 0.125)
    assert calls and torch.equal(pool, pool_ref)
    torch.testing.assert_close(got, expected, atol=1e-13, rtol=1e-13)


def test_bad_indices_are_rejected(kernel):
    q, pool, meta = decode_case([5, 9], 4, 2, 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="context_lens"):
        kernel(q, pool, meta.block_tables, torch.tensor([5, 0]), 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        kernel(q, pool, meta.block_tables, torch.tensor([5, 13]), 1.0)  # beyond the table's 3 blocks
    tables = meta.block_tables.clone()
    tables[1, 2] = pool.shape[1]
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, pool, tables, meta.context_lens, 1.0)


def test_env_switch_and_unsupported_dtype(kernel, monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV_SWITCH, raising=False)
    assert cpu_attention.cpu_decode_kernel(torch.float32) is kernel
    assert cpu_attention.cpu_decode_kernel(torch.float16) is None  # the torch path serves float16
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "torch")
    assert cpu_attention.cpu_decode_kernel(torch.float32) is None


def test_inside_a_step_a_switch_is_read_once(kernel, monkeypatch):
    """``switches_read_once`` (the worker's step): a switch flipped inside keeps its first reading until the
    step ends; outside, every call reads the environment (A/B runs flip it between steps)."""
    monkeypatch.delenv(cpu_attention.ENV_SWITCH, raising=False)
    with cpu_extension.switches_read_once():
        assert cpu_attention.cpu_decode_kernel(torch.float32) is kernel
        monkeypatch.setenv(cpu_attention.ENV_SWITCH, "torch")
        assert cpu_attention.cpu_decode_kernel(torch.float32) is kernel
    assert cpu_attention.cpu_decode_kernel(torch.float32) is None
    with cpu_extension.switches_read_once():
        assert cpu_attention.cpu_decode_kernel(torch.float32) is None


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_extension, "_loaded", False)
    monkeypatch.setattr(cpu_extension, "_failed", None)
    monkeypatch.setattr(cpu_extension, "_build", no_compiler)
    monkeypatch.delenv(cpu_attention.ENV_SWITCH, raising=False)
    q, pool, meta = decode_case([4, 18], 4, 2, 16, 8, torch.float64)
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        first = paged_attention(q, q[:0, :2], q[:0, :2], pool, meta, 0.25)
        paged_attention(q, q[:0, :2], q[:0, :2], pool, meta, 0.25)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Ninja is required" in warnings[0].getMessage()
    torch.testing.assert_close(first, torch_path(q, pool, meta, 0.25, monkeypatch))


def test_stale_torch_lock_does_not_hang(kernel):
    """A build killed mid-way leaves torch's ``lock`` file behind; the next load must not wait on it."""
    folder = cpu_extension.build_directory()
    (folder / "lock").touch()
    start = time.perf_counter()
    cpu_extension._build()
    assert time.perf_counter() - start < 30 and not (folder / "lock").exists()


def test_cache_name_carries_instruction_set_and_checkout():
    tag, flags = cpu_extension.isa()
    assert tag in cpu_extension.extension_name()
    if tag == "avx2":
        assert flags == ["-mavx2", "-mfma"]
    folder = cpu_extension.build_directory().name  # one build per checkout: worktrees do not rebuild each other's
    assert folder.startswith(cpu_extension.extension_name() + "_") and len(folder) == len(cpu_extension.extension_name()) + 9


PROBE_SOURCE = """
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return at::add(x, x); }
TORCH_LIBRARY(pat_build_probe, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(pat_build_probe, CPU, m) { m.impl("twice", &twice); }
"""


@pytest.mark.slow
def test_two_processes_build_at_once(tmp_path):
    """Two processes loading into an empty extensions folder at the same moment: one compiles, the
    other waits for it, and both run the library. The build is the kernels' own (``cpu_extension``:
    its lock, its folder, its flags) over a one-op source, so the test costs a small compile rather
    than the whole library's; the library itself is built by every first run of the suite."""
    source = tmp_path / "src" / "probe.cpp"
    source.parent.mkdir()
    source.write_text(PROBE_SOURCE)
    script = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from pat_kernels import cpu_extension as c
        c.SOURCES = [Path({str(source)!r})]
        assert c.load(), c._failed
        x = torch.ones(3)
        assert torch.equal(torch.ops.pat_build_probe.twice(x), 2 * x)
        print("ok %.1f" % c.build_seconds)
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in (".", "csrc")))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(o.strip().startswith("ok") for o in outs), outs
    assert len(list((tmp_path / "ext").glob("*/*.so"))) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kv_write_kernel_stores_what_index_copy_stores(kernel, dtype, monkeypatch):
    """New tokens' K/V, as strided views of the fused projection, land bit for bit where the torch
    path puts them; the padding rows past the slots are not written."""
    from pat_engine.model.layers.attention import write_kv

    g = torch.Generator().manual_seed(5)
    pool = torch.randn(2, 30, 16, 4, 64, generator=g, dtype=torch.float64).to(dtype)
    qkv = torch.randn(40, 16 * 64, generator=g, dtype=torch.float64).to(dtype)
    k, v = qkv[:, 8 * 64:12 * 64].view(40, 4, 64), qkv[:, 12 * 64:].view(40, 4, 64)
    slots = torch.randperm(30 * 16, generator=g)[:37]  # 3 padding rows
    want = pool.clone()
    with monkeypatch.context() as m:
        m.setenv(cpu_attention.ENV_SWITCH, "torch")
        write_kv(want, k, v, slots)
    got = pool.clone()
    assert cpu_attention.write_kv(got, k, v, slots)
    assert torch.equal(got, want) and not torch.equal(got, pool)


def test_kv_write_kernel_refuses_slots_outside_the_pool(kernel):
    pool = torch.zeros(2, 2, 4, 1, 8)
    k = torch.ones(3, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_attention.write_kv(pool, k, k, torch.tensor([0, 8, 1]))
    assert not pool.any()


def test_missing_kernels_package_is_said_at_worker_start(monkeypatch, caplog):
    """Without pat_kernels on the path every CPU kernel is off; the worker says so instead of
    running slower in silence."""
    from pat_engine.model.layers import attention

    monkeypatch.setattr(attention, "_KERNELS_MISSING", "No module named 'pat_kernels'")
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        assert attention.load_decode_kernel(torch.device("cpu"), torch.float32) is False
    assert any("pat_kernels cannot be imported" in r.getMessage() for r in caplog.records)
