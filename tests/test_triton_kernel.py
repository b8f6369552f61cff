"""The Triton attention kernels and backend against the torch path (run by Triton's CPU interpreter).

Kernels: the grouped paged decode kernel (one program per (sequence, KV head, split); one split,
even splits of each row, a fixed split; GQA, float32 and bfloat16, head sizes that are not a power
of two), the packed varlen prefill kernel (ragged prompts, with and without cached context). Backend: the invariant mode's bits (a sequence alone = inside a batch = with half the
heads, as at a higher TP; prefill = decode), the split rule as a pure function, the flashinfer
backend's error. Under the interpreter every program runs in numpy, so the bitwise tests prove
the kernels' structure (no value depends on the batch, the grid or the heads); ``gpu`` tests
repeat them compiled.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from triton_markers import DEV, gpu, needs_triton

from pat_engine.model.layers.attention import AttentionBackend, AttentionMetadata, attention_backend, gather_attention
from pat_engine.model.layers.triton_attention import (
    INVARIANT_TOKENS_PER_SPLIT,
    MIN_TOKENS_PER_SPLIT,
    PROGRAMS_PER_SM,
    DecodeSplit,
    TritonAttention,
    decode_split,
)
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.worker.step_inputs import StepInputBuilder

LONG_TAIL = [1, 3, 17, 70]


def _pool(lens: list[int], bs: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
    """A random pool (2, blocks, bs, kvh, d) and shuffled block tables (B, width) holding ``lens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    blocks = sum(need) + 3  # spare blocks hold garbage nobody may read
    perm = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    at = 0
    for row, n in enumerate(need):
        tables[row, :n] = perm[at : at + n]
        at += n
    cache = torch.randn(2, blocks, bs, kvh, d, generator=g).to(dtype)
    return cache.to(DEV), tables.to(DEV)


def _decode_meta(tables: torch.Tensor, lens: list[int], bs: int) -> AttentionMetadata:
    ctx = torch.tensor(lens, device=tables.device)
    return AttentionMetadata(False, torch.zeros(0, dtype=torch.long, device=tables.device), 1, tables,
                             context_lens=ctx)


