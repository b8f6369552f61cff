"""Token sampling that gives the same draw under every layout, for a whole batch in one pass.

Each draw uses one uniform number that depends only on ``(seed, position)``
(a SplitMix64 hash), so a request sampled under TP1xDP4, TP4xDP1 or after a
recompute picks the same token: the logits are the same, and so is the
random number. Greedy is argmax.

The rule for a sampled row (float64): softmax of ``logits / temperature``, tokens in
descending probability (ties: lower id first), the first ``top_k`` of them, cut to the
smallest prefix whose mass reaches ``top_p``; the token is the first whose running mass
exceeds ``u * kept mass``. The batch runs this as tensor ops over all sampled rows at
once: a ``topk`` of the largest ``top_k`` (a full sort only for rows without a ``top_k``),
per-row cut-offs as tensors, one host transfer at the end.

Per-row settings travel as tensors in ``SamplingBatch`` (built once per step from the
specs); logit processors that come later (penalties, min_p, logit_bias) are more
per-row tensors applied in ``SamplingBatch.process`` before the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0**-53


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps modulo 2**64, so the bits match the Python version above
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``uniform_for`` for every row at once; seeds and positions: int64 (B,) -> float64 (B,)."""
    bits = _shr(_splitmix64_t(_splitmix64_t(seeds) ^ positions), 11)
    return bits.to(torch.float64) * 2.0**-53  # < 2**53: exact


@dataclass(frozen=True)
class SamplingSpec:
    """What a worker needs to sample one sequence (sent once per admission)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    processed_logprobs: bool = False  # log-prob under the distribution sampled from, not the raw logits


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step as tensors (row ``i`` is the batch's ``i``-th sequence)."""

    sampled: torch.Tensor  # int64 (S,): rows drawn at random (temperature > 0); the rest are greedy
    # the rest are None when no row is sampled
    temperature: torch.Tensor | None  # float64 (S, 1)
    top_k: torch.Tensor | None  # int64 (S,), <= 0 means off
    top_p: torch.Tensor | None  # float64 (S, 1)
    seeds: torch.Tensor | None  # int64 (S,): the seeds' 64 bits
    positions: torch.Tensor | None  # int64 (S,): index the new token takes in its sequence
    max_top_k: int  # largest top_k among sampled rows, 0 when some row has none (needs a full sort)
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) that may not be drawn
    logprobs: bool  # any row wants log-probs
    processed_rows: torch.Tensor | None  # bool (S,): sampled rows that report the processed log-prob

    @classmethod
    def build(cls, specs: list[SamplingSpec], positions: list[int],
              suppressed: list[tuple[int, ...]] | None = None, device: torch.device | str = "cpu") -> "SamplingBatch":
        rows = [i for i, s in enumerate(specs) if s.temperature != 0.0]
        chosen = [specs[i] for i in rows]
        top_ks = [s.top_k for s in chosen]
        banned_rows = [i for i, ids in enumerate(suppressed or ()) for _ in ids]
        banned_ids = [t for ids in (suppressed or ()) for t in ids]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            sampled=tensor(rows, torch.long),
            temperature=tensor([s.temperature for s in chosen], torch.float64).view(-1, 1) if rows else None,
            top_k=tensor(top_ks, torch.long) if rows else None,
            top_p=tensor([s.top_p for s in chosen], torch.float64).view(-1, 1) if rows else None,
            seeds=tensor([s.seed & _MASK64 for s in chosen], torch.uint64).view(torch.long) if rows else None,
            positions=tensor([positions[i] for i in rows], torch.long) if rows else None,
            max_top_k=0 if any(k <= 0 for k in top_ks) else max(top_ks, default=0),
            suppressed=(tensor(banned_rows, torch.long), tensor(banned_ids, torch.long)) if banned_ids else None,
            logprobs=any(s.logprobs for s in specs),
            processed_rows=tensor([s.processed_logprobs for s in chosen], torch.bool) if rows else None,
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit processors that apply to every row (today: tokens suppressed before min_new_tokens)."""
        if self.suppressed is not None:
            logits = logits.index_put(self.suppressed, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        return logits


def _descending(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row in the order of a stable descending sort (``k`` = 0: all)."""
    vocab = probs.shape[-1]
    if k <= 0 or k >= vocab:
        return probs.sort(dim=-1, descending=True, stable=True)
    values, order = probs.topk(k, dim=-1, sorted=False)
    # a stable sort puts equal values by ascending id: sort the candidates by id, then stably by value
    order, by_id = order.sort(dim=-1)
    values = values.gather(-1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, by_value)
    # a tie across the k-th place may have let topk keep a larger id than the stable sort would
    ties = (probs >= values[:, -1:]).sum(dim=-1) > k
    if bool(ties.any()):
        full_values, full_order = probs[ties].sort(dim=-1, descending=True, stable=True)
        values[ties], order[ties] = full_values[:, :k], full_order[:, :k]
    return values, order


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and processed log-probs of the sampled rows; logits: (S, vocab) float64."""
    probs = torch.softmax(logits / batch.temperature, dim=-1)
    probs, order = _descending(probs, batch.max_top_k)  # (S, K)
    width = probs.shape[-1]
    keep = torch.where(batch.top_k > 0, batch.top_k.clamp(max=width), width)
    cum = probs.cumsum(dim=-1)
    # smallest prefix whose mass reaches top_p (at least one token); top_p = 1 keeps everything
    nucleus = (cum < batch.top_p).sum(dim=-1) + 1
    keep = torch.where(batch.top_p.squeeze(1) < 1.0, torch.minimum(keep, nucleus), keep)
    total = cum.gather(-1, (keep - 1).unsqueeze(1))  # (S, 1): mass of the kept prefix
    target = uniforms(batch.seeds, batch.positions).unsqueeze(1) * total
    within = torch.arange(width, device=probs.device) < keep.unsqueeze(1)
    index = torch.minimum(((cum <= target) & within).sum(dim=-1), keep - 1).unsqueeze(1)
    tokens = order.gather(-1, index).squeeze(1)
    processed = torch.log(probs.gather(-1, index) / total).squeeze(1)
    return tokens, processed


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[float] | None]:
    """logits: (B, vocab). Returns the tokens and, if any row asked, log-probs (raw or processed)."""
    logits = batch.process(logits)
    tokens = logits.argmax(dim=-1)
    processed = None
    if batch.sampled.numel():
        drawn, processed = _draw(logits.index_select(0, batch.sampled).to(torch.float64), batch)
        tokens = tokens.index_copy(0, batch.sampled, drawn)
    if not batch.logprobs:
        return tokens.tolist(), None
    chosen = torch.log_softmax(logits.to(torch.float64), dim=-1).gather(-1, tokens.unsqueeze(1)).squeeze(1)
    if processed is not None:  # greedy rows have no processing: raw and processed agree
        rows = batch.sampled[batch.processed_rows]
        chosen = chosen.index_copy(0, rows, processed[batch.processed_rows])
    return tokens.tolist(), chosen.tolist()


def sample(
    logits: torch.Tensor,
    specs: list[SamplingSpec],
    positions: list[int],
    suppressed: list[tuple[int, ...]] | None = None,
) -> tuple[list[int], list[float] | None]:
    """logits: (B, vocab). ``positions[i]`` is the index the new token will take in its sequence.

    ``suppressed[i]`` lists token ids row ``i`` may not pick (EOS before ``min_new_tokens``).
    """
    return sample_batch(logits, SamplingBatch.build(specs, positions, suppressed, logits.device))
