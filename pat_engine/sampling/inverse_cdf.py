"""The draw rule's arithmetic: inverse CDF in token-id order, the same bits from C++ and from torch.

For a row of logits ``x``, an inverse temperature ``it`` and a floor (``log(min_p)``, or -inf):

    m   = max_i float32(x_i)
    z_i = (float32(x_i) - m) * it                       float32, each operation rounded on its own
    e_i = pexp(z_i) if z_i >= floor else 0              a fixed polynomial exp (Cephes' expf)
    T_k = block k's e_i (i in [k * Z_BLOCK, (k + 1) * Z_BLOCK)) summed in float64 in eight lanes
          (lane j takes i = j mod 8, in order, from 0.0), the lanes combined ((0+1)+(2+3))+((4+5)+(6+7))
    Z   = the T_k added in order, from 0.0
    token = the first i whose running float64 sum of e exceeds u * Z

The C++ kernel (csrc/pat_kernels/cpu/sample.cpp) does this with one thread per row and no sort;
``_torch_inverse_cdf`` below does the same operations with torch (other devices, or
``PAT_CPU_SAMPLER=torch``). Only +, *, floor, comparisons and exact conversions are used, which
round the same in scalar and vector code, so on the CPU neither the batch nor the thread count
changes a bit. On CUDA the weights, Z and the draw run as Triton kernels (pat_kernels/triton_sampler.py;
``PAT_TRITON_SAMPLER``, on there by default): the same weights and Z, and a draw (and a top_p nucleus,
``nucleus_sizes``) whose running sum is taken in blocks, an order fixed by the row alone. With
``PAT_TRITON_SAMPLER=off`` (or without Triton) the running sum there is ATen's parallel ``cumsum``, whose
order follows the batch's row count: a draw whose target lands between two roundings of one boundary can
differ (rare; docs/numerics.md, "Not covered"); the invariant numerics mode samples inside
``batch_invariant_draws``, which takes the kernels whatever the switch says. The log of Z
is left to the caller (Python's ``math.log``): a library log differs between its vector and scalar
paths. Z's blocks make its chains of dependent adds Z_BLOCK / 8 long instead of V / 8 (16,032 for
Llama-3's vocabulary), so a GPU walks a row's blocks side by side; on the CPU they change nothing but the
order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from pat_engine import env

try:  # the kernels package sits beside the engine in a checkout and in an install
    from pat_kernels import cpu_sample
except ImportError:  # pragma: no cover - a partial install: the torch path serves
    cpu_sample = None

LANES = 8
Z_BLOCK = 1024  # tokens per block of Z (csrc/pat_kernels/cpu/sample_rule.h: kZBlock)
EXP_MIN = -87.33654  # below this expf underflows: the weight is 0


def pexp(z: torch.Tensor) -> torch.Tensor:
    """Cephes' expf for float32 ``z <= 0``, operation by operation as in cpu/sample.cpp."""
    zc = torch.clamp(z, min=EXP_MIN)
    n = torch.floor(zc * 1.44269504088896341 + 0.5)
    r = zc - n * 0.693359375
    r = r - n * -2.12194440e-4
    r2 = r * r
    p = torch.full_like(r, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c
    y = p * r2 + r + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(z >= EXP_MIN, y * scale, torch.zeros((), dtype=torch.float32, device=z.device))


def weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, m): every token's unnormalised weight (B, V) float32 and each row's max logit (B, 1)."""
    inv_temp, floor = inv_temp.to(torch.float32).contiguous(), floor.to(torch.float32).contiguous()
    if cpu_sample is not None and cpu_sample.usable(x):
        return cpu_sample.weights(x.contiguous(), inv_temp, floor), x.max(dim=-1, keepdim=True).values.float()
    return _twin_weights(x, inv_temp, floor)


def lane_sum(e: torch.Tensor) -> torch.Tensor:
    """Z per row (float64), in the rule's blocks of eight lanes (sequential cumsums down each block's lanes,
    then down the blocks' totals); by the Triton kernel where ``PAT_TRITON_SAMPLER`` asks for it (CUDA by
    default) and it serves (the same bits)."""
    if _triton_takes_weights(e):
        from pat_kernels.triton_sampler import lane_sum as kernel

        return kernel(e.contiguous(), Z_BLOCK)
    rows, vocab = e.shape
    blocks = max(1, -(-vocab // Z_BLOCK))
    padded = torch.nn.functional.pad(e, (0, blocks * Z_BLOCK - vocab)).double()  # 0.0 adds nothing to a lane
    a = padded.view(rows, blocks, Z_BLOCK // LANES, LANES).cumsum(dim=2)[:, :, -1, :]
    totals = ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))
    return totals.unsqueeze(-1).cumsum(dim=1)[:, -1, 0]  # T_0 + T_1 + ... in order (0.0 + T_0 is T_0)


_BATCH_INVARIANT = contextvars.ContextVar("pat_batch_invariant_draws", default=False)


@contextlib.contextmanager
def batch_invariant_draws(on: bool = True) -> Iterator[None]:
    """Within (``on``): the torch path runs the Triton kernels wherever they serve, whatever
    ``PAT_TRITON_SAMPLER`` says, so the draw's and the top_p nucleus's running sums follow the row alone.
    The invariant numerics mode samples inside it on CUDA (worker/infer_executor.py): ATen's scan, which
    ``PAT_TRITON_SAMPLER=off`` leaves there, follows the batch's row count."""
    token = _BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def _triton_sampler_serves(t: torch.Tensor) -> bool:
    """Asked for on ``t``'s device (``PAT_TRITON_SAMPLER``: CUDA by default), or inside ``batch_invariant_draws``
    where a Triton kernel can take ``t``'s device."""
    kind = t.device.type
    return env.triton_sampler(kind) or (_BATCH_INVARIANT.get() and env.triton_runs_on(kind))


