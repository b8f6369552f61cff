"""Vocab-parallel embedding and LM head (the vocab dim is split, padded if needed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model import gpu_gemm
from pat_engine.model.layers.linear import linear, sharded_parameter
from pat_engine.parallel.shard_spec import vocab_parallel
from pat_engine.parallel.comm import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: int, dtype, device):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = sharded_parameter(vocab_parallel(vocab_size, hidden_size), tp, dtype, device)

    def forward(self, ids: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        if tp.size == 1:
            return F.embedding(ids, self.weight)
        start, stop, _ = self.weight.shard_spec.pieces(tp.rank, tp.size)[0]
        mine = (ids >= start) & (ids < stop)
        out = F.embedding((ids - start) * mine, self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)  # rows owned elsewhere contribute zero
        return tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Local logits over this rank's vocab slice; TP rank 0 gathers the full row."""

    is_gemm_weight = True  # packed for the CPU GEMM (model/cpu_gemm.py)

    def __init__(self, vocab_size: int, hidden_size: int, tp: int, dtype, device, tied_to: nn.Parameter | None = None,
                 invariant: bool = False):
        super().__init__()
        self.vocab_size = vocab_size
        self.invariant = invariant  # the invariant numerics mode's GEMM (layers/linear.py ``linear``)
        self.skinny_rows = 0 if invariant else gpu_gemm.skinny_rows(device, dtype, lm_head=True)  # few-row steps' GEMM
        if tied_to is not None:
            self.weight = tied_to  # same Parameter object: loaded and resharded once
        else:
            self.weight = sharded_parameter(vocab_parallel(vocab_size, hidden_size), tp, dtype, device)

    def forward(self, hidden: torch.Tensor, tp: TPGroup) -> torch.Tensor | None:
        local = linear(hidden, self.weight, invariant=self.invariant, skinny_rows=self.skinny_rows)
        logits = tp.gather_to_leader(local, dim=-1)
        return None if logits is None else logits[:, : self.vocab_size]
