"""A TP group whose ranks are threads of this process: layers called with it run their collectives over a
barrier, so a layer's TP1 = TP2 = TP4 bits can be checked in the fast tier without worker processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadGroup:
    """One rank of a TP group whose ranks are threads: the collectives the layers call."""

    def __init__(self, rank: int, size: int, barrier: threading.Barrier, slots: list):
        self.rank, self.size, self._barrier, self._slots = rank, size, barrier, slots

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._slots[self.rank] = x
        self._barrier.wait()
        out = torch.stack(list(self._slots))
        self._barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # rank order, like the shared-memory path
        parts = self.all_gather(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total


def run_ranks(tp: int, rank_fn: Callable[[int, ThreadGroup], Any]) -> list[Any]:
    """``rank_fn(rank, group)`` on ``tp`` threads forming one group; their results in rank order."""
    barrier, slots, results = threading.Barrier(tp), [None] * tp, [None] * tp

    def rank(r: int) -> None:
        results[r] = rank_fn(r, ThreadGroup(r, tp, barrier, slots))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def single_rank() -> ThreadGroup:
    """A group of one (its collectives return their input, as a TP1 group's)."""
    return ThreadGroup(0, 1, threading.Barrier(1), [None])
