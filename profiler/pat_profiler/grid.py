"""The sparse profiling grid: layouts x batch sizes x context lengths inside a KV token budget."""

from __future__ import annotations

from dataclasses import dataclass

# Denser at short contexts, where latency bends most (paper Sec. 4.2).
DEFAULT_CONTEXTS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GridPoint:
    tp: int
    batch: int  # per DP group
    context: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.tp, self.batch, self.context)


def build_grid(tps: list[int], batches: list[int], contexts: list[int], window: int, budget_tokens: int,
               max_position: int, max_num_seqs: int) -> list[GridPoint]:
    """Points with batch * (context + window) <= budget (per DP group) that the model can run."""
    out = []
    for tp in tps:
        for b in batches:
            if b > max_num_seqs:
                continue
            for c in contexts:
                if c + window + 2 > max_position:
                    continue
                if b * (c + window + 2) > budget_tokens:
                    continue
                out.append(GridPoint(tp, b, c))
    return out
