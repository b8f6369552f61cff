"""oneDNN-packed weights for the CPU GEMMs (float32, and bfloat16 on CPUs with bfloat16 dot products).

``F.linear`` on the CPU multiplies against the plain ``(out, in)`` weight every call; oneDNN can
keep the weight reordered into its own blocked layout once and reuse it. At decode sizes this
halves the GEMM time on this project's 2-core AVX2 machine (bench/results/cpu_gemm_packed.md),
which is most of the gap to vLLM's CPU build: it does the same (a prepacked oneDNN handle per
linear layer).

Fast-mode steps of up to ``SKINNY_ROWS`` rows (the long tail's decode steps: two in float32, one in
bfloat16) skip the pack: the skinny kernel (``pat_kernels/cpu/skinny_gemm.cpp``) reads each plain weight
row once, near the speed ``torch.sum`` reads them at: 1.1-1.7x oneDNN's packed GEMM there on this
project's machine (bench/results/cpu_skinny_gemm.md); with more rows oneDNN is mostly ahead. The invariant
mode never takes it.

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

``padded_rows`` is the one home of how many rows a CPU GEMM is handed (``layers/linear.py`` pads
to it; ``worker/step_inputs.py`` pads decode batches by the same rule). In the invariant numerics
mode it also keeps the GEMM on one kernel whatever the row count: oneDNN multiplies one row
with another kernel than two or more, which sums the input dim in another order once it is over
1024 wide (a row alone differs from the same row among others: float32 at every output width,
bfloat16 at some), and torch's unpacked float32 GEMM does so for one and two rows at every width
(measured on this project's AVX-512 machine, ``tests/test_invariant_numerics.py`` sweeps it). That
was why a single worker (TP1, one chunk of 1408 per ``down_proj``) was not batch invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine import env

try:  # the kernels package sits beside the engine in a checkout and in an install
    from pat_kernels import cpu_skinny_gemm
except ImportError:  # pragma: no cover - a partial install: oneDNN serves every row count
    cpu_skinny_gemm = None

# fast-mode steps of at most this many rows take the skinny kernel: where it beat oneDNN on every weight shape of
# bench/results/cpu_skinny_gemm.md (bfloat16 at two rows: 0.84-1.41x, so one)
SKINNY_ROWS = {torch.float32: 2, torch.bfloat16: 1}
ROW_ALIGN = 4  # torch's unpacked GEMM runs row counts off a multiple of 4 through a slower remainder path
PAD_BELOW = 256  # ... which stops mattering beyond a few hundred rows
MLP_CHUNK_BYTES = 16 << 20  # a CPU MLP chunk's gate/up output: under glibc's 32 MiB mmap threshold (mlp_chunk_rows)
EXACT_EXPERT_ROWS = 32  # an expert's row counts below this run as given (few enough distinct ones: expert_rows)
PACKED_ATTR = "cpu_packed"  # on a weight Parameter: (address of the plain data, packed tensor)
GEMM_ATTR = "is_gemm_weight"  # set by the layers whose weight is multiplied through ``linear``


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` get packed (see the module docstring)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available() or not env.cpu_gemm_packing():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def expert_rows(rows: int) -> int:
    """How many rows an MoE expert's packed GEMMs run with in the CPU experts kernel (zero rows appended): below
    ``EXACT_EXPERT_ROWS`` as many as given, above that rounded up to one of 16 steps an octave (at most 1/16 more
    rows). oneDNN builds a kernel for every new row count (a fraction of a millisecond each), and a prefill's
    experts meet new counts at every step as the routing moves: a fresh process's 2048-token MoE prefills of
    new prompts ran their first step 1.14x (float32) / 1.44x (bfloat16) faster rounded, steps 2-4 1.03x /
    1.26x, and as fast (0.99x / 1.01x) once warm (bench/results/cpu_moe_rows.md). On this host the rounded
    rows give the same bits (tests/test_moe.py)."""
    if rows < EXACT_EXPERT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)  # 16 steps from 2^b to 2^(b+1)
    return -(-rows // step) * step


def mlp_chunk_rows(gate_up: torch.Tensor) -> int:
    """Rows per chunk of a fast-mode CPU MLP step: its gate/up output (rows x the weight's rows) stays within
    ``MLP_CHUNK_BYTES``. glibc maps every buffer above 32 MiB afresh and unmaps it on free, so a 2048-token
    step's (2048, 4096) float32 gate/up output (33.5 MB) was faulted in anew every step; a chunk's comes back
    from the heap. Each output row depends only on its input row."""
    return max(1, MLP_CHUNK_BYTES // (gate_up.shape[0] * gate_up.element_size()))


def padded_rows(rows: int, packed: bool, invariant: bool) -> int:
    """How many rows a CPU GEMM of ``rows`` input rows runs with (zero rows appended; each output row
    depends only on its own input row). Unpacked: a multiple of ``ROW_ALIGN`` from 3 to ``PAD_BELOW``
    rows (float64, 2048x6144 weight, one thread: 7 rows take 21 ms, 8 rows 10 ms; bench/cpu_gemm_rows.py);
    packed: as many as given. ``invariant``: never fewer than ``ROW_ALIGN``, so that no row count
    reaches the one- and two-row kernels (module docstring)."""
    if invariant and rows < ROW_ALIGN:
        return ROW_ALIGN
    if packed or rows < 3 or rows >= PAD_BELOW:
        return rows
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 2-D CPU ``x``: a fast-mode step of up to ``SKINNY_ROWS`` rows through the
    skinny kernel (each weight row read once: the long tail's decode steps); else through the weight's pack
    when it has a current one, else ``F.linear``, rows padded to ``padded_rows`` (the padding rows are cut
    off again)."""
    rows = x.shape[0]
    if (not invariant and rows <= SKINNY_ROWS.get(x.dtype, 0) and cpu_skinny_gemm is not None
            and cpu_skinny_gemm.usable(x, weight)):
        return cpu_skinny_gemm.linear(x, weight, bias)
    packed = current_pack(weight) is not None
    padded = padded_rows(rows, packed, invariant)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = packed_linear(x, weight, bias) if packed else F.linear(x, weight, bias)
    return out if padded == rows else out[:rows]


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


def current_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s pack, or None when it has none made from its current data."""
    entry = getattr(weight, PACKED_ATTR, None)
    return None if entry is None or entry[0] != weight.data_ptr() else entry[1]


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` through the weight's pack, or None when it has no current pack."""
    pack = current_pack(weight)
    return None if pack is None else torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


def _gemm_weights(model: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and getattr(module, GEMM_ATTR, False):
            seen.setdefault(id(weight), weight)  # a tied LM head shares the embedding's Parameter
    return list(seen.values())