def _triton_takes_weights(e: torch.Tensor) -> bool:
    """Whether the Triton kernels that read weights (Z, the nucleus) take ``e``: float32, and they serve."""
    return e.dtype == torch.float32 and _triton_sampler_serves(e)


def _twin_weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, m) off the C++ kernel: the torch formulas, or the Triton kernel where ``PAT_TRITON_SAMPLER`` asks
    for it (the same bits)."""
    if _triton_sampler_serves(x):
        from pat_kernels.triton_sampler import weights as kernel

        return kernel(x.contiguous(), inv_temp, floor)
    return _torch_weights(x, inv_temp, floor)


def _torch_weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    m = xf.max(dim=-1, keepdim=True).values
    z = (xf - m) * inv_temp.unsqueeze(1)
    return torch.where(z >= floor.unsqueeze(1), pexp(z), torch.zeros((), dtype=torch.float32, device=x.device)), m


def _torch_inverse_cdf(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor, u: torch.Tensor,
                       draw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e, m = _twin_weights(x, inv_temp, floor)
    z_sum = lane_sum(e)
    if draw and _triton_sampler_serves(e):  # the running sum in blocks (docs/numerics.md)
        from pat_kernels.triton_sampler import draw as kernel

        token = kernel(e, u, z_sum)
    elif draw:
        running = e.double().cumsum(dim=-1)  # the kernel's sequential scan on the CPU (a parallel one on CUDA)
        token = (running <= (u * z_sum).unsqueeze(1)).sum(dim=-1)
        ids = torch.arange(e.shape[-1], device=e.device)
        last = torch.where(e > 0, ids, 0).max(dim=-1).values  # where rounding left u * Z >= the whole sum
        token = torch.where(token >= e.shape[-1], last, token)
    else:
        token = (x.float() == m).int().argmax(dim=-1)  # the first maximum
    z_token = (x.float().gather(1, token.unsqueeze(1)) - m).squeeze(1) * inv_temp
    return token, z_token, z_sum


def nucleus_sizes(e_sorted: torch.Tensor, top_p: torch.Tensor, z_sum: torch.Tensor) -> torch.Tensor:
    """Per row of weights in descending order: how many leading tokens the top_p nucleus holds, i.e. one
    more than the tokens whose running float64 sum stays below top_p * Z (int64; V + 1 where rounding
    leaves the whole sum short). The running sum is the draw's: the Triton kernel's blocks wherever they
    run the draw (``PAT_TRITON_SAMPLER``: CUDA by default, or inside ``batch_invariant_draws``), else a
    cumsum (the CPU's chain; ATen's scan on CUDA)."""
    if _triton_takes_weights(e_sorted):
        from pat_kernels.triton_sampler import first_reaching

        return first_reaching(e_sorted.contiguous(), top_p, z_sum) + 1
    target = top_p.to(torch.float64) * z_sum
    return (e_sorted.double().cumsum(dim=-1) < target.unsqueeze(1)).sum(dim=-1) + 1


def inverse_cdf(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor, u: torch.Tensor | None,
                draw: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (token, z of the token (float32), Z (float64)); the token's log-probability under the
    distribution drawn from is ``z - log(Z)``. ``draw=False``: the first maximum instead of a draw
    (``u`` unused), for log-probs of given rows.

    x: (B, V) logits; inv_temp, floor: float32 (B,); u: float64 (B,) uniforms.
    """
    x = x.contiguous()
    inv_temp = inv_temp.to(torch.float32).contiguous()
    floor = floor.to(torch.float32).contiguous()
    u = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device) if u is None else u.contiguous()
    if cpu_sample is not None and cpu_sample.usable(x):
        return cpu_sample.inverse_cdf(x, inv_temp, floor, u, draw)
    return _torch_inverse_cdf(x, inv_temp, floor, u, draw)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (``argmax``), by the C++ kernel's sixteen-lane pass where it serves ``x``, or by
    the Triton sampler's chunked pass where it serves (CUDA by default: torch's argmax reduces a row in one
    block)."""
    if cpu_sample is not None and cpu_sample.usable(x) and x.stride(-1) == 1:
        return cpu_sample.argmax(x)
    if x.dim() == 2 and x.dtype != torch.float64 and x.stride(-1) == 1 and _triton_sampler_serves(x):
        from pat_kernels.triton_sampler import first_max as kernel

        return kernel(x)
    return x.argmax(dim=-1)


def first_max_and_z(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first maximum, Z) of plain logits (temperature 1, no floor), in one pass where the kernel serves."""
    rows = x.shape[0]
    ones = torch.ones(rows, dtype=torch.float32, device=x.device)
    floor = torch.full((rows,), float("-inf"), dtype=torch.float32, device=x.device)
    first, _, z_sum = inverse_cdf(x, ones, floor, None, draw=False)
    return first, z_sum


