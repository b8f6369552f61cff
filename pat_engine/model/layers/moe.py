"""Routed experts (Qwen3-MoE): each token's MLP is the weighted sum of its router's chosen experts.

Every rank holds every expert, each split over the TP group as a dense MLP is (gate/up by columns, down
by rows), so a layout switch reshards experts as it reshards any weight and no token ever leaves its
rank. The router is replicated; the ranks of a group see the same hidden states, so they pick the same
experts. The group sums once per layer, after the experts' shares are combined:

- fast: HF's formula (transformers' ``Qwen3MoeExperts``): each expert's output times its weight, both in
  the model's dtype, added into the token's row, then the group's all-reduce.
- invariant (docs/numerics.md): each (token, chosen expert) is a row of the row-parallel tree, reduced to
  the expert's output with the same bits at every TP, then weighed in float32 (float64 for float64) in
  ascending expert order and rounded once: no bit depends on the layout, the batch or its order.

Two ways to run the experts of a step:

- fused (fast numerics on CUDA, ``ModelArch.routes_on_host``): the Triton kernels of
  ``pat_kernels/fused_moe.py`` group the rows by expert on the device and multiply every expert's rows in
  one launch per GEMM, reading each expert's weight through a table of pointers (``expert_tables``, kept
  current by ``refresh_expert_tables`` after every weight write). No host sync: CUDA graphs capture it.
- per expert: the experts a step uses are found on the host (one sync a layer), each runs as an ``MLP``
  (the CPU, the invariant mode): CUDA graphs cannot capture this (``EngineConfig.graphs`` decodes eagerly).
"""

from __future__ import annotations

import torch
from torch import nn

from pat_engine.model import cpu_gemm
from pat_engine.model.arch import ModelArch, MoESpec
from pat_engine.model.chunk_weights import accumulate_dtype
from pat_engine.model.layers.gemm_input import GemmInput
from pat_engine.model.layers.linear import linear, sharded_parameter
from pat_engine.model.layers.mlp import MLP
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.shard_spec import replicated

try:  # the kernels package ships with the engine; its absence only costs speed
    from pat_kernels import cpu_moe
except ImportError:  # pragma: no cover
    cpu_moe = None


class Router(nn.Module):
    """The ``(experts, hidden)`` gate, on every rank whole."""

    is_gemm_weight = True  # packed for the CPU GEMM (model/cpu_gemm.py)

    def __init__(self, num_experts: int, hidden_size: int, tp: int, dtype, device, invariant: bool):
        super().__init__()
        self.weight = sharded_parameter(replicated(num_experts, hidden_size), tp, dtype, device)
        self.invariant = invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, invariant=self.invariant)


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each ``(T, experts_per_token)``: every token's best experts by the softmax of
    its router logits (taken in float32, as transformers does), renormalised over them when the model
    says so; a token's experts in ascending order (the order the invariant mode adds them in)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, spec.experts_per_token, dim=-1)
    if spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    experts, order = experts.sort(dim=-1)
    return top.gather(1, order), experts