def _reference(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch gather path in float32 on the same (rounded) inputs."""
    return gather_attention(q.float(), cache.float(), meta, scale)


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


# --- the split rule: a pure function (fast tier, no Triton) ---------------------------------------------------


def test_invariant_rule_is_one_constant_for_every_step():
    shapes = [(1, 1, 16, 132), (1, 8, 100_000, 132), (512, 8, 4096, 132), (3, 5, 70, 1), (256, 2, 64, 16)]
    assert {decode_split(*s, "invariant") for s in shapes} == {DecodeSplit(INVARIANT_TOKENS_PER_SPLIT)}
    assert decode_split(1, 8, 4096, 132, "invariant", block_n=512) == DecodeSplit(512)  # whole iterations
    assert decode_split(9, 8, 4096, 132, "invariant", block_n=16, invariant_tokens_per_split=12) == DecodeSplit(16)


def test_fast_rule_adds_splits_until_the_grid_fills_the_device():
    goal = PROGRAMS_PER_SM * 132
    assert decode_split(32, 8, 4096, 132, "fast") == DecodeSplit(None, 2)  # 256 programs -> 512 >= 396
    assert decode_split(64, 8, 4096, 132, "fast") == DecodeSplit(None, 1)  # 512 programs fill 132 SMs
    assert decode_split(1, 8, 32768, 132, "fast") == DecodeSplit(None, -(-goal // 8))  # the tail: 8 programs
    assert decode_split(1, 8, 4096, 132, "fast") == DecodeSplit(None, 4096 // MIN_TOKENS_PER_SPLIT)  # capped
    assert decode_split(1, 8, 100, 132, "fast") == DecodeSplit(None, 1)  # too short for two splits
    assert decode_split(0, 8, 4096, 132, "fast") == DecodeSplit(None, 1)
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        split = decode_split(batch, 8, 20_000, 132, "fast")
        assert split.tokens_per_split is None and 1 <= split.num_splits <= 20_000 // MIN_TOKENS_PER_SPLIT
        assert batch * 8 * split.num_splits >= goal or split.num_splits == 20_000 // MIN_TOKENS_PER_SPLIT
    with pytest.raises(ValueError, match="numerics"):
        decode_split(1, 8, 4096, 132, "exact")


# --- backends: registration and the flashinfer error ----------------------------------------------------------


@needs_triton
def test_triton_backend_is_registered_with_its_numerics():
    backend = attention_backend("triton", numerics="invariant")
    assert isinstance(backend, TritonAttention) and isinstance(backend, AttentionBackend)
    assert backend.name == "triton" and backend.numerics == "invariant"


def test_flashinfer_backend_is_registered_without_importing_flashinfer():
    import pat_engine.model.layers.flashinfer_attention  # noqa: F401

    assert "flashinfer" not in sys.modules or importlib.util.find_spec("flashinfer") is not None
    with pytest.raises(ValueError, match="invariant"):
        attention_backend("flashinfer", numerics="invariant")


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_choosing_flashinfer_without_it_says_what_to_install():
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gpu\]"'):
        attention_backend("flashinfer")


# --- decode kernels -------------------------------------------------------------------------------------------


def _decode(q, cache, tables, lens, **split):
    from pat_kernels.paged_decode_attention import paged_decode_attention

    return paged_decode_attention(q, cache[0], cache[1], tables, torch.as_tensor(lens, device=DEV), q.shape[-1] ** -0.5,
                                  block_n=16, **split)


@needs_triton
@pytest.mark.parametrize("heads,kv_heads,d,bs,split,dtype", [
    (4, 4, 16, 4, {}, torch.float32),  # MHA, one program per (row, head): the whole context
    (8, 2, 16, 4, {}, torch.bfloat16),  # GQA 4
    (2, 1, 32, 8, {"num_splits": 3}, torch.float32),  # even splits of each row's own length
    (6, 2, 24, 4, {"num_splits": 5}, torch.bfloat16),  # head_dim 24: padded to 32 inside, GQA 3
    (2, 2, 16, 4, {"tokens_per_split": 16}, torch.float32),  # fixed splits: 5 for the 70-token row
    (4, 1, 16, 8, {"tokens_per_split": 32}, torch.bfloat16),  # GQA 4, 3 splits
])
def test_decode_matches_torch_on_a_long_tail(heads, kv_heads, d, bs, split, dtype):
    cache, tables = _pool(LONG_TAIL, bs, kv_heads, d, dtype)
    meta = _decode_meta(tables, LONG_TAIL, bs)
    q = torch.randn(len(LONG_TAIL), heads, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    got = _decode(q, cache, tables, LONG_TAIL, **split)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), _reference(q, cache, meta, d**-0.5), **_tol(dtype))


@needs_triton
def test_query_rows_may_be_a_view_of_the_fused_projection():
    """The kernel reads q through its strides: the q heads of a (T, (h + 2 kvh) * d) projection, uncopied."""
    bs, d, heads, kvh = 4, 16, 4, 2
    cache, tables = _pool(LONG_TAIL, bs, kvh, d, torch.float32)
    qkv = torch.randn(len(LONG_TAIL), (heads + 2 * kvh) * d, generator=torch.Generator().manual_seed(8)).to(DEV)
    q = qkv[:, : heads * d].view(-1, heads, d)
    assert not q.is_contiguous()
    torch.testing.assert_close(_decode(q, cache, tables, LONG_TAIL, num_splits=2),
                               _decode(q.contiguous(), cache, tables, LONG_TAIL, num_splits=2), atol=0, rtol=0)


@needs_triton
def test_one_split_equals_the_reduce_of_one_split():
    """A table no wider than a fixed split runs without the reduce; a wider one reduces, and a row whose
    context fits one split gets the same bits either way."""
    bs, d = 4, 16
    cache, tables = _pool([5, 9], bs, 2, d, torch.bfloat16)
    q = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    direct = _decode(q, cache, tables, [5, 9], tokens_per_split=16)  # width 12 tokens: one split, no reduce
    wide = torch.cat([tables, tables], dim=1)  # width 24: two splits in the grid, the second empty for both rows
    reduced = _decode(q, cache, wide, [5, 9], tokens_per_split=16)
    assert torch.equal(direct, reduced)


@needs_triton
@pytest.mark.parametrize("heads,kv_heads,d,split,dtype", [
    (8, 2, 16, {"num_splits": 3}, torch.bfloat16),  # GQA 4; the 1- and 3-token rows have one used split
    pytest.param(6, 2, 24, {"num_splits": 5}, torch.float32,  # GQA 3 in a tile of 16: padding rows merge nothing
                 marks=pytest.mark.slow),
    pytest.param(4, 1, 16, {"tokens_per_split": 32}, torch.bfloat16,  # fixed splits: empty ones past a row's end
                 marks=pytest.mark.slow),
])
def test_the_fused_reduce_gives_the_reduce_kernels_bits_and_leaves_its_counters_at_zero(heads, kv_heads, d, split,
                                                                                          dtype):
    """The last split of each (row, KV head) merges as the reduce kernel does; every counter is back at zero
    after a call, so a second call (a graph replay, the next layer) merges the same way."""
    from pat_kernels import paged_decode_attention as pda

    cache, tables = _pool(LONG_TAIL, 4, kv_heads, d, dtype)
    q = torch.randn(len(LONG_TAIL), heads, d, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEV)
    reduced = _decode(q, cache, tables, LONG_TAIL, **split)
    fused = _decode(q, cache, tables, LONG_TAIL, fuse_reduce=True, **split)
    assert torch.equal(fused, reduced)
    counters = pda.split_counters(q.device, len(LONG_TAIL) * kv_heads)
    assert counters.numel() >= pda._MIN_COUNTERS and not counters.any()
    bigger = pda.split_counters(q.device, counters.numel() + 1)  # a larger call: a new buffer, the old one kept
    assert bigger.numel() > counters.numel() and pda._COUNTERS[q.device][-2] is counters
    assert torch.equal(_decode(q, cache, tables, LONG_TAIL, fuse_reduce=True, **split), reduced)
    # one split: nothing to merge, the kernel writes the output directly either way
    assert torch.equal(_decode(q, cache, tables, LONG_TAIL, fuse_reduce=True), _decode(q, cache, tables, LONG_TAIL))


@needs_triton
@pytest.mark.parametrize("numerics", ["fast", pytest.param("invariant", marks=pytest.mark.slow)])  # 7 s interpreted
def test_pat_decode_reduce_fused_reaches_the_kernel_and_keeps_the_backends_bits(monkeypatch, numerics):
    """``PAT_DECODE_REDUCE=fused`` builds a backend whose decodes merge in the split kernel: the same bits as
    the reduce kernel's, in both numerics modes (the invariant mode's fixed split included)."""
    from pat_kernels import paged_decode_attention as pda

    bs, d, kvh = 4, 16, 2
    cache, tables = _pool(LONG_TAIL, bs, kvh, d, torch.bfloat16)
    tables = torch.cat([tables, torch.zeros(len(LONG_TAIL), 80, dtype=tables.dtype, device=DEV)], dim=1)
    meta = _decode_meta(tables, LONG_TAIL, bs)  # a table 392 tokens wide: the fast rule takes 3 splits
    q = torch.randn(len(LONG_TAIL), 8, d, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEV)

    def backend() -> TritonAttention:
        return _invariant(16, block_n=16) if numerics == "invariant" else TritonAttention("fast", 132, block_n=16)

    kernel = backend()
    monkeypatch.setenv("PAT_DECODE_REDUCE", "fused")
    fused = backend()
    assert fused.fuse_reduce and not kernel.fuse_reduce
    calls = []
    inner = pda.paged_decode_attention
    monkeypatch.setattr(pda, "paged_decode_attention", lambda *a, **k: calls.append(k["fuse_reduce"]) or inner(*a, **k))
    from pat_engine.model.layers import triton_attention

    monkeypatch.setattr(triton_attention, "_KERNELS", None)  # re-imported through the patched module
    assert torch.equal(fused.decode(q, cache, meta, d**-0.5), kernel.decode(q, cache, meta, d**-0.5))
    assert calls == [True, False]


@needs_triton
def test_backend_decode_writes_then_splits_the_tail(monkeypatch):
    """Through ``paged_attention``: the new token's K/V written first, then the split kernel (fast mode, the tail)."""
    import pat_engine.model.layers.triton_attention as triton_attention
    from pat_engine.model.layers.attention import paged_attention

    bs, d = 4, 16
    cache, tables = _pool(LONG_TAIL, bs, 2, d, torch.float32)
    meta = _decode_meta(tables, LONG_TAIL, bs)
    pos = meta.context_lens - 1
    meta.slot_mapping = tables[torch.arange(4, device=DEV), pos // bs] * bs + pos % bs
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, h, d, generator=g).to(DEV) for h in (2, 2, 2))
    width = tables.shape[1] * bs
    assert decode_split(4, 2, width, 64, "fast", 16) == DecodeSplit(None, 1)  # 72 tokens: too short for the floor...
    monkeypatch.setattr(triton_attention, "MIN_TOKENS_PER_SPLIT", 16)  # ...lowered to reach the split path
    assert decode_split(4, 2, width, 64, "fast", 16) == DecodeSplit(None, 4)
    reference_cache = cache.clone()
    got = paged_attention(q, k, v, cache, meta, d**-0.5, TritonAttention("fast", sm_count=64, block_n=16))
    expected = paged_attention(q, k, v, reference_cache, meta, d**-0.5)  # the torch backend
    assert torch.equal(cache, reference_cache)  # the same KV written
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- the invariant mode: bits that depend on the sequence alone -----------------------------------------------


