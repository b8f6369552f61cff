"""The Triton paged decode kernel equals the torch path (run by Triton's CPU interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from pat_engine.model.layers.attention import AttentionMetadata, paged_attention

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of triton
triton = pytest.importorskip("triton", reason="Triton is not installed (optional GPU extra)")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (2, 1)])
def test_triton_decode_matches_torch(heads, kv_heads):
    from pat_kernels.paged_decode_attention import paged_decode_attention

    g = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bs, d, blocks = 4, 16, 12
    lengths = [5, 9, 1]
    tables = torch.tensor([[3, 7, 0], [1, 2, 11], [4, 0, 0]])
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g).to(dev)
    q = torch.randn(len(lengths), heads, d, generator=g).to(dev)
    new_k = torch.randn(len(lengths), kv_heads, d, generator=g).to(dev)
    new_v = torch.randn(len(lengths), kv_heads, d, generator=g).to(dev)
    pos = torch.tensor(lengths) - 1
    slots = tables[torch.arange(3), pos // bs] * bs + pos % bs
    nb = tables.shape[1]
    meta = AttentionMetadata(False, slots.to(dev), query_len=1, block_tables=tables.to(dev),
                             mask=(torch.arange(nb * bs)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :].to(dev))
    reference = paged_attention(q, new_k, new_v, cache, meta, d**-0.5)  # writes the new K/V, then attends
    got = paged_decode_attention(q, cache[0], cache[1], tables.to(dev), torch.tensor(lengths).to(dev), d**-0.5)
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-5)
