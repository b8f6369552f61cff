"""Token sampling that gives the same draw under every layout, for a whole batch in one pass.

Each draw uses one uniform number that depends only on ``(seed, position)``
(a SplitMix64 hash), so a request sampled under TP1xDP4, TP4xDP1 or after a
recompute picks the same token: the logits are the same, and so is the
random number. Greedy is argmax.

The rule for a sampled row (sampling/inverse_cdf.py has the arithmetic, bit for bit): the kept
tokens are those ``top_k``, ``top_p`` and ``min_p`` keep (top_k and top_p: a prefix of the
tokens by descending logit, ties by lower id, found with a partial ``topk`` rather than a sort;
min_p: tokens within ``log(min_p)`` of the best after the temperature); the token is the first
kept one, in token-id order, whose running mass exceeds ``u * kept mass``. No row is sorted or
copied to float64 whole: a C++ kernel does one pass per row on the CPU, torch ops elsewhere.

Per-row settings travel as tensors in ``SamplingBatch`` (built once per step from the
specs); logit processors that come later (penalties, min_p, logit_bias) are more
per-row tensors applied in ``SamplingBatch.process`` before the temperature.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pat_engine.host_tensors import to_device
from pat_engine.sampling.inverse_cdf import first_max, inverse_cdf, inverse_cdf_in_prefix, prefix_kernel_serves, weights
from pat_engine.sampling.logprobs import greedy_logprobs, log_z, token_logprobs, top_logprobs
from pat_engine.sampling.prefix import masked, prefixes
from pat_engine.sampling.processors import ProcessorRows
from pat_engine.sampling.seeds import uniforms
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.sampling.structured import TokenMask


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step as tensors (row ``i`` is the batch's ``i``-th sequence)."""

    sampled: torch.Tensor  # int64 (S,): rows drawn at random (temperature > 0); the rest are greedy
    # the rest are None when no row is sampled
    temperature: torch.Tensor | None  # float64 (S, 1)
    inv_temp: torch.Tensor | None  # float32 (S,): 1 / temperature in float64, rounded once (as on the device before)
    top_k: torch.Tensor | None  # int64 (S,), <= 0 means off
    top_p: torch.Tensor | None  # float64 (S, 1)
    uniform: torch.Tensor | None  # float64 (S,): uniform_for(seed, index the new token takes), hashed on the host
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) that may not be drawn
    logprobs: bool  # any row wants log-probs
    processed_rows: torch.Tensor | None  # int64: sampled rows (indices into ``sampled``) reporting processed log-probs
    processors: ProcessorRows | None = None  # penalties and logit bias of the rows that have them
    top_logprobs: int = 0  # the most alternatives any row asked for
    greedy_processed: torch.Tensor | None = None  # int64: greedy rows reporting processed log-probs
    # known from the settings, so that no step reads a value back to find them (sampling/host.py)
    limited: torch.Tensor | None = None  # int64: sampled rows (indices into ``sampled``) with top_k or top_p
    unlimited: torch.Tensor | None = None  # int64: the other sampled rows (when some are limited)
    any_top_p: bool = False  # some limited row has top_p < 1
    raw_rows: torch.Tensor | None = None  # int64: sampled rows whose processed distribution is the raw one
    not_raw: torch.Tensor | None = None  # int64: the batch rows outside ``sampled[raw_rows]`` (when any)
    floor: torch.Tensor | None = None  # float32 (S,): log(min_p) of the sampled rows, -inf without
    # structured output (core/grammar.py; its "banned" form joins ``suppressed``): rows allowed only a few
    # tokens, (rows, (row, token id) pairs); rows given a bitmask, (rows, int32 words (R, ceil(vocab / 32)))
    only: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
    allowed_words: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, specs: list[SamplingSpec], positions: list[int],
              suppressed: list[tuple[int, ...]] | None = None, device: torch.device | str = "cpu",
              histories: list[list[int] | None] | None = None, vocab: int = 0,
              allowed: list[TokenMask | None] | None = None) -> "SamplingBatch":
        """``histories[i]``: row ``i``'s tokens so far, needed (and given) only for rows with processors;
        ``allowed[i]``: row ``i``'s structured-output mask (``core/grammar.py``), or None."""
        if allowed is not None and any(m is not None and m.banned for m in allowed):
            suppressed = [tuple(ids) + (m.banned if m is not None and m.banned else ())
                          for ids, m in zip(suppressed or [()] * len(specs), allowed)]
        rows = [i for i, s in enumerate(specs) if s.temperature != 0.0]
        chosen = [specs[i] for i in rows]
        top_ks = [s.top_k for s in chosen]
        limited = [j for j, s in enumerate(chosen) if s.top_k > 0 or s.top_p < 1.0]
        limited_set = set(limited)
        raw = [j for j, s in enumerate(chosen) if s.temperature == 1.0 and s.top_k <= 0 and s.top_p >= 1.0
               and s.min_p <= 0.0 and not s.has_penalties]
        banned_rows = [i for i, ids in enumerate(suppressed or ()) for _ in ids]
        banned_ids = [t for ids in (suppressed or ()) for t in ids]

        def tensor(values, dtype):
            return to_device(values, dtype, device)

        return cls(
            sampled=tensor(rows, torch.long),
            temperature=tensor([s.temperature for s in chosen], torch.float64).view(-1, 1) if rows else None,
            inv_temp=tensor([1.0 / s.temperature for s in chosen], torch.float32) if rows else None,
            top_k=tensor(top_ks, torch.long) if rows else None,
            top_p=tensor([s.top_p for s in chosen], torch.float64).view(-1, 1) if rows else None,
            uniform=tensor(uniforms([s.seed for s in chosen], [positions[i] for i in rows]), torch.float64)
            if rows else None,
            suppressed=(tensor(banned_rows, torch.long), tensor(banned_ids, torch.long)) if banned_ids else None,
            logprobs=any(s.logprobs for s in specs),
            processed_rows=_rows_or_none([j for j, s in enumerate(chosen) if s.processed_logprobs], device),
            processors=_processor_rows(specs, histories, vocab, device),
            top_logprobs=max((s.top_logprobs for s in specs), default=0),
            greedy_processed=_rows_or_none([i for i, s in enumerate(specs) if s.temperature == 0.0
                                            and s.processed_logprobs and s.has_penalties], device),
            limited=_rows_or_none(limited, device),
            unlimited=_rows_or_none([j for j in range(len(chosen)) if j not in limited_set], device)
            if limited else None,
            any_top_p=any(chosen[j].top_p < 1.0 for j in limited),
            raw_rows=_rows_or_none(raw, device),
            not_raw=_rows_or_none(sorted(set(range(len(specs))) - {rows[j] for j in raw}), device),
            floor=tensor([math.log(s.min_p) if s.min_p > 0 else float("-inf") for s in chosen], torch.float32)
            if rows else None,  # log on the host in float64, rounded once to float32 as before
            only=_only_rows(allowed, device),
            allowed_words=_word_rows(allowed, device),
        )

    def suppress(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Tokens not allowed (EOS and stop ids before min_new_tokens, what a grammar does not allow) get
        -inf: the raw logits. ``in_place``: ``logits`` is the caller's to change (a step's own logits), else
        one copy is made when anything is masked (a batch of Qwen-vocabulary rows is tens of MB: a copy per
        kind of mask cost more than the draw, bench/results/structured_output_cost.md)."""
        if self.suppressed is None and self.only is None and self.allowed_words is None:
            return logits
        out = logits if in_place else logits.clone()
        if self.suppressed is not None:
            out.index_put_(self.suppressed, out.new_full((), float("-inf")))
        if self.only is not None:  # every token -inf but the few allowed, whose logits are put back
            rows, (row_of, ids) = self.only
            kept = out[row_of, ids]
            out.index_fill_(0, rows, float("-inf")).index_put_((row_of, ids), kept)
        if self.allowed_words is not None:
            rows, words = self.allowed_words
            # little-endian words: token t is bit t % 8 of byte t // 8, unpacked a byte at a time
            keep = _byte_bits(words.device)[words.view(torch.uint8).long()].view(words.shape[0], -1)
            keep = keep[:, : out.shape[-1]]
            if keep.shape[-1] < out.shape[-1]:  # padded vocabulary columns are never allowed
                keep = F.pad(keep, (0, out.shape[-1] - keep.shape[-1]))
            out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(~keep, float("-inf")))
        return out

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias and penalties of the rows that have them (float64 when any): the processed logits."""
        return logits if self.processors is None else self.processors.apply(logits.to(torch.float64))


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: each byte's bits, lowest first; made once per device, not copied every step."""
    return ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool().to(device)