def _invariant(tps: int = 16, block_n: int = 16) -> TritonAttention:
    return TritonAttention("invariant", sm_count=132, invariant_tokens_per_split=tps, block_n=block_n)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_decode_alone_equals_in_a_batch(dtype):
    bs, d, heads, kvh = 4, 16, 2, 1
    lens = LONG_TAIL + [1, 1]  # two decode padding rows (position 0, one slot)
    cache, tables = _pool(lens, bs, kvh, d, dtype)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV)
    backend = _invariant()
    batch = backend.decode(q, cache, _decode_meta(tables, lens, bs), d**-0.5)
    for row in (0, 2):  # 1 and 17 tokens: alone their table is narrower than the batch's (70 tokens)
        width = -(-lens[row] // bs)
        alone = backend.decode(q[row : row + 1], cache, _decode_meta(tables[row : row + 1, :width], lens[row : row + 1], bs),
                               d**-0.5)
        assert torch.equal(alone[0], batch[row])
    pair = backend.decode(q[[3, 1]], cache, _decode_meta(tables[[3, 1]], [70, 3], bs), d**-0.5)  # other order, other batch
    assert torch.equal(pair[0], batch[3]) and torch.equal(pair[1], batch[1])
    torch.testing.assert_close(batch[:4].float(), _reference(q[:4], cache, _decode_meta(tables[:4], LONG_TAIL, bs), d**-0.5),
                               **_tol(dtype))


@needs_triton
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 1)])  # (2, 1): KV replicated at TP2, the group halves
def test_invariant_decode_with_half_the_heads_equals_those_heads(heads, kv_heads):
    bs, d = 8, 16
    cache, tables = _pool(LONG_TAIL, bs, kv_heads, d, torch.bfloat16)
    q = torch.randn(len(LONG_TAIL), heads, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    meta = _decode_meta(tables, LONG_TAIL, bs)
    backend = _invariant(32)  # 3 splits for 70 tokens
    full = backend.decode(q, cache, meta, d**-0.5)
    half_kv = max(kv_heads // 2, 1)
    for rank in range(2):  # each TP2 rank's own heads and its own (contiguous) KV pool
        kv = slice(rank * half_kv, (rank + 1) * half_kv) if kv_heads > 1 else slice(0, 1)
        mine = slice(rank * heads // 2, (rank + 1) * heads // 2)
        out = backend.decode(q[:, mine].contiguous(), cache[:, :, :, kv].contiguous(), meta, d**-0.5)
        assert torch.equal(out, full[:, mine])


# --- prefill --------------------------------------------------------------------------------------------------


def _prefill_meta(starts: list[int], news: list[int], tables: torch.Tensor, bs: int, as_decode: bool = False):
    """The step builder's metadata for sequences with ``starts`` cached tokens and ``news`` new ones."""
    builder = StepInputBuilder(bs, torch.device(DEV), vocab_size=32, prefill_as_decode=as_decode)
    seqs = [SeqStep(i, [1] * n, s, block_table=[int(b) for b in tables[i]]) for i, (s, n) in enumerate(zip(starts, news))]
    return builder.build(StepCommand(0, True, seqs), samples=False).attn


@needs_triton
@pytest.mark.parametrize("starts,news,heads,kv_heads,dtype", [
    ([0, 0, 0], [5, 1, 12], 4, 2, torch.float32),  # ragged prompts, nothing cached
    ([3, 8, 0, 16], [4, 1, 12, 2], 4, 2, torch.float32),  # with cached context (prefix cache, chunked prefill)
    ([3, 8, 0, 16], [4, 1, 12, 2], 6, 3, torch.bfloat16),
])
def test_varlen_prefill_matches_torch(starts, news, heads, kv_heads, dtype):
    bs, d = 4, 16
    cache, tables = _pool([s + n for s, n in zip(starts, news)], bs, kv_heads, d, dtype)
    meta = _prefill_meta(starts, news, tables, bs)
    assert meta.cu_seqlens.tolist() == [0] + torch.tensor(news).cumsum(0).tolist()
    q = torch.randn(sum(news), heads, d, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEV)
    backend = TritonAttention("fast", prefill_tiles=(8, 8))  # tiles smaller than the longest prompt: several per row
    got = backend.prefill(q, cache, meta, d**-0.5)
    torch.testing.assert_close(got.float(), _reference(q, cache, meta, d**-0.5), **_tol(dtype))


@needs_triton
def test_invariant_prefill_equals_decoding_each_token():
    """The invariant prefill is the decode path, row by row: a re-prefilled token gets the bits it was decoded with."""
    bs, d, starts, news = 4, 16, [3, 0, 16], [3, 6, 2]
    cache, tables = _pool([s + n for s, n in zip(starts, news)], bs, 1, d, torch.bfloat16)
    q = torch.randn(sum(news), 2, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(DEV)
    backend = _invariant()
    prefilled = backend.prefill(q, cache, _prefill_meta(starts, news, tables, bs), d**-0.5)
    as_decode = _prefill_meta(starts, news, tables, bs, as_decode=True)  # what the engine builds in this mode
    assert not as_decode.is_prefill
    assert torch.equal(prefilled, backend.decode(q, cache, as_decode, d**-0.5))
    last = sum(news) - 1  # the last token of the last sequence, decoded alone at position 17
    alone = backend.decode(q[last:], cache, _decode_meta(tables[2:], [18], bs), d**-0.5)
    assert torch.equal(alone[0], prefilled[last])


# --- compiled, on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_match_torch_and_keep_invariance(dtype):
    from pat_kernels.paged_decode_attention import paged_decode_attention

    bs, d, heads, kvh = 16, 128, 32, 8
    lens = [1, 100, 1000, 5000]
    cache, tables = _pool(lens, bs, kvh, d, dtype)
    meta = _decode_meta(tables, lens, bs)
    q = torch.randn(len(lens), heads, d, device=DEV).to(dtype)
    tol = _tol(dtype) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for split in ({"tokens_per_split": 256}, {"num_splits": 7}, {}):
        got = paged_decode_attention(q, cache[0], cache[1], tables, meta.context_lens, d**-0.5, **split)
        torch.testing.assert_close(got.float(), _reference(q, cache, meta, d**-0.5), **tol)
        for _ in range(3):  # the fused reduce: the last split merges what the others stored
            fused = paged_decode_attention(q, cache[0], cache[1], tables, meta.context_lens, d**-0.5,
                                           fuse_reduce=True, **split)
            torch.testing.assert_close(fused.float(), got.float(), atol=1e-6, rtol=1e-6)
    backend = _invariant(INVARIANT_TOKENS_PER_SPLIT, block_n=64)
    full = backend.decode(q, cache, meta, d**-0.5)
    alone = backend.decode(q[1:2], cache, _decode_meta(tables[1:2, : -(-100 // bs)], [100], bs), d**-0.5)
    assert torch.equal(alone[0], full[1])
    half = backend.decode(q[:, 16:].contiguous(), cache[:, :, :, 4:].contiguous(), meta, d**-0.5)
    assert torch.equal(half, full[:, 16:])
    starts, news = [0, 37, 500], [300, 1, 64]
    cache, tables = _pool([s + n for s, n in zip(starts, news)], bs, kvh, d, dtype)
    pmeta = _prefill_meta(starts, news, tables, bs)
    q = torch.randn(sum(news), heads, d, device=DEV).to(dtype)
    out = TritonAttention("fast").prefill(q, cache, pmeta, d**-0.5)
    torch.testing.assert_close(out.float(), _reference(q, cache, pmeta, d**-0.5), **tol)
