"""A row-parallel weight cut into its fixed input-dim chunks, for the invariant numerics mode.

``RowParallelLinear`` in ``numerics="invariant"`` multiplies each chunk of its input dim on its
own (docs/numerics.md): ``(M, w) @ (w, out)``, w = in / chunks, the same GEMM shape at every TP.
The pieces it multiplies are derived from the plain weight once, not sliced every call: each is
a contiguous ``(out, w)`` copy in the accumulation dtype (float32 for bfloat16/float16 weights:
widening is exact, so the products are those of the model's weights), oneDNN-packed where
``cpu_gemm`` packs float32. The plain weight stays the one the loader and resharder write.

Derived state, like ``cpu_gemm``'s packs: ``drop`` forgets the pieces (``InferExecutor`` calls it
before any weight write) and ``pack`` builds them after it; ``pieces`` also builds them on first
use (a model outside an executor), keyed by the plain tensor's address and shape, so a ``.data``
replaced by a switch is never served stale.

On CUDA the float32 copies cost 2x the row-parallel weights' bfloat16 bytes of GPU memory;
``torch.mm(..., out_dtype=torch.float32)`` could read the bfloat16 weights directly (not done: no
GPU was available to test it).
"""

from __future__ import annotations

import torch
from torch import nn

from pat_engine.model import cpu_gemm

PIECES_ATTR = "chunk_pieces"  # on a weight Parameter: ((address, shape, width), [piece, ...])


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunk partials are computed and summed in: float64 stays float64, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """Build the pieces of every chunked layer of ``model`` now (after a weight write, so the next
    step does not pay for it); returns how many layers were packed."""
    layers = [m for m in model.modules() if getattr(m, "chunk_width", 0) and m.weight.numel()]
    for m in layers:
        pieces(m.weight, m.chunk_width)
    return len(layers)


def drop(model: nn.Module) -> None:
    """Forget every chunk piece of ``model`` (rebuilt on next use)."""
    for p in model.parameters():
        if hasattr(p, PIECES_ATTR):
            delattr(p, PIECES_ATTR)