def _only_rows(allowed: list[TokenMask | None] | None,
               device: torch.device | str) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    rows = [i for i, m in enumerate(allowed or ()) if m is not None and m.only is not None]
    if not rows:
        return None
    row_of = [i for i in rows for _ in allowed[i].only]  # type: ignore[index, union-attr]
    ids = [t for i in rows for t in allowed[i].only]  # type: ignore[index, union-attr]
    pairs = (to_device(row_of, torch.long, device), to_device(ids, torch.long, device))
    return to_device(rows, torch.long, device), pairs


def _word_rows(allowed: list[TokenMask | None] | None,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [i for i, m in enumerate(allowed or ()) if m is not None and m.words is not None]
    if not rows:
        return None
    words = torch.stack([torch.frombuffer(bytearray(allowed[i].words), dtype=torch.int32)  # type: ignore
                         for i in rows])
    return to_device(rows, torch.long, device), words.to(device, non_blocking=True)


def _rows_or_none(rows: list[int], device: torch.device | str) -> torch.Tensor | None:
    return to_device(rows, torch.long, device) if rows else None


def _processor_rows(specs: list[SamplingSpec], histories: list[list[int] | None] | None, vocab: int,
                    device: torch.device | str) -> ProcessorRows | None:
    rows = [i for i, s in enumerate(specs) if s.has_penalties]
    if not rows:
        return None
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("rows with penalties need their token history")
    chosen = [specs[i] for i in rows]
    return ProcessorRows.build(rows, [s.repetition_penalty for s in chosen], [s.frequency_penalty for s in chosen],
                               [s.presence_penalty for s in chosen], [histories[i] for i in rows],
                               [s.prompt_len for s in chosen], [s.logit_bias for s in chosen], vocab, device)


def _rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x``'s rows ``rows`` (increasing, distinct); ``x`` itself when they are all of them: a copy of a
    batch's logits costs more than its draw."""
    return x if rows.numel() == x.shape[0] else x.index_select(0, rows)


def _draw_by_kernel(logits: torch.Tensor, batch: SamplingBatch, inv_temp: torch.Tensor, floor: torch.Tensor,
                    u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The draw with top_k / top_p rows in the C++ prefix kernel; None where it does not serve (float64
    logits keep the general path, whose float64 log-probs need the masked rows)."""
    if logits.dtype == torch.float64 or batch.limited is None or not prefix_kernel_serves(logits):
        return None  # decided before any row is gathered: on a GPU nothing is copied for nothing
    rows, free = batch.limited, batch.unlimited
    top_k, top_p = batch.top_k, batch.top_p.squeeze(1)
    part = inverse_cdf_in_prefix(_rows(logits, rows), inv_temp[rows], floor[rows], u[rows], top_k[rows], top_p[rows])
    if part is None:
        return None
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)
    parts = [(rows, part)]
    if free is not None:
        parts.append((free, inverse_cdf(logits.index_select(0, free), inv_temp[free], floor[free], u[free])))
    for index, (t, z, z_sum) in parts:
        tokens.index_copy_(0, index, t)
        logprobs.index_copy_(0, index, z.double() - log_z(z_sum))
    return tokens, logprobs


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and processed log-probs of the sampled rows; logits: (S, vocab), any float dtype."""
    inv_temp = batch.inv_temp
    floor = batch.floor  # log(min_p); min_p = 0 keeps every token
    u = batch.uniform
    fast = _draw_by_kernel(logits, batch, inv_temp, floor, u)
    if fast is not None:
        return fast
    x = logits
    if batch.limited is not None:
        prefix = prefixes(logits, batch.top_k, batch.top_p.squeeze(1), inv_temp, batch.limited, batch.any_top_p)
        x = logits.index_copy(0, prefix.rows, masked(logits, prefix))
    tokens, z_token, z_sum = inverse_cdf(x, inv_temp, floor, u)
    if logits.dtype == torch.float64:  # the exactness suite's dtype: the log-prob in float64 over the kept tokens
        kept = weights(x, inv_temp, floor)[0] > 0
        scaled = torch.where(kept, logits / batch.temperature, float("-inf"))
        return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, z_token.double() - log_z(z_sum)


@dataclass
class Sampled:
    """One step's draws: a token per row; when asked, its log-prob and the top alternatives."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None  # per row: (token id, log-prob), most likely first


@dataclass
class DeviceSample:
    """One step's draws, still where the logits are: nothing has been read back yet."""

    tokens: torch.Tensor  # int64 (B,)
    logprobs: torch.Tensor | None = None  # float64 (B,)
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (log-probs float64 (B, k), ids int64 (B, k))

    def to_host(self) -> Sampled:
        """Everything in one transfer: ids as float64 (exact below 2**53) beside the log-probs."""
        return self.start_transfer().result()

    def start_transfer(self) -> "HostTransfer":
        """Queue the transfer now, right behind the step's kernels: a step launched after this one (async
        scheduling) does not delay it. On a GPU the copy lands in pinned memory, an event marks its end."""
        cols = [self.tokens.double().unsqueeze(1)]
        if self.logprobs is not None:
            cols.append(self.logprobs.unsqueeze(1))
        if self.top is not None:
            cols += [self.top[1].double(), self.top[0]]
        packed = torch.cat(cols, dim=1)
        k = self.top[1].shape[1] if self.top is not None else None
        if packed.device.type != "cuda":
            return HostTransfer(packed, None, self.logprobs is not None, k)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostTransfer(host, done, self.logprobs is not None, k)


@dataclass
class HostTransfer:
    """A step's draws on their way to host memory (``DeviceSample.start_transfer``)."""

    packed: torch.Tensor  # (B, columns) float64 in host memory once ``done`` has passed
    done: "torch.cuda.Event | None"  # None: already there (CPU)
    has_logprobs: bool
    top_k: int | None

    def result(self) -> Sampled:
        """Wait for the copy (not for anything queued after it) and unpack it."""
        if self.done is not None:
            self.done.synchronize()
        rows = self.packed.tolist()
        tokens = [int(r[0]) for r in rows]
        logprobs = [r[1] for r in rows] if self.has_logprobs else None
        top = None
        if self.top_k is not None:  # the row's tail: k ids, then their k log-probs
            k = self.top_k
            top = [[(int(i), v) for i, v in zip(r[-2 * k : -k], r[-k:])] for r in rows]
        return Sampled(tokens, logprobs, top)


def _raw_logprobs(raw_logits: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                  processed: torch.Tensor | None) -> torch.Tensor:
    """Every row's raw log-prob (float64). A sampled row at temperature 1 with no filter and no
    processor drew from the raw distribution itself: its processed log-prob is the raw one, the same
    bits (the same kernel sums), so it is not computed twice."""
    same = batch.raw_rows
    if processed is None or same is None or logits is not raw_logits or logits.dtype == torch.float64:
        return token_logprobs(raw_logits, tokens)
    chosen = torch.empty(tokens.shape[0], dtype=torch.float64, device=tokens.device)
    chosen.index_copy_(0, batch.sampled[same], processed[same])
    rest = batch.not_raw
    if rest is not None:
        chosen.index_copy_(0, rest, token_logprobs(raw_logits.index_select(0, rest), tokens.index_select(0, rest)))
    return chosen


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
    """logits: (B, vocab). Raw log-probs come from the model's logits (tokens suppressed before
    ``min_new_tokens`` excluded); processed ones from the distribution the token was drawn from."""
    return sample_on_device(logits, batch).to_host()


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch, logits_owned: bool = False) -> DeviceSample:
    """``sample_batch`` without the final transfer; on a GPU it reads no value back (sampling/host.py).
    ``logits_owned``: the logits are the caller's to overwrite (a step's own), so masks need no copy."""
    raw_logits = batch.suppress(logits, in_place=logits_owned)
    logits = batch.penalize(raw_logits)
    top = top_logprobs(raw_logits, batch.top_logprobs) if batch.top_logprobs else None
    if not batch.sampled.numel() and batch.logprobs and logits is raw_logits:  # a greedy batch: one pass
        return DeviceSample(*greedy_logprobs(logits), top)
    if batch.sampled.numel() < logits.shape[0]:  # greedy rows: the first maximum
        tokens = first_max(logits)
    else:  # every row is drawn below: no pass over the vocabulary for an argmax nobody reads
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    processed = None
    if batch.sampled.numel():
        drawn, processed = _draw(_rows(logits, batch.sampled), batch)
        tokens = drawn if drawn.shape[0] == tokens.shape[0] else tokens.index_copy(0, batch.sampled, drawn)
    if not batch.logprobs:
        return DeviceSample(tokens)
    chosen = _raw_logprobs(raw_logits, logits, tokens, batch, processed)
    if processed is not None and batch.processed_rows is not None:  # under the distribution drawn from
        rows = batch.sampled[batch.processed_rows]
        chosen = chosen.index_copy(0, rows, processed[batch.processed_rows])
    if batch.greedy_processed is not None:  # greedy rows after penalties
        rows = batch.greedy_processed
        chosen = chosen.index_copy(0, rows, token_logprobs(logits.index_select(0, rows), tokens.index_select(0, rows)))
    return DeviceSample(tokens, chosen, top)


def sample(
    logits: torch.Tensor,
    specs: list[SamplingSpec],
    positions: list[int],
    suppressed: list[tuple[int, ...]] | None = None,
) -> tuple[list[int], list[float] | None]:
    """logits: (B, vocab). ``positions[i]`` is the index the new token will take in its sequence.

    ``suppressed[i]`` lists token ids row ``i`` may not pick (EOS before ``min_new_tokens``).
    """
    out = sample_batch(logits, SamplingBatch.build(specs, positions, suppressed, logits.device))
    return out.tokens, out.logprobs
