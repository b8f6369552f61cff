"""KV migration plan: which KV heads of which run of tokens each target rank needs, and from whom.

A ``KVRun`` is a run of valid tokens in some blocks of an old DP group that
lands in blocks of a new DP group: a sequence's own blocks, or a prefix its
samples share (moved once per target group). Pure function of the runs and
the two layouts; every rank computes the same plan. A target rank needs the
KV heads of its new TP rank for every run landing in its new DP group; it
copies those it already holds and receives the others from a rank of the
run's old group that holds them (with KV-head replication, the least loaded
one). Only valid tokens move, never whole blocks of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.parallel.layout import Layout


@dataclass(frozen=True)
class KVRun:
    num_tokens: int  # valid tokens, from the start of ``src_table`` (and of ``dst_table``)
    src_group: int
    src_table: tuple[int, ...]
    dst_group: int
    dst_table: tuple[int, ...]


@dataclass(frozen=True)
class KVMove:
    src: int
    dst: int
    run: int  # index into the runs list
    heads: tuple[int, ...]  # global KV head ids, ascending


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: tp > num_kv_heads gives each rank one head, shared by tp / num_kv_heads ranks."""
    return max(1, num_kv_heads // tp)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int, tp: int) -> int:
    """KV cache bytes one token takes on one rank: K and V of every layer for the rank's heads."""
    return 2 * num_layers * kv_heads_per_rank(num_kv_heads, tp) * head_dim * element_size


def kv_heads_of(tp_rank: int, tp: int, num_kv_heads: int) -> range:
    """KV heads held by a TP rank (with replication, one head shared by tp / num_kv_heads ranks)."""
    if num_kv_heads % tp == 0:
        per = num_kv_heads // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // num_kv_heads)
    return range(head, head + 1)


def plan_kv_moves(runs: list[KVRun], old: Layout, new: Layout, num_kv_heads: int) -> list[KVMove]:
    load: dict[int, int] = {}
    moves: list[KVMove] = []
    for index, p in enumerate(runs):
        sources = old.group_ranks(p.src_group)
        for dst in new.group_ranks(p.dst_group):
            by_src: dict[int, list[int]] = {}
            for head in kv_heads_of(new.tp_rank(dst), new.tp, num_kv_heads):
                holders = [s for s in sources if head in kv_heads_of(old.tp_rank(s), old.tp, num_kv_heads)]
                src = dst if dst in holders else min(holders, key=lambda s: (load.get(s, 0), abs(s - dst), s))
                if src != dst:
                    load[src] = load.get(src, 0) + p.num_tokens
                by_src.setdefault(src, []).append(head)
            for src, heads in sorted(by_src.items()):
                moves.append(KVMove(src, dst, index, tuple(heads)))
    return moves


def token_slots(table: tuple[int, ...], num_tokens: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
