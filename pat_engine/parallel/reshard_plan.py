"""Weight resharding plan: which rows each rank lacks after a layout change, and who sends them.

Pure functions of (shard spec, old layout, new layout). Every rank computes
the same plan, so senders and receivers agree without exchanging it.

For each rank and each piece of its new shard: the part it already holds is
a local copy; the rest comes from a rank that holds it in the old layout
(every old DP group holds a full copy), chosen to spread the bytes sent
evenly. Nothing more than the missing rows moves, which is never more than
the paper's all-gather-and-slice (``allgather_bytes`` computes that volume
for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.parallel.shard_spec import Piece, ShardSpec
from pat_engine.parallel.layout import Layout


@dataclass(frozen=True)
class Move:
    """Rows ``[start, stop)`` (full-tensor coordinates, along the split dim) from ``src`` to ``dst``."""

    src: int
    dst: int
    start: int
    stop: int
    src_local: int  # where the rows start in the source's old shard
    dst_local: int  # where they go in the destination's new shard


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if hi > lo else None


def _subtract(need: list[tuple[int, int]], have: tuple[int, int]) -> list[tuple[int, int]]:
    out = []
    for a, b in need:
        ov = _overlap(a, b, *have)
        if ov is None:
            out.append((a, b))
            continue
        if a < ov[0]:
            out.append((a, ov[0]))
        if ov[1] < b:
            out.append((ov[1], b))
    return out


def plan_moves(spec: ShardSpec, old: Layout, new: Layout, load: dict[int, int] | None = None) -> list[Move]:
    """All row moves for one parameter, local copies (src == dst) included.

    ``load`` (bytes-per-row units already assigned to each source) is updated
    so that consecutive parameters keep the senders balanced.
    """
    if spec.replicated:
        return []
    load = {} if load is None else load
    world = new.world
    old_pieces = {s: spec.pieces(old.tp_rank(s), old.tp) for s in range(world)}
    moves: list[Move] = []
    for dst in range(world):
        for piece in spec.pieces(new.tp_rank(dst), new.tp):
            remaining = [(piece.start, piece.stop)]
            # 1. what dst already holds
            for have in old_pieces[dst]:
                for a, b in list(remaining):
                    ov = _overlap(a, b, have.start, have.stop)
                    if ov:
                        moves.append(_move(dst, dst, ov, have, piece))
                remaining = _subtract(remaining, (have.start, have.stop))
            # 2. the rest from the least loaded holder (nearest rank breaks ties)
            for a, b in remaining:
                cursor = a
                while cursor < b:
                    holders = [
                        (load.get(s, 0), abs(s - dst), s, h)
                        for s in range(world) if s != dst
                        for h in old_pieces[s] if h.start <= cursor < h.stop
                    ]
                    if not holders:
                        raise RuntimeError(f"no rank holds row {cursor} in the old layout {old}")
                    _, _, src, have = min(holders)
                    stop = min(b, have.stop)
                    moves.append(_move(src, dst, (cursor, stop), have, piece))
                    load[src] = load.get(src, 0) + (stop - cursor)
                    cursor = stop
    return moves


def _move(src: int, dst: int, rows: tuple[int, int], have: Piece, want: Piece) -> Move:
    a, b = rows
    return Move(src, dst, a, b, have.local_start + (a - have.start), want.local_start + (a - want.start))


def allgather_bytes(spec: ShardSpec, old: Layout, new: Layout, row_bytes: int, dst: int) -> int:
    """Bytes rank ``dst`` would receive under the paper's all-gather-and-slice, for comparison.

    A rank whose new shard is not inside its old one gathers every other
    member's old shard within its new TP group, then slices.
    """
    if spec.replicated:
        return 0
    mine = spec.pieces(old.tp_rank(dst), old.tp)
    need = spec.pieces(new.tp_rank(dst), new.tp)
    if all(any(h.start <= p.start and p.stop <= h.stop for h in mine) for p in need):
        return 0
    peers = [s for s in new.group_ranks(new.group_of(dst)) if s != dst]
    return sum(p.length for s in peers for p in spec.pieces(old.tp_rank(s), old.tp)) * row_bytes
