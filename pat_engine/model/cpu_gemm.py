"""oneDNN-packed weights for the CPU GEMMs (float32, and bfloat16 on CPUs with bfloat16 dot products).

``F.linear`` on the CPU multiplies against the plain ``(out, in)`` weight every call; oneDNN can
keep the weight reordered into its own blocked layout once and reuse it. At decode sizes this
halves the GEMM time on this project's 2-core AVX2 machine (bench/results/cpu_gemm_packed.md),
which is most of the gap to vLLM's CPU build: it does the same (a prepacked oneDNN handle per
linear layer).

The packed copy is derived state. ``pack`` builds it from the plain weights and ``drop``
forgets it; ``InferExecutor.writing_weights`` drops it before any weight write (load, update,
switch, sleep) and packs again after. As a second guard each pack remembers the address of the
plain tensor it was made from: a ``.data`` replaced behind the executor's back is never served
from a stale pack (``linear`` falls back to ``F.linear``).

float32, and bfloat16 where the CPU has native bfloat16 dot products (AVX512-BF16 / AMX, as
``torch.ops.mkldnn._is_mkldnn_bf16_supported`` reports): there an unpacked bfloat16 ``F.linear``
reorders the weight on every call (vLLM's CPU build prepacks it too). Not float64: oneDNN has no
float64 GEMM (the exactness suite's dtype). The plain weights stay resident (the resharder and the weight loaders
write into them), so packing doubles the weight bytes a CPU worker holds; ``PAT_CPU_GEMM=torch``
turns it off (also how the benchmark measures the unpacked path).
"""

from __future__ import annotations

import torch
from torch import nn

from pat_engine import env

PACKED_ATTR = "cpu_packed"  # on a weight Parameter: (address of the plain data, packed tensor)
GEMM_ATTR = "is_gemm_weight"  # set by the layers whose weight is multiplied through ``linear``


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` get packed (see the module docstring)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available() or not env.cpu_gemm_packing():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(model: nn.Module) -> int:
    """Pack every GEMM weight of ``model``; returns how many were packed."""
    packed = 0
    for p in _gemm_weights(model):
        if p.dim() == 2 and p.numel() > 0 and packing_enabled(p.device, p.dtype):
            attach_pack(p)
            packed += 1
    return packed


def attach_pack(weight: torch.Tensor) -> torch.Tensor:
    """Give ``weight`` (a Parameter or a plain tensor) its pack; returns ``weight``."""
    setattr(weight, PACKED_ATTR, (weight.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(weight.detach())))
    return weight


def drop(model: nn.Module) -> None:
    for p in _gemm_weights(model):
        if hasattr(p, PACKED_ATTR):
            delattr(p, PACKED_ATTR)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` through the weight's pack, or None when it has no current pack."""
    entry = getattr(weight, PACKED_ATTR, None)
    if entry is None or entry[0] != weight.data_ptr():
        return None
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


def _gemm_weights(model: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and getattr(module, GEMM_ATTR, False):
            seen.setdefault(id(weight), weight)  # a tied LM head shares the embedding's Parameter
    return list(seen.values())
