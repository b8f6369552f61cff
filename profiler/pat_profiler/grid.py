"""The sparse profiling grid: layouts x batch sizes x context lengths inside a KV token budget."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Denser at short contexts, where latency bends most (paper Sec. 4.2).
DEFAULT_CONTEXTS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GridPoint:
    tp: int
    batch: int  # per DP group
    context: int
    repeat: int = 0

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.tp, self.batch, self.context, self.repeat)


def build_grid(tps: list[int], batches: list[int], contexts: list[int], window: int, budget_tokens: int,
               max_position: int, max_num_seqs: int, passes: int = 1) -> list[GridPoint]:
    """Points with batch * (context + window) <= budget (per DP group) that the model can run.

    With ``passes > 1`` the whole grid is measured again after the first pass, so each point's
    measurements lie minutes apart and a slow spell of a shared host does not bias single points.
    """
    one = []
    for tp in tps:
        for b in batches:
            if b > max_num_seqs:
                continue
            for c in contexts:
                if c + window + 2 > max_position:
                    continue
                if b * (c + window + 2) > budget_tokens:
                    continue
                one.append(GridPoint(tp, b, c))
    return [replace(p, repeat=r) for r in range(passes) for p in one]
