"""A (tp, dp) layout over a fixed world of ranks, and its canonical rank mapping.

DP group ``g`` holds global ranks ``g*tp .. g*tp+tp-1`` and TP rank ``t`` of a
group owns shard ``t`` of every sharded tensor. Layers, collectives, the
resharder and CUDA graphs all rely on this mapping, so it never varies.
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.errors import LayoutError


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}xDP{self.dp}"

    @classmethod
    def for_world(cls, world: int, tp: int) -> "Layout":
        if tp < 1 or world % tp:
            raise LayoutError(f"tp={tp} does not divide the world size {world}")
        if tp & (tp - 1):
            raise LayoutError(f"tp={tp} must be a power of two")
        return cls(tp=tp, dp=world // tp)

    def group_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def leader(self, group: int) -> int:
        return group * self.tp

    def all_groups(self) -> list[list[int]]:
        # The whole layout in one reshape: rows are TP groups.
        return [self.group_ranks(g) for g in range(self.dp)]


def candidate_layouts(world: int) -> list[Layout]:
    """Every power-of-two TP degree dividing ``world``, smallest TP first."""
    out = []
    tp = 1
    while tp <= world:
        if world % tp == 0:
            out.append(Layout(tp, world // tp))
        tp *= 2
    return out
