"""Logit processors applied to a whole batch at once: logit bias, penalties, min_p.

Order, as Hugging Face applies them: logit bias; repetition penalty (Hugging Face
semantics: over prompt and output tokens, a positive logit divided by the
penalty, a negative one multiplied); frequency and presence penalties (OpenAI
semantics: over output tokens only, ``logit -= frequency * count + presence *
(count > 0)``); then temperature; then min_p (keep tokens whose probability is at
least ``min_p`` times the most likely one's). Rows without a processor are
untouched; the tensors cover only the rows that use one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pat_engine.host_tensors import to_device


@dataclass
class ProcessorRows:
    """Per-row processor settings of one step for the rows (of the batch) that have any."""

    rows: torch.Tensor  # int64 (R,): batch rows
    repetition: torch.Tensor  # float64 (R, 1); 1 = off
    frequency: torch.Tensor  # float64 (R, 1); 0 = off
    presence: torch.Tensor  # float64 (R, 1); 0 = off
    seen: torch.Tensor | None  # bool (R, V): tokens of prompt and output (rows with a repetition penalty)
    counts: torch.Tensor | None  # float64 (R, V): output token counts (rows with frequency/presence)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, value), row into ``rows``

    @classmethod
    def build(cls, rows: list[int], repetition: list[float], frequency: list[float], presence: list[float],
              histories: list[list[int]], prompt_lens: list[int], biases: list[tuple[tuple[int, float], ...]],
              vocab: int, device: torch.device | str = "cpu") -> "ProcessorRows":
        """``histories[i]``: every token of row ``rows[i]`` so far (prompt, then output)."""
        n = len(rows)

        def column(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float64, device).view(n, 1)

        seen = counts = None
        if any(r != 1.0 for r in repetition):
            seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
            for i, h in enumerate(histories):
                if h:
                    seen[i, to_device(h, torch.long, device)] = True
        if any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence):
            counts = torch.zeros(n, vocab, dtype=torch.float64, device=device)
            for i, (h, start) in enumerate(zip(histories, prompt_lens)):
                out = h[start:]
                if out:
                    ids = to_device(out, torch.long, device)
                    counts[i].index_add_(0, ids, torch.ones(len(out), dtype=torch.float64, device=device))
        bias = None
        entries = [(i, t, b) for i, pairs in enumerate(biases) for t, b in pairs]
        if entries:
            r, t, b = zip(*entries)
            bias = (to_device(r, torch.long, device), to_device(t, torch.long, device),
                    to_device(b, torch.float64, device))
        return cls(to_device(rows, torch.long, device), column(repetition), column(frequency),
                   column(presence), seen, counts, bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias and penalties on ``logits`` (B, V) float64; returns a new tensor."""
        sub = logits.index_select(0, self.rows)
        if self.bias is not None:
            r, t, b = self.bias
            sub = sub.index_put((r, t), b, accumulate=True)
        if self.seen is not None:
            penalized = torch.where(sub < 0, sub * self.repetition, sub / self.repetition)
            sub = torch.where(self.seen, penalized, sub)
        if self.counts is not None:
            sub = sub - self.frequency * self.counts - self.presence * (self.counts > 0).to(sub.dtype)
        return logits.index_copy(0, self.rows, sub)
