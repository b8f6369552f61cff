"""The fixed summation tree of a row-parallel product (``numerics="invariant"``, docs/numerics.md).

A row-parallel weight ``(out, in)`` has its input dim cut into ``chunks`` equal pieces, chunks =
the declared reduction width (``ModelArch.reduction_width(max_tp)``: the largest TP up to
``EngineConfig.max_tp`` the model allows, a power of two, whatever the world), so every TP ``t``
a deployment may use gives each rank ``chunks / t`` whole, consecutive chunks. Each chunk's
partial product (float32, float64 for float64 models) is a leaf of one binary tree over
``[0, chunks)``: node ``[lo, hi)`` = node ``[lo, mid)`` + node ``[mid, hi)``, ``mid = (lo + hi) // 2``.
Every layout of every deployment size evaluates exactly this tree on exactly these leaves, so
the sum has the same bits at every TP and world: a rank's chunks form a node, which it sums
itself (model/chunk_weights.py), the group all-gathers one node per rank, and every rank sums the
upper levels from the gathered nodes, in the tree's order: the collective only moves bits, it
never adds (an all-reduce's order is its own business).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pat_engine.parallel.comm import TPGroup

Span = tuple[int, int]  # [lo, hi) in chunks


@dataclass(frozen=True)
class ReductionTree:
    chunks: int  # leaves: the input dim's fixed pieces (= max_tp)

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"a reduction tree needs at least one chunk, got {self.chunks}")

    def local_chunks(self, tp: int) -> int:
        """How many chunks each rank of a TP ``tp`` group holds."""
        if self.chunks % tp:
            raise ValueError(f"TP {tp} does not divide the {self.chunks} chunks of the reduction tree")
        return self.chunks // tp

    def is_node(self, span: Span, lo: int = 0, hi: int | None = None) -> bool:
        hi = self.chunks if hi is None else hi
        if span == (lo, hi):
            return True
        if hi - lo <= 1 or not (lo <= span[0] and span[1] <= hi):
            return False
        mid = (lo + hi) // 2
        return self.is_node(span, lo, mid) or self.is_node(span, mid, hi)

    def ranks_are_nodes(self, tp: int) -> bool:
        """Whether every rank's chunks of a TP ``tp`` group form one node (the rank pre-sums them)."""
        n = self.local_chunks(tp)
        return all(self.is_node((r * n, (r + 1) * n)) for r in range(tp))

    def sum(self, known: dict[Span, torch.Tensor], lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Node ``[lo, hi)`` of the tree, from ``known`` node values (at least every leaf below it,
        or nodes covering them)."""
        hi = self.chunks if hi is None else hi
        value = known.get((lo, hi))
        if value is not None:
            return value
        if hi - lo <= 1:
            raise KeyError(f"chunk {lo} of the reduction tree has no value")
        mid = (lo + hi) // 2
        return self.sum(known, lo, mid) + self.sum(known, mid, hi)

    def reduce(self, node: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        """``node``: this rank's chunks summed, the tree node they form (``sum_stacked``). Returns the
        tree's root (the full sum), the same bits on every rank and at every TP: the group all-gathers
        one node per rank and every rank sums the upper levels in the tree's order."""
        if tp.size == 1:
            return node
        if not self.ranks_are_nodes(tp.size):
            raise ValueError(f"TP {tp.size}: a rank's chunks of the {self.chunks}-chunk tree are not one node")
        gathered = tp.all_gather(node)  # (size, ...) in rank order
        return self.sum_stacked(gathered, 0, span=self.local_chunks(tp.size))

    def sum_stacked(self, nodes: torch.Tensor, first: int, span: int = 1) -> torch.Tensor:
        """The node covering ``nodes``: (count, ...) consecutive tree nodes of ``span`` chunks each, the
        first starting at chunk ``first``. Where pairing adjacent nodes level by level is the tree's own
        order (a power-of-two count whose every pair is a node), summed so, a level at a time; otherwise
        node by node."""
        count = nodes.shape[0]
        if self._pairs_are_nodes(first, count, span):
            while nodes.shape[0] > 1:
                nodes = nodes[0::2] + nodes[1::2]
            return nodes[0]
        known = {(first + i * span, first + (i + 1) * span): nodes[i] for i in range(count)}
        return self.sum(known, first, first + count * span)

    @functools.lru_cache(maxsize=256)
    def _pairs_are_nodes(self, first: int, count: int, span: int) -> bool:
        if count & (count - 1):
            return False
        while True:
            if not all(self.is_node((first + i * span, first + (i + 1) * span)) for i in range(count)):
                return False
            if count == 1:
                return True
            count, span = count // 2, span * 2
