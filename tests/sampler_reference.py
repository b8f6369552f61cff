"""The draw rule written out one row at a time, the reference the batched sampler must equal bit for bit.

It follows the rule's definition (pat_engine/sampling/sampler.py) the plain way: a full stable
sort for top_k / top_p, Python loops for the blocked eight-lane sum and the running mass. Only the weight
function (``pexp``, the kernel's polynomial exp) is shared with the engine; the C++ kernel is
checked against it separately.
"""

from __future__ import annotations

import math

import torch

from pat_engine.sampling.inverse_cdf import Z_BLOCK, pexp
from pat_engine.sampling.seeds import uniform_for
from pat_engine.sampling.spec import SamplingSpec


def _lanes(e: list[float]) -> float:
    """Z: each block of Z_BLOCK weights in eight lanes, lanes combined, the block totals added in order."""
    total = 0.0
    for start in range(0, len(e), Z_BLOCK):
        acc = [0.0] * 8
        for i, v in enumerate(e[start:start + Z_BLOCK]):
            acc[i % 8] += v
        total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    return total


def _weights(row: torch.Tensor, temperature: float) -> tuple[torch.Tensor, list[float]]:
    xf = row.float()
    it = torch.tensor(1.0 / temperature, dtype=torch.float64).float()
    z = (xf - xf.max()) * it
    return z, pexp(z).double().tolist()


def reference_row(logits: torch.Tensor, spec: SamplingSpec, position: int) -> tuple[int, float]:
    """The drawn token and its log-probability under the distribution drawn from (one row)."""
    vocab = logits.numel()
    z, e = _weights(logits, spec.temperature)
    order = logits.float().sort(descending=True, stable=True).indices.tolist()
    keep = min(spec.top_k, vocab) if spec.top_k > 0 else vocab
    if spec.top_p < 1.0:
        whole, running, nucleus = _lanes(e), 0.0, 0
        for i in order:
            running += e[i]
            nucleus += 1
            if not running < spec.top_p * whole:
                break
        keep = min(keep, nucleus)
    kept = set(order[:keep])
    floor = torch.tensor(math.log(spec.min_p) if spec.min_p > 0 else float("-inf"), dtype=torch.float64).float()
    e = [v if i in kept and bool(z[i] >= floor) else 0.0 for i, v in enumerate(e)]
    total = _lanes(e)
    target = uniform_for(spec.seed, position) * total
    running, token = 0.0, max(i for i, v in enumerate(e) if v > 0)
    for i, v in enumerate(e):
        running += v
        if running > target:
            token = i
            break
    if logits.dtype == torch.float64:  # float64 rows report the log-prob in float64 over the kept tokens
        scaled = torch.tensor([x / spec.temperature if v > 0 else float("-inf") for x, v in zip(logits.tolist(), e)],
                              dtype=torch.float64)
        return token, torch.log_softmax(scaled, dim=-1)[token].item()
    return token, float(z[token]) - math.log(total)


def reference_logprob(logits: torch.Tensor, token: int) -> float:
    """log_softmax(logits)[token]: torch's in float64, the kernel's weights otherwise."""
    if logits.dtype == torch.float64:
        return torch.log_softmax(logits, dim=-1)[token].item()
    z, e = _weights(logits, 1.0)
    return float(z[token]) - math.log(_lanes(e))


def reference_sample(logits, specs, positions, suppressed=None):
    if suppressed and any(suppressed):
        logits = logits.clone()
        for i, ids in enumerate(suppressed):
            if ids:
                logits[i, list(ids)] = float("-inf")
    greedy = logits.argmax(dim=-1).tolist()
    tokens, processed = [], {}
    for i, spec in enumerate(specs):
        if spec.temperature == 0.0:
            tokens.append(greedy[i])
        else:
            token, processed[i] = reference_row(logits[i], spec, positions[i])
            tokens.append(token)
    if not any(s.logprobs for s in specs):
        return tokens, None
    chosen = [reference_logprob(logits[i], t) for i, t in enumerate(tokens)]
    for i, spec in enumerate(specs):
        if spec.processed_logprobs and i in processed:
            chosen[i] = processed[i]
    return tokens, chosen
