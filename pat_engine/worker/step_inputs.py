"""Turning a ``StepCommand`` into the tensors one forward reads, in persistent buffers.

Prefill and decode share one geometry: each sequence of the step is one row of a padded
batch with ``query_len`` query slots (1 in decode) over its whole context in the paged
pool; query ``i`` of row ``b`` sees context token ``j`` when ``j <= cached_b + i`` (the torch
path derives that mask on the device: ``AttentionMetadata.torch_mask``; no step builds it here).
Decode batches are padded to a fixed set of sizes (``padded_batch_size``): the shapes a
step can take are then few and known in advance (what CUDA-graph capture needs), and on
the CPU the padding to a multiple of 4 rows happens once here instead of in every GEMM.
Padding rows run token 0 at position 0 over one context slot and write no KV. A prefill of
ragged prompts pads within groups of similar length instead (``prefill_row_groups``, one
attention call per group), so 96 prompts of 16-256 tokens do not all pad to 256.

``prefill_as_decode`` (the invariant numerics mode, docs/numerics.md) gives a prefill the
decode geometry instead: one row per prompt token, its own context length, its sequence's
block table. Attention then runs through the decode kernel for prefill too, so a token's
hidden states, and the KV computed from them, have the same bits whether the token was
prefilled or decoded (a recompute switch re-prefills decoded tokens).

A verify step (speculative decoding) runs each row's last token and draft with the prefill
geometry over the cached context, and samples every position: its sampling rows are the
sequence's spec at each position, with the token history up to that position.

Ids, positions, block tables and lengths live in buffers allocated once and grown on
demand; a step fills a prefix of them (on GPU from host tensors with non-blocking copies)
and the forward reads views, so it never waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pat_engine.config import graph_ladder
from pat_engine.host_tensors import host_table, host_tensor
from pat_engine.model import cpu_gemm
from pat_engine.model.layers.attention import AttentionMetadata
from pat_engine.protocol import SeqStep, StepCommand, TokenMask
from pat_engine.sampling.sampler import SamplingBatch
from pat_engine.sampling.spec import SamplingSpec

_PREFILL_GROUP_RATIO = 1.5  # a prefill row joins a padded group if its length is within this factor of the longest
_GPU_SIZES = graph_ladder(512)  # decode batch sizes on a GPU: the graph ladder's rule (one home, config.py)


def padded_batch_size(n: int, device: torch.device) -> int:
    """The decode batch size ``n`` real rows run as."""
    if device.type == "cpu":
        return cpu_gemm.padded_rows(n, packed=False, invariant=False)  # the CPU GEMMs' row padding
    return next((s for s in _GPU_SIZES if s >= n), n)


def prefill_row_groups(lens: list[int], ratio: float = _PREFILL_GROUP_RATIO) -> list[list[int]]:
    """Rows of a prefill grouped so that each group's rows are padded to at most ``ratio`` times their
    own length: longest first, a row opens a new group when the group's longest is more than ``ratio``
    times it. One padded call for all would pad every prompt to the longest (96 prompts of 16-256
    tokens: 2.8x the attention work); grouped, at most ``ratio``^2 and about 1.3x, for a few calls more.
    Each group lists its rows in batch order."""
    groups: list[list[int]] = []
    top = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if not groups or lens[i] * ratio < top:
            groups.append([])
            top = lens[i]
        groups[-1].append(i)
    return [sorted(g) for g in groups]


@dataclass
class SeqState:
    block_table: list[int]
    sampling: SamplingSpec | None
    history: list[int] | None = None  # every token so far, kept for sequences with logit processors


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (T,) T = real tokens (prefill) or the padded batch (decode)
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    logits_rows: torch.Tensor | slice  # rows of the hidden states to compute logits for, in batch order
    sampling: SamplingBatch | None  # None where this rank does not sample


class _Buffers:
    """Flat device buffers, one per name, allocated once and doubled when a step needs more.

    A step's tensor is a contiguous view of its buffer's prefix, so a given shape always
    has the same address (what a captured graph reads).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._bufs: dict[str, torch.Tensor] = {}

    def fill(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """A view of buffer ``name`` holding ``values`` (same shape and dtype), on the device."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < values.numel() or buf.dtype != values.dtype:
            size = max(values.numel(), 2 * buf.numel() if buf is not None else 0, 64)
            buf = self._bufs[name] = torch.zeros(size, dtype=values.dtype, device=self.device)
        view = buf[: values.numel()].view(values.shape)
        view.copy_(values.pin_memory() if self.pin else values, non_blocking=self.pin)
        return view


class StepInputBuilder:
    """Keeps each sequence's block table and sampling spec, and builds every step's inputs."""

    def __init__(self, block_size: int, device: torch.device, vocab_size: int, prefill_as_decode: bool = False):
        self.block_size = block_size
        self.prefill_as_decode = prefill_as_decode
        self.device = device
        self.vocab_size = vocab_size  # the logit processors' (B, vocab) tensors
        self.seqs: dict[int, SeqState] = {}
        self._bufs = _Buffers(device)

    def build(self, cmd: StepCommand, samples: bool, drawn: torch.Tensor | None = None) -> StepInputs:
        """The step's tensors; ``drawn``: a step that follows another (``StepCommand.follows``), its rows'
        tokens on the device (the followed step's draw)."""
        for seq_id, n in cmd.truncated:  # blocks of rejected drafts went back to the driver's pool
            if seq_id in self.seqs:
                del self.seqs[seq_id].block_table[n:]
        for seq_id in cmd.released:
            self.seqs.pop(seq_id, None)
        tables: list[list[int]] = []
        for s in cmd.seqs:
            if s.block_table is not None:
                history = list(s.context or []) if s.sampling is not None and s.sampling.has_penalties else None
                self.seqs[s.seq_id] = SeqState(list(s.block_table), s.sampling, history)
            state = self.seqs[s.seq_id]
            if state.history is not None:  # the tokens run now take their positions in the history
                if drawn is not None:
                    raise ValueError(f"sequence {s.seq_id} keeps a token history (logit processors): its steps "
                                     "cannot follow one whose draw the driver has not read")
                del state.history[s.start_pos :]
                state.history.extend(s.token_ids)
            state.block_table.extend(s.new_blocks)
            if s.sampling is not None:
                state.sampling = s.sampling
            tables.append(state.block_table)
        if cmd.is_prefill or cmd.verify:
            if drawn is not None:
                raise ValueError("only a decode step can follow an unanswered step")
            return self._prefill(cmd, tables, samples)
        return self._decode(cmd, tables, samples, drawn)

    def _sampling(self, cmd: StepCommand, samples: bool) -> SamplingBatch | None:
        if not samples:
            return None
        if cmd.verify:
            return self._verify_sampling(cmd)
        states = [self.seqs[s.seq_id] for s in cmd.seqs]
        positions = [s.start_pos + len(s.token_ids) for s in cmd.seqs]
        suppressed = [s.suppressed for s in cmd.seqs] if any(s.suppressed for s in cmd.seqs) else None
        return SamplingBatch.build([st.sampling for st in states], positions, suppressed, self.device,
                                   [st.history for st in states], self.vocab_size, _allowed(cmd.seqs))

    def _verify_sampling(self, cmd: StepCommand) -> SamplingBatch:
        """One sampling row per token run: row j of a sequence draws position ``start_pos + 1 + j`` from
        the same spec and the history up to there, exactly what a decode step there would draw with."""
        specs, positions, suppressed, histories, rows = [], [], [], [], []
        for s in cmd.seqs:
            state = self.seqs[s.seq_id]
            for j in range(len(s.token_ids)):
                end = s.start_pos + 1 + j
                specs.append(state.sampling)
                positions.append(end)
                suppressed.append(s.suppressed)  # a row with a draft suppresses nothing (Speculation.drafts)
                histories.append(state.history[:end] if state.history is not None else None)
                rows.append(s)  # a row with a grammar has no draft: its one row takes its mask
        return SamplingBatch.build(specs, positions, suppressed if any(suppressed) else None, self.device,
                                   histories, self.vocab_size, _allowed(rows))

    def _decode(self, cmd: StepCommand, tables: list[list[int]], samples: bool,
                drawn: torch.Tensor | None = None) -> StepInputs:
        n = len(cmd.seqs)
        rows = padded_batch_size(n, self.device)
        bs = self.block_size
        starts = [s.start_pos for s in cmd.seqs]
        width = -(-(max(starts) + 1) // bs)
        padding = [0] * (rows - n)
        ids = host_tensor([s.token_ids[0] for s in cmd.seqs] + padding, torch.long)
        pos = host_tensor(starts + padding, torch.long)
        table = host_table(tables, width, rows)
        slots = table[torch.arange(n), pos[:n] // bs] * bs + pos[:n] % bs
        attn = self._decode_attention(slots, table, pos)  # padding rows see slot 0 only
        ids = self._bufs.fill("ids", ids)
        if drawn is not None:  # the real rows' tokens never came through the host
            ids[:n].copy_(drawn)
        return StepInputs(ids, self._bufs.fill("pos", pos), attn, slice(0, n), self._sampling(cmd, samples))

    def _prefill(self, cmd: StepCommand, tables: list[list[int]], samples: bool) -> StepInputs:
        bs = self.block_size
        lens = host_tensor([len(s.token_ids) for s in cmd.seqs], torch.long)
        starts = host_tensor([s.start_pos for s in cmd.seqs], torch.long)
        n = len(cmd.seqs)
        width = -(-int((starts + lens).max()) // bs)
        table = host_table(tables, width)
        row = torch.repeat_interleave(torch.arange(n), lens)  # (T,) the sequence of each packed token
        offset = torch.arange(row.numel()) - (torch.cumsum(lens, 0) - lens)[row]  # index inside its sequence
        pos = starts[row] + offset
        slots = table[row, pos // bs] * bs + pos % bs
        if self.prefill_as_decode:
            attn = self._decode_attention(slots, table[row], pos)
        else:
            attn = self._grouped_prefill_attention(slots, table, starts, lens, row, offset)
        last = torch.cumsum(lens, 0) - 1  # verify: every token's logits are sampled
        logits_rows = self._bufs.fill("logits_rows", torch.arange(row.numel()) if cmd.verify else last)
        ids = host_tensor([t for s in cmd.seqs for t in s.token_ids], torch.long)
        return StepInputs(self._bufs.fill("ids", ids), self._bufs.fill("pos", pos), attn, logits_rows,
                          self._sampling(cmd, samples))

    def _decode_attention(self, slots: torch.Tensor, table: torch.Tensor, pos: torch.Tensor) -> AttentionMetadata:
        """One query row per token: ``table`` (rows, width) its sequence's blocks, ``pos`` (rows,) its position
        (no mask: the torch path derives it from the context lengths, the paged kernels read those)."""
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self._bufs.fill("slots", slots), query_len=1,
            block_tables=self._bufs.fill("tables", table), context_lens=self._bufs.fill("lens", pos + 1),
        )

    def _grouped_prefill_attention(self, slots: torch.Tensor, table: torch.Tensor, starts: torch.Tensor,
                                   lens: torch.Tensor, row: torch.Tensor, offset: torch.Tensor) -> AttentionMetadata:
        """The prefill's rows in groups of similar length (``prefill_row_groups``), each one padded call."""
        groups = prefill_row_groups(lens.tolist(), _PREFILL_GROUP_RATIO)
        width = -(-int((starts + lens).max()) // self.block_size)
        unpadded = {"context_lens": self._bufs.fill("prefill_lens", starts + lens),  # for the varlen kernels
                    "cu_seqlens": self._bufs.fill("cu_seqlens", F.pad(torch.cumsum(lens, 0), (1, 0)))}
        if len(groups) == 1:
            return self._prefill_attention(slots, table[:, :width], starts, lens, row, offset,
                                           cu_seqlens=unpadded["cu_seqlens"], context_lens=unpadded["context_lens"])
        parts = []
        first = torch.cumsum(lens, 0) - lens  # each row's first packed token
        for k, rows in enumerate(groups):
            idx = torch.tensor(rows)
            part_width = -(-int((starts[idx] + lens[idx]).max()) // self.block_size)
            tokens = torch.cat([torch.arange(int(first[r]), int(first[r] + lens[r])) for r in rows])
            local_row = torch.repeat_interleave(torch.arange(len(rows)), lens[idx])
            part = self._prefill_attention(slots, table[idx, :part_width], starts[idx], lens[idx], local_row,
                                           offset[tokens], name=f"p{k}")
            part.tokens = self._bufs.fill(f"p{k}tokens", tokens)
            parts.append(part)
        query_len = int(lens.max())  # the whole step's geometry, for the varlen kernels (no mask: nothing pads to it)
        return AttentionMetadata(is_prefill=True, slot_mapping=self._bufs.fill("slots", slots), query_len=query_len,
                                 block_tables=self._bufs.fill("tables", table[:, :width]),
                                 pad_index=self._bufs.fill("pad_index", row * query_len + offset), parts=parts,
                                 **unpadded)

    def _prefill_attention(self, slots: torch.Tensor, table: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                           row: torch.Tensor, offset: torch.Tensor, name: str = "", cu_seqlens: torch.Tensor | None = None,
                           context_lens: torch.Tensor | None = None) -> AttentionMetadata:
        """Each sequence one row of ``max(lens)`` query slots; ``pad_index`` places the packed tokens
        (``row`` and ``offset``: each token's row and index inside it). ``name`` keeps a group's buffers apart;
        ``context_lens`` on the device already (the whole step's) or built here (a group's). No mask: the
        torch path derives it from ``cached_lens`` and ``context_lens`` on the device."""
        query_len = int(lens.max())
        return AttentionMetadata(
            is_prefill=True, slot_mapping=self._bufs.fill("slots", slots), query_len=query_len,
            block_tables=self._bufs.fill(name + "tables", table),
            pad_index=self._bufs.fill(name + "pad_index", row * query_len + offset),
            context_lens=context_lens if context_lens is not None else self._bufs.fill(name + "context_lens",
                                                                                          starts + lens),
            cached_lens=self._bufs.fill(name + "cached_lens", starts), cu_seqlens=cu_seqlens,
            causal=not bool(starts.any()),
        )


def _allowed(rows: list[SeqStep]) -> list[TokenMask | None] | None:
    """Each sampling row's structured-output mask, None when no row has one."""
    return [s.allowed for s in rows] if any(s.allowed is not None for s in rows) else None
