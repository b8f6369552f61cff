"""This rank's node of a row-parallel product's reduction tree, for the invariant numerics mode.

``RowParallelLinear`` in ``numerics="invariant"`` multiplies each fixed chunk of its input dim on
its own (docs/numerics.md): ``(M, w) @ (w, out)``, w = in / chunks, the same leaves at every TP,
summed by the tree (parallel/reduction_tree.py). ``local_sum`` returns the node over this rank's
chunks, ``(M, out)``, in the accumulation dtype (float32; float64 for float64 models):

- CPU: one call of the chunk GEMM kernel (``pat_kernels/cpu/chunk_gemm.cpp``: every leaf a float32
  fma chain in k order, the leaves added as the tree adds them, in one pass over the weight in
  its own dtype). It reads the weight as *panels* (``pat_kernels.cpu_chunk_gemm.panels``: the
  shard transposed into blocks of 16 output columns, in the model's dtype). Where the kernel is
  off or not built, each chunk goes through oneDNN against a *piece* (a contiguous ``(out, w)``
  float32 copy of the chunk: torch has no bfloat16 x bfloat16 -> float32 CPU GEMM) and the
  leaves are summed by the tree in torch: invariant as well, with other bits.
- CUDA: one launch of the invariant Triton GEMM (``pat_kernels/invariant_matmul.py``) over the
  weight as it is, in the model's dtype, with float32 accumulators, giving the leaves, summed by
  the tree in slabs of rows: no copies, so a GPU rank's memory plan counts the weights alone
  (model/footprint.py).

Panels and pieces are derived state, like ``cpu_gemm``'s packs: ``drop`` forgets them
(``InferExecutor`` calls it before any weight write) and ``pack`` builds them after it;
``derived`` also builds them on first use, keyed by the plain tensor's address and shape, so a
``.data`` replaced by a switch is never served stale. The plain weight stays the one the loader
and resharder write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model import cpu_gemm, gpu_gemm
from pat_engine.parallel.reduction_tree import ReductionTree

try:
    from pat_kernels import cpu_chunk_gemm
except ImportError:  # the kernels package is not on the path: oneDNN per chunk serves
    cpu_chunk_gemm = None

DERIVED_ATTR = "chunk_derived"  # on a weight Parameter: ((address, shape, width, kernel), panels or [piece, ...])
SLAB_ROWS = 1024  # CUDA: rows whose (chunks, rows, out) leaves are held at once (a prefill's tokens)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunk partials are computed and summed in: float64 stays float64, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_sum(x: torch.Tensor, weight: nn.Parameter, width: int, tree: ReductionTree, first: int) -> torch.Tensor:
    """``(M, out)``: this rank's node of ``tree``, the sum of ``x``'s chunks (columns ``c * width ...``) times
    the same chunks of the local ``weight`` shard, whose first is chunk ``first`` of the tree."""
    n, acc = weight.shape[1] // width, accumulate_dtype(x.dtype)
    if gpu_gemm.covers(x):
        slabs = [gpu_gemm.invariant_matmul(x[i : i + SLAB_ROWS], weight, chunks=n, out_dtype=acc)
                 for i in range(0, x.shape[0], SLAB_ROWS)]
        return torch.cat([tree.sum_stacked(leaves, first) for leaves in slabs])
    if x.device.type == "cpu" and cpu_chunk_gemm is not None and cpu_chunk_gemm.usable(weight, width):
        return cpu_chunk_gemm.node(x, derived(weight, width), weight.shape[0], n)
    chunks = x.reshape(x.shape[0], n, width).transpose(0, 1).to(acc, memory_format=torch.contiguous_format)
    if x.device.type == "cpu":
        leaves = [cpu_gemm.linear(c, p, None, invariant=True) for c, p in zip(chunks, derived(weight, width))]
    else:  # float64 on CUDA (not covered: gpu_gemm.covers): torch's GEMM, weight in place
        leaves = [F.linear(c, weight[:, i * width : (i + 1) * width]) for i, c in enumerate(chunks)]
    return tree.sum_stacked(torch.stack(leaves), first)


def derived(weight: nn.Parameter, width: int) -> torch.Tensor | list[torch.Tensor]:
    """What the CPU multiplies ``weight``'s local shard through: its panels where the chunk kernel
    serves (now: ``cpu_extension.switched_on``), else its ``(out, width)`` chunk pieces in chunk order."""
    kernel = cpu_chunk_gemm is not None and cpu_chunk_gemm.usable(weight, width)
    key = (weight.data_ptr(), tuple(weight.shape), width, kernel)
    entry = getattr(weight, DERIVED_ATTR, None)
    if entry is not None and entry[0] == key:
        return entry[1]
    if kernel:
        built = cpu_chunk_gemm.panels(weight)
    else:
        built = []
        acc = accumulate_dtype(weight.dtype)
        for c in range(weight.shape[1] // width):
            piece = weight.detach()[:, c * width : (c + 1) * width].to(acc).contiguous()
            built.append(cpu_gemm.attach_pack(piece) if cpu_gemm.packing_enabled(piece.device, acc) else piece)
    setattr(weight, DERIVED_ATTR, (key, built))
    return built


def pack(model: nn.Module) -> int:
    """Build the panels or pieces of every chunked layer of ``model`` on the CPU now (after a weight
    write, so the next step does not pay for it); returns how many layers were packed. Other
    devices need none."""
    layers = [m for m in model.modules()
              if getattr(m, "chunk_width", 0) and m.weight.numel() and m.weight.device.type == "cpu"]
    for m in layers:
        derived(m.weight, m.chunk_width)
    return len(layers)


def drop(model: nn.Module) -> None:
    """Forget every derived panel and piece of ``model`` (rebuilt on next use)."""
    for p in model.parameters():
        if hasattr(p, DERIVED_ATTR):
            delattr(p, DERIVED_ATTR)