def log_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, Z) of plain logits (temperature 1, no floor): log_softmax(x)_i = (float32(x_i) - m) - log(Z)."""
    first, z_sum = first_max_and_z(x)
    # the logit at the first maximum is the max, exact in any dtype: no second pass over the rows
    return x.gather(1, first.unsqueeze(1)).squeeze(1).float(), z_sum


def prefix_kernel_serves(x: torch.Tensor) -> bool:
    """Whether the C++ prefix kernel draws from ``x`` (a CPU tensor it supports, the switch on, built)."""
    return cpu_sample is not None and cpu_sample.usable(x)


def inverse_cdf_in_prefix(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor, u: torch.Tensor,
                          top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``inverse_cdf`` among each row's top_k / top_p prefix, by the C++ kernel (cpu/sample_prefix.cpp: it
    sorts only the logits of the histogram bucket the prefix ends in); None where the kernel does not serve
    ``x`` (the caller then masks the row to its prefix and calls ``inverse_cdf``: the same bits)."""
    if not prefix_kernel_serves(x):
        return None
    return cpu_sample.inverse_cdf_prefix(x.contiguous(), inv_temp.to(torch.float32).contiguous(),
                                         floor.to(torch.float32).contiguous(), u.contiguous(),
                                         top_k.to(torch.long).contiguous(), top_p.to(torch.float64).contiguous())
