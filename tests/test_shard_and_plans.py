"""Shard specs and the reshard / KV-migration planners, checked against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from pat_engine.parallel.shard_spec import Component, column_parallel, row_parallel, vocab_parallel
from pat_engine.parallel.kv_plan import KVRun, kv_heads_of, plan_kv_moves
from pat_engine.parallel.layout import Layout, candidate_layouts
from pat_engine.parallel.reshard_plan import allgather_bytes, plan_moves


def shard_of(full: torch.Tensor, spec, rank: int, tp: int) -> torch.Tensor:
    out = torch.zeros(spec.local_shape(tp), dtype=full.dtype)
    dim = spec.split_dim
    for p in spec.pieces(rank, tp):
        out.narrow(dim, p.local_start, p.length).copy_(full.narrow(dim, p.start, p.length))
    return out


QKV = column_parallel(8, Component(8 * 2, unit=2), Component(2 * 2, unit=2, replicate=True), Component(2 * 2, unit=2, replicate=True))
SPECS = [QKV, row_parallel(8, 16, unit=2), vocab_parallel(10, 3), column_parallel(4, Component(12), Component(12))]


def test_qkv_pieces_replicate_kv_heads_beyond_their_count():
    # 8 q heads, 2 kv heads (head_dim 2) over tp=4: each rank 2 q heads, ranks {0,1} share kv head 0
    assert [tuple(p) for p in QKV.pieces(1, 4)] == [(4, 8, 0), (16, 18, 4), (20, 22, 6)]
    assert [tuple(p) for p in QKV.pieces(2, 4)] == [(8, 12, 0), (18, 20, 4), (22, 24, 6)]
    assert QKV.local_shape(4) == (8, 8)


def test_vocab_padding_when_tp_does_not_divide():
    spec = vocab_parallel(10, 3)
    assert spec.local_shape(4) == (3, 3)
    assert [tuple(p) for p in spec.pieces(3, 4)] == [(9, 10, 0)]


def test_unsplittable_tp_is_refused():
    with pytest.raises(ValueError):
        column_parallel(4, Component(6, unit=2)).local_shape(2)


@pytest.mark.parametrize("spec", SPECS)
def test_moves_rebuild_every_new_shard_exactly(spec):
    world = 4
    full = torch.randn(spec.full_shape, dtype=torch.float64)
    for old, new in itertools.permutations(candidate_layouts(world), 2):
        olds = {r: shard_of(full, spec, old.tp_rank(r), old.tp) for r in range(world)}
        rebuilt = {r: torch.zeros(spec.local_shape(new.tp), dtype=torch.float64) for r in range(world)}
        for mv in plan_moves(spec, old, new):
            n = mv.stop - mv.start
            src = olds[mv.src].narrow(spec.split_dim, mv.src_local, n)
            rebuilt[mv.dst].narrow(spec.split_dim, mv.dst_local, n).copy_(src)
        for r in range(world):
            assert torch.equal(rebuilt[r], shard_of(full, spec, new.tp_rank(r), new.tp)), (old, new, r)


def test_merging_replicas_needs_no_communication_and_beats_allgather():
    spec = SPECS[0]
    moves = plan_moves(spec, Layout(1, 4), Layout(4, 1))
    assert moves and all(m.src == m.dst for m in moves)  # TP1->TP4: every new shard lies inside the old one
    split = plan_moves(spec, Layout(2, 2), Layout(4, 1))
    sent = sum(m.stop - m.start for m in split if m.src != m.dst)
    gathered = sum(allgather_bytes(spec, Layout(2, 2), Layout(4, 1), row_bytes=8, dst=r) for r in range(4))
    assert 0 < sent * 8 < gathered


def test_kv_plan_covers_every_needed_head_once():
    placements = [KVRun(5, 0, (0, 1), 0, (3, 4)), KVRun(3, 1, (2,), 0, (5,))]
    for num_kv in (2, 4):
        for old, new in itertools.permutations(candidate_layouts(4), 2):
            # move seq 8 from group 1 of the old layout only when it exists
            ps = [p if p.src_group < old.dp and p.dst_group < new.dp else
                  KVRun(p.num_tokens, 0, p.src_table, 0, p.dst_table) for p in placements]
            moves = plan_kv_moves(ps, old, new, num_kv)
            for i, p in enumerate(ps):
                for dst in new.group_ranks(p.dst_group):
                    got = sorted(h for m in moves if m.dst == dst and m.run == i for h in m.heads)
                    assert got == list(kv_heads_of(new.tp_rank(dst), new.tp, num_kv))
                    for m in moves:
                        if m.dst == dst and m.run == i:
                            assert m.src in old.group_ranks(p.src_group)
                            assert set(m.heads) <= set(kv_heads_of(old.tp_rank(m.src), old.tp, num_kv))