class SparseMoE(nn.Module):
    """A layer's router (``gate``) and experts, named as in the HF checkpoint."""

    def __init__(self, arch: ModelArch, tp: int, dtype, device, row_chunks: int | None = None):
        super().__init__()
        self.spec = arch.moe
        self.gate = Router(self.spec.num_experts, arch.hidden_size, tp, dtype, device, row_chunks is not None)
        self.experts = nn.ModuleList(MLP(arch.hidden_size, self.spec.intermediate_size, tp, dtype, device, row_chunks)
                                     for _ in range(self.spec.num_experts))
        self.invariant = row_chunks is not None
        numerics = "invariant" if self.invariant else "fast"
        self.fused = not arch.routes_on_host(torch.device(device).type, numerics, dtype)
        # (2, experts) int64: each expert's gate/up and down weight addresses (fused only; a plain attribute,
        # not a buffer: no state dict, footprint or move sees it)
        self.expert_tables: torch.Tensor | None = None
        if self.fused:
            from pat_kernels.fused_moe import routed_experts  # Triton: imported only where it runs

            self.routed_experts = routed_experts
            self.refresh_tables()

    def refresh_tables(self) -> None:
        """Point the fused kernels at the experts' current weights, in place: a graph captured before a write
        that moved no weight reads the same table (``InferExecutor.writing_weights``)."""
        weights = [e.gate_up_proj.weight for e in self.experts] + [e.down_proj.weight for e in self.experts]
        if any(not w.is_contiguous() for w in weights):
            raise ValueError("the fused experts read each weight as a contiguous (rows, in) matrix")
        table = torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64).view(2, -1)
        device = weights[0].device
        if self.expert_tables is None or self.expert_tables.device != device:
            self.expert_tables = table.to(device)
        else:
            self.expert_tables.copy_(table)

    def forward(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = x.computed()
        weights, experts = route(self.gate(x), self.spec)
        down = self.experts[0].down_proj
        if self.fused:
            gate_up_ptrs, down_ptrs = self.expert_tables
            width = down.weight.shape[1]  # this rank's share of an expert's width
            partial = self.routed_experts(x, weights.to(x.dtype), experts, gate_up_ptrs, down_ptrs, width)
            return down.reduce(partial, tp)
        k = self.spec.experts_per_token
        flat = experts.flatten()  # (T * k,): row t * k + j is token t's j-th expert
        order = flat.argsort(stable=True)  # those rows grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()  # the host sync
        spans = list(_spans(counts))
        if not self.invariant:  # HF's formula: each share weighted in the model's dtype, added in expert order
            weights = weights.to(x.dtype)
            out = self._kernel_experts(x, order, weights, spans)
            if out is None:
                tokens = order // k
                shares = self._shares(x[tokens], spans, tp).mul_(weights.flatten()[order][:, None])
                out = torch.zeros_like(x).index_add_(0, tokens, shares)
            return down.reduce(out, tp)
        rows = x[order // k]  # every (token, expert) row, grouped by expert: one gather, each expert's rows a view
        shares = self._shares(rows, spans, tp)  # (T * k, hidden) tree nodes, rows as ``order``
        nodes = torch.empty_like(shares)
        nodes[order] = shares  # back to (token, expert) order
        outs = down.reduce(nodes, tp).view(-1, k, x.shape[1]).to(nodes.dtype)  # each expert's output, rounded
        w = weights.to(nodes.dtype)
        total = outs[:, 0] * w[:, 0:1]
        for j in range(1, k):
            total = total + outs[:, j] * w[:, j : j + 1]
        return total.to(x.dtype)

    def _shares(self, rows: torch.Tensor, spans: list[tuple[int, int, int]], tp: TPGroup) -> torch.Tensor:
        """``(N, hidden)``: each expert's share of its rows (``MLP.partial``), the experts in turn."""
        shares = [self.experts[e].partial(rows[start:stop], tp) for e, start, stop in spans]
        if not shares:  # a step without tokens: the group's sum still runs, on nothing
            return rows.new_zeros(rows.shape, dtype=accumulate_dtype(rows.dtype) if self.invariant else rows.dtype)
        return torch.cat(shares) if len(shares) > 1 else shares[0]

    def _kernel_experts(self, x: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                        spans: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """The weighted, combined experts through the CPU kernel (each core whole experts), or None where it does
        not serve: no kernel, another device or dtype, an expert without its oneDNN packs, or one row an
        expert."""
        if cpu_moe is None or order.shape[0] <= len(spans) or not cpu_moe.usable(x):  # (also no rows)
            return None  # (a row an expert: each GEMM reads faster on every core, bench/results/cpu_moe_experts.md)
        gate_up, down = [], []
        for e, _, _ in spans:
            expert = self.experts[e]
            gate_up.append(cpu_gemm.current_pack(expert.gate_up_proj.weight))
            down.append(cpu_gemm.current_pack(expert.down_proj.weight))
            if gate_up[-1] is None or down[-1] is None:
                return None
        return cpu_moe.experts(x, order, weights, gate_up, down, [start for _, start, _ in spans] + [spans[-1][2]],
                               [cpu_gemm.expert_rows(stop - start) for _, start, stop in spans])


def _spans(counts: list[int]):
    """``(expert, start, stop)`` for each expert with rows: its rows of the grouped ``(T * k)`` choices."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


def refresh_expert_tables(model: nn.Module) -> None:
    """After a weight write: every fused MoE layer's tables point at its experts' weights where they now are."""
    for module in model.modules():
        if isinstance(module, SparseMoE) and module.fused:
            module.refresh_tables()
