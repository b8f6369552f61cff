"""The chunk partials of a row-parallel product, for the invariant numerics mode.

``RowParallelLinear`` in ``numerics="invariant"`` multiplies each fixed chunk of its input dim on
its own (docs/numerics.md): ``(M, w) @ (w, out)``, w = in / chunks, the same GEMM shape at every
TP. ``partials`` returns this rank's chunk products, ``(n, M, out)``, in the accumulation dtype
(float32; float64 for float64 models), for ``ReductionTree.reduce``:

- CUDA: one launch of the invariant Triton GEMM (``pat_kernels/invariant_matmul.py``) over the
  weight as it is, in the model's dtype, with float32 accumulators: no copies, so a GPU rank's
  memory plan counts the weights alone (model/footprint.py).
- CPU: one GEMM per chunk against a *piece*, a contiguous ``(out, w)`` copy of the chunk in the
  accumulation dtype (torch's CPU GEMMs have no bfloat16 x bfloat16 -> float32 product, so a
  bfloat16 chunk is widened: exact), oneDNN-packed where ``cpu_gemm`` packs float32. The pieces
  are derived state, like ``cpu_gemm``'s packs: ``drop`` forgets them (``InferExecutor`` calls it
  before any weight write) and ``pack`` builds them after it; ``pieces`` also builds them on
  first use, keyed by the plain tensor's address and shape, so a ``.data`` replaced by a switch
  is never served stale. The plain weight stays the one the loader and resharder write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model import cpu_gemm, gpu_gemm

PIECES_ATTR = "chunk_pieces"  # on a weight Parameter: ((address, shape, width), [piece, ...])


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunk partials are computed and summed in: float64 stays float64, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def partials(x: torch.Tensor, weight: nn.Parameter, width: int) -> torch.Tensor:
    """``(n, M, out)``: ``x``'s chunk ``c`` (columns ``c * width ...``) times the same chunk of the local
    ``weight`` shard, for its ``n = in_local / width`` chunks, in the accumulation dtype."""
    n, acc = weight.shape[1] // width, accumulate_dtype(x.dtype)
    if gpu_gemm.covers(x):
        return gpu_gemm.invariant_matmul(x, weight, chunks=n, out_dtype=acc)
    chunks = x.reshape(x.shape[0], n, width).transpose(0, 1).to(acc, memory_format=torch.contiguous_format)
    if x.device.type != "cpu":  # float64 on CUDA (not covered: gpu_gemm.covers): torch's GEMM, weight in place
        return torch.stack([F.linear(c, weight[:, i * width : (i + 1) * width]) for i, c in enumerate(chunks)])
    return torch.stack([cpu_gemm.linear(c, p, None, invariant=True) for c, p in zip(chunks, pieces(weight, width))])


def pieces(weight: nn.Parameter, width: int) -> list[torch.Tensor]:
    """The ``(out, width)`` chunk pieces of ``weight``'s local shard, in chunk order."""
    key = (weight.data_ptr(), tuple(weight.shape), width)
    entry = getattr(weight, PIECES_ATTR, None)
    if entry is not None and entry[0] == key:
        return entry[1]
    acc = accumulate_dtype(weight.dtype)
    built = []
    for c in range(weight.shape[1] // width):
        piece = weight.detach()[:, c * width : (c + 1) * width].to(acc).contiguous()
        if cpu_gemm.packing_enabled(piece.device, acc):
            piece = cpu_gemm.attach_pack(piece)
        built.append(piece)
    setattr(weight, PIECES_ATTR, (key, built))
    return built


def pack(model: nn.Module) -> int:
    """Build the pieces of every chunked layer of ``model`` on the CPU now (after a weight write, so the
    next step does not pay for it); returns how many layers were packed. Other devices need none."""
    layers = [m for m in model.modules()
              if getattr(m, "chunk_width", 0) and m.weight.numel() and m.weight.device.type == "cpu"]
    for m in layers:
        pieces(m.weight, m.chunk_width)
    return len(layers)


def drop(model: nn.Module) -> None:
    """Forget every chunk piece of ``model`` (rebuilt on next use)."""
    for p in model.parameters():
        if hasattr(p, PIECES_ATTR):
            delattr(p, PIECES_ATTR)
