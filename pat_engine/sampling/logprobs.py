"""Log-probabilities of given tokens and of the most likely ones: one rule for sampled tokens,
prompt tokens (echo, evaluation) and ``reference_logprobs``, so all three agree to the bit.

Float64 logits (the exactness suite's) use torch's float64 ``log_softmax``; other logits use the
sampling kernel's row sums (sampling/inverse_cdf.py): ``(float32(x_t) - max) - log(Z)``, with the
log taken per row by Python's ``math.log`` on the CPU (a library log rounds differently in its vector
and scalar paths, which would make a row's value depend on its place in the batch) and by
``torch.log`` on a GPU (``log_z``).
"""

from __future__ import annotations

import math

import torch

from pat_engine.sampling import host
from pat_engine.sampling.inverse_cdf import first_max_and_z, log_norm


def log_z(z_sum: torch.Tensor) -> torch.Tensor:
    """The log of each float64 value with one rounding whatever the row's place in the batch: Python's
    ``math.log`` on the host; on a GPU ``torch.log``, whose kernel computes every element alike (no
    vector/scalar split) and needs no trip to the host."""
    if not host.reads_are_free(z_sum):
        return torch.log(z_sum)
    return torch.tensor([math.log(v) for v in z_sum.tolist()], dtype=torch.float64, device=z_sum.device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at ``tokens``, one per row (float64)."""
    if logits.dtype == torch.float64:
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(1)).squeeze(1)
    m, z_sum = log_norm(logits)
    z = logits.gather(-1, tokens.unsqueeze(1)).squeeze(1).float() - m
    return z.double() - log_z(z_sum)


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum and its log-prob, ``token_logprobs(logits, argmax)`` to the bit; outside
    float64 one kernel pass finds both (the token's ``float32(x_t) - max`` is 0)."""
    if logits.dtype == torch.float64:
        tokens = logits.argmax(dim=-1)
        return tokens, token_logprobs(logits, tokens)
    tokens, z_sum = first_max_and_z(logits)
    zero = torch.zeros(tokens.shape[0], dtype=torch.float64, device=logits.device)  # float32(x_t) - max
    return tokens, zero - log_z(z_sum)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row: (log-probs float64, ids), most likely first."""
    k = min(k, logits.shape[-1])
    if logits.dtype == torch.float64:
        return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    best, ids = logits.topk(k, dim=-1)
    m, z_sum = log_norm(logits)
    return (best.float() - m.unsqueeze(1)).double() - log_z(z_sum).unsqueeze(1), ids
