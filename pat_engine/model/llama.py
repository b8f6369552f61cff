"""Llama-family decoder shard (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Qwen3-MoE).

One TP rank's slice of the model. Nothing here reads the global process group:
the TP handle arrives in the ``ForwardContext`` of every call, so a layout
switch only has to replace parameter data and pass a different handle.

Differences between the families are flags on ``ModelArch``: bias on q/k/v (Qwen2), per-head
RMSNorm on q and k (Qwen3) and routed experts in place of the MLP (Qwen3-MoE, layers/moe.py).
``row_chunks`` (the invariant numerics mode, docs/numerics.md) is handed to the row-parallel products
of every layer; set, it also puts the column-parallel products and the LM head on the invariant GEMM
(layers/linear.py).

Where the Triton layer kernels serve (a GPU: ``layers/triton_ops.py``) a layer is nine or ten
kernels: add + RMSNorm, QKV GEMM, (q/k norm +) rotary + KV write, attention (one or two), o GEMM,
add + RMSNorm, gate/up GEMM, SiLU-mul, down GEMM; elsewhere the CPU kernels or torch formulas
compute the same values step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pat_engine.model.arch import ModelArch
from pat_engine.model.layers import triton_ops
from pat_engine.model.layers.attention import (
    DEFAULT_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    attend,
    paged_attention,
)
from pat_engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pat_engine.model.layers.gemm_input import GemmInput, NormedInput
from pat_engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pat_engine.model.layers.mlp import MLP
from pat_engine.model.layers.moe import SparseMoE
from pat_engine.model.layers.norm import RMSNorm
from pat_engine.model.layers.rotary import RotaryEmbedding, apply_rotary
from pat_engine.parallel.shard_spec import Component
from pat_engine.parallel.comm import TPGroup


@dataclass
class ForwardContext:
    tp: TPGroup
    kv_caches: list[torch.Tensor]  # one (2, blocks, block_size, kvh_local, hd) pool per layer
    attn: AttentionMetadata
    cos: torch.Tensor | None = None  # (T, 1, hd), set by CausalLM.forward (not with the Triton kernels)
    sin: torch.Tensor | None = None
    attn_backend: AttentionBackend = DEFAULT_BACKEND  # chosen by layers/attention.attention_backend
    positions: torch.Tensor | None = None  # (T,), set by CausalLM.forward
    rotary: RotaryEmbedding | None = None  # its tables, read by the Triton rotary kernel


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, tp: int, dtype, device, row_chunks: int | None = None):
        super().__init__()
        self.arch = arch
        hd = arch.head_dim
        qkv = (
            Component(arch.q_size, unit=hd),
            Component(arch.kv_size, unit=hd, replicate=True),
            Component(arch.kv_size, unit=hd, replicate=True),
        )
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, qkv, arch.qkv_bias, tp, dtype, device,
                                             row_chunks is not None)
        self.o_proj = RowParallelLinear(arch.q_size, arch.hidden_size, hd, tp, dtype, device, row_chunks)
        self.q_norm = RMSNorm(hd, arch.rms_eps, dtype, device) if arch.qk_norm else None
        self.k_norm = RMSNorm(hd, arch.rms_eps, dtype, device) if arch.qk_norm else None
        self.scale = hd**-0.5
        self.triton = triton_ops.kernels_for(device, dtype)

    def forward(self, x: GemmInput, ctx: ForwardContext, layer: int) -> torch.Tensor:
        arch, hd = self.arch, self.arch.head_dim
        heads = arch.num_heads // ctx.tp.size
        kv_heads = arch.kv_heads_per_rank(ctx.tp.size)
        qkv = self.qkv_proj(x)  # (T, (heads + 2 * kv_heads) * hd)
        kv_cache = ctx.kv_caches[layer]
        if self.triton is not None:  # q/k norm, rotary and the KV write in one kernel; q stays a view of qkv
            q = self.triton.rotary_kv_write(
                qkv, heads, kv_heads, ctx.positions, ctx.rotary.cos, ctx.rotary.sin, kv_cache, ctx.attn.slot_mapping,
                self.q_norm.weight if self.q_norm else None, self.k_norm.weight if self.k_norm else None, arch.rms_eps)
            out = attend(q, kv_cache, ctx.attn, self.scale, ctx.attn_backend)  # (T, h, hd)
            return self.o_proj(out.reshape(-1, heads * hd), ctx.tp)
        qk, v = qkv.split([(heads + kv_heads) * hd, kv_heads * hd], dim=-1)
        qk = qk.view(-1, heads + kv_heads, hd)
        v = v.view(-1, kv_heads, hd)  # (T, kvh, hd)
        if self.q_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k are neighbours in the fused projection: one rotary pass serves both
        q, k = apply_rotary(qk, ctx.cos, ctx.sin).split([heads, kv_heads], dim=1)  # (T, h, hd), (T, kvh, hd)
        out = paged_attention(q, k, v, kv_cache, ctx.attn, self.scale, ctx.attn_backend)  # (T, h, hd)
        return self.o_proj(out.reshape(-1, heads * hd), ctx.tp)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, tp: int, dtype, device, row_chunks: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_eps, dtype, device)
        self.self_attn = Attention(arch, tp, dtype, device, row_chunks)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_eps, dtype, device)
        self.mlp = (SparseMoE(arch, tp, dtype, device, row_chunks) if arch.is_sparse(layer)
                    else MLP(arch.hidden_size, arch.intermediate_size, tp, dtype, device, row_chunks))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to ``residual`` (None for the first
        layer, whose x is the embedding). Returns (this layer's output, the residual stream);
        each add is fused with the norm that follows it, and that with the GEMM after it where the GEMM
        computes its input (layers/gemm_input.py)."""
        h = NormedInput(x, residual, self.input_layernorm)
        attn_out = self.self_attn(h, ctx, layer)
        h = NormedInput(attn_out, h.summed, self.post_attention_layernorm)
        return self.mlp(h, ctx.tp), h.summed


class CausalLM(nn.Module):
    """The TP shard of a decoder-only LM. Parameter names mirror the HF checkpoint."""

    def __init__(self, arch: ModelArch, tp: int, dtype: torch.dtype, device: torch.device | str,
                 row_chunks: int | None = None):
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp, dtype, device, row_chunks)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_eps, dtype, device)
        tied = self.embed_tokens.weight if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp, dtype, device, tied_to=tied,
                                      invariant=row_chunks is not None)
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, arch.max_position, dtype, device)
        self.triton = triton_ops.kernels_for(device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: (T,). Returns hidden states (T, hidden)."""
        ctx.positions, ctx.rotary = positions, self.rotary
        if self.triton is None:  # the Triton rotary kernel reads the tables by position itself
            ctx.cos, ctx.sin = self.rotary.cos_sin(positions)
        x, residual = self.embed_tokens(input_ids, ctx.tp), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx, i)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, tp: TPGroup) -> torch.Tensor | None:
        """Full-vocab logits on TP rank 0 (None on the others)."""
        return self.lm_head(hidden, tp)

