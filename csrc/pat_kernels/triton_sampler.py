"""The sampler's arithmetic on a GPU, in Triton: each row's weights and its sum Z with the bits of the torch
twin in pat_engine/sampling/inverse_cdf.py (which has the rule; the CPU's C++ kernel computes it too), and
the draw with a running sum taken in blocks.

For a row of logits x, an inverse temperature ``it`` and a floor:

- ``weights``: m = max float32(x); z = (float32(x) - m) * it; e = pexp(z) if z >= floor else 0, with
  pexp the fixed polynomial exp (Cephes' expf), every operation rounded on its own as torch's separate
  kernels round them (FMA contraction off). Two kernels over (row, chunk of 4,096) programs, so even one
  row keeps many SMs busy: each chunk's max, then each chunk's weights from the row's max (a max is exact
  in any order; NaN wins, as in torch's). The torch twin runs some thirty elementwise kernels over
  (rows, vocab) for the same values.
- ``lane_sum``: Z, in the rule's blocks (``inverse_cdf.Z_BLOCK`` tokens: 126 for a 128,256-token
  vocabulary): in block k, lane j (0-7) adds e_j, e_{j+8}, ... of the block in order, in float64, from
  0.0; the lanes combine ((0+1)+(2+3))+((4+5)+(6+7)) into the block's total; Z is the totals added in
  order. One program a row walks every block's eight lanes side by side (a (blocks, 8) tile of float64
  sums, ``UNROLL`` steps a pipeline stage, the next stages copied in asynchronously), so the chain of
  dependent adds is block / 8 = 128 long (the rule before blocks: 16,032 for that vocabulary, 0.58 ms a
  row on the fourth H100 run); the totals go through memory and come back after a barrier, every load
  issued before their chain of adds. Rows run side by side.
- ``draw``: the token where the row's running float64 sum of e first passes u·Z. The CPU's rule is one
  chain of V dependent adds (a GPU's torch twin scans in ATen's order, which follows the batch's row
  count); here the sum is taken in ``DRAW_BLOCKS`` (512) blocks (``blocked_draw_reference`` has the rule in
  plain floats): each block's total by one lane of a 512-lane walk, the totals' running sum in order (read
  back from memory after a barrier, as Z's are), then the crossing block walked from its start: chains of
  251 + 512 + 251 adds for a 128,256-token vocabulary (with 128 blocks, as on the fourth H100 run: 1,002 +
  128 + 1,002, the totals taken out of the walk's registers one cross-warp sum at a time). Fixed by the row alone (batch-invariant); the CPU chain's token except
  where u·Z falls between two roundings of a boundary.
- ``first_reaching``: the same walk asking where the running sum reaches (>=) a target instead of passing
  it: over a row sorted by descending weight with top_p·Z as the target, one less than the top_p nucleus
  (``inverse_cdf.nucleus_sizes``), so a top_p row's kept prefix is batch-invariant as well.
- ``first_max``: greedy's token, ``torch.argmax``'s answer (the first place of the row's max; of its first
  NaN where it holds one), over the same (row, chunk) programs as the weights, then one program a row
  picks the first chunk holding the winner. torch's own argmax reduces a row in one block: 37 us of a
  batch-1 greedy step's 6.2 GPU ms for Llama-3's 128,256 logits on the fourth H100 run.

Bits (weights, Z): the twin's operations in the twin's order (0.0 pads a row to a whole number of blocks,
as its ``F.pad`` does; adding 0.0 to a non-negative sum changes nothing). Tested under
``TRITON_INTERPRET=1`` (tests/test_triton_sampler.py). Used on CUDA by default (``PAT_TRITON_SAMPLER=auto``; the
fourth H100 run, before Z's blocks: the RL draw 0.73 / 0.77 ms at 1 / 64 rows against the twin's 2.99 / 7.52,
the same draws, ``bench/results/gpu_check.md``), and by the invariant numerics mode there
(``inverse_cdf.batch_invariant_draws``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.dependent_launch import pdl_options, pdl_wait

UNROLL = 8  # groups of eight each block reads per step of Z's walk (fewer past 128 blocks: see lane_sum)
STAGES = 3  # Z's walk: its next steps' loads in flight (a stage of NB x 8 x UNROLL floats, at most 32 KB)
CHUNK = 4096  # logits per program of the weight passes: a row is cut among many programs (batch 1 too)
BLOCK = 1024  # logits per step of the draw's fallback scan


@triton.jit
def _pexp(z):
    """Cephes' expf for float32 ``z <= 0``, as inverse_cdf.pexp computes it, operation by operation (its
    constants, EXP_MIN = -87.33654 among them, written out: a kernel reads no Python globals)."""
    zc = tl.maximum(z, -87.33654)
    n = tl.floor(zc * 1.44269504088896341 + 0.5)
    r = zc - n * 0.693359375
    r = r - n * -2.12194440e-4
    r2 = r * r
    p = tl.full(z.shape, 1.9875691500e-4, tl.float32)
    p = p * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    y = p * r2 + r + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(z >= -87.33654, y * scale, 0.0)


@triton.jit
def _max_nan_wins(v):
    """(v's NaN mask, whether v holds a NaN, v's max): torch's max rule over a block, a NaN wins (a max is
    exact in any order)."""
    nan = v != v
    has_nan = tl.sum(nan.to(tl.int32), axis=0) > 0
    return nan, has_nan, tl.where(has_nan, float("nan"), tl.max(tl.where(nan, float("-inf"), v), axis=0))


@triton.jit
def _chunk_max_kernel(x_ptr, top_ptr, V, stride_x, CHUNK: tl.constexpr):
    """Program (row, c): the max of chunk c of the row (NaN if it holds one, as torch's max)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    tl.store(top_ptr + row * tl.num_programs(1) + chunk, _max_nan_wins(x)[2])


@triton.jit
def _weights_kernel(x_ptr, top_ptr, it_ptr, floor_ptr, e_ptr, m_ptr, V, stride_x, stride_e, CHUNKS,
                    CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Program (row, c): the row's max from its chunks' (exact in any order; NaN wins), then chunk c's
    weights."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    parts = tl.arange(0, CHUNKS_PAD)
    tops = tl.load(top_ptr + row * CHUNKS + parts, mask=parts < CHUNKS, other=float("-inf"))
    m = _max_nan_wins(tops)[2]
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    z = (tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32) - m) * tl.load(it_ptr + row)
    e = tl.where(z >= tl.load(floor_ptr + row), _pexp(z), 0.0)
    tl.store(e_ptr + row * stride_e + cols, e, mask=ok)
    if chunk == 0:
        tl.store(m_ptr + row, m)


@triton.jit
def _lane(acc, lanes, j: tl.constexpr):
    """Lane ``j`` of each block's lanes ``acc`` (NB, 8) exactly: a sum of it and seven zeros."""
    return tl.sum(tl.where(lanes == j, acc, 0.0), axis=1)


@triton.jit
def _lane_sum_kernel(e_ptr, totals_ptr, out_ptr, V, stride_row, NBLOCKS, ZB: tl.constexpr, NB: tl.constexpr,
                     UNROLL: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = e_ptr + row * stride_row
    blocks = tl.arange(0, NB)[:, None]
    lanes = tl.arange(0, 8)[None, :]
    acc = tl.zeros((NB, 8), dtype=tl.float64)  # every block's eight lanes, walked side by side
    for start in tl.range(0, ZB, 8 * UNROLL, num_stages=STAGES):  # the next step's loads in flight
        for u in tl.static_range(UNROLL):
            idx = blocks * ZB + start + u * 8 + lanes
            acc += tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float64)
    left = (_lane(acc, lanes, 0) + _lane(acc, lanes, 1)) + (_lane(acc, lanes, 2) + _lane(acc, lanes, 3))
    right = (_lane(acc, lanes, 4) + _lane(acc, lanes, 5)) + (_lane(acc, lanes, 6) + _lane(acc, lanes, 7))
    # the block totals in order: through memory, so every load is issued before the chain of adds runs
    totals = totals_ptr + row * NB
    tl.store(totals + tl.arange(0, NB), left + right)
    tl.debug_barrier()  # the CTA's stores are visible to all its threads
    z = tl.load(totals)  # 0.0 + T_0 is T_0
    for k in tl.static_range(1, NB):
        z += tl.load(totals + k, mask=k < NBLOCKS, other=0.0)  # past the last block: 0.0, no change
    tl.store(out_ptr + row, z)


@triton.jit
def _crosses(running, target, REACH: tl.constexpr):
    """Whether a running sum is past the target (the draw) or has reached it (``REACH``: a top_p nucleus)."""
    if REACH:
        return running >= target
    return running > target


@triton.jit
def _draw_kernel(e_ptr, u_ptr, z_ptr, totals_ptr, out_ptr, V, W, stride_e, NB: tl.constexpr, UNROLL: tl.constexpr,
                 WALK_UNROLL: tl.constexpr, FOLD: tl.constexpr, BLOCK: tl.constexpr, REACH: tl.constexpr):
    """The first token where the blocked running sum passes u * Z (``REACH``: reaches it, >=)."""
    row = tl.program_id(0).to(tl.int64)
    base = e_ptr + row * stride_e
    target = tl.load(u_ptr + row) * tl.load(z_ptr + row)
    lanes = tl.arange(0, NB)
    # each block's total: lane k walks its W tokens in order, from 0.0
    totals = tl.zeros((NB,), dtype=tl.float64)
    for w0 in tl.range(0, W, UNROLL, num_stages=3):  # the next step's loads in flight
        for j in tl.static_range(UNROLL):
            within = lanes * 0 + w0 + j  # (NB,) each lane's place in its block
            idx = lanes * W + within
            totals += tl.load(base + idx, mask=(within < W) & (idx < V), other=0.0).to(tl.float64)
    # the blocks' running sum, in order: the first block whose end passes the target. The totals go
    # through memory and come back FOLD at a time, their loads issued before the adds that wait for them.
    scratch = totals_ptr + row * NB
    tl.store(scratch + lanes, totals)
    tl.debug_barrier()  # the CTA's stores are visible to all its threads
    done = tl.full([], 0.0, tl.float64)  # loop-carried values are tensors from the start: one type
    start = done
    block = tl.full([], -1, tl.int32)
    for k0 in range(0, NB, FOLD):
        for j in tl.static_range(FOLD):
            after = done + tl.load(scratch + k0 + j)  # block k0 + j's total
            hit = _crosses(after, target, REACH) & (block < 0)
            start = tl.where(hit, done, start)
            block = tl.where(hit, k0 + j, block)
            done = after
    # inside it: start + the block's own running sum (its end is the block's end above, so it passes)
    token = (block * 0 - 1).to(tl.int64)
    if block >= 0:
        first = block * W
        walked = done * 0.0
        for w0 in tl.range(0, W, WALK_UNROLL, num_stages=3):  # the next step's loads in flight
            for j in tl.static_range(WALK_UNROLL):
                ok = (w0 + j < W) & (first + w0 + j < V)
                walked += tl.load(base + first + w0 + j, mask=ok, other=0.0).to(tl.float64)
                token = tl.where(ok & _crosses(start + walked, target, REACH) & (token < 0),
                                 (first + w0 + j).to(tl.int64), token)
    elif REACH:  # rounding left the whole sum short of the target: none reaches it
        token = (block * 0).to(tl.int64) + V
    else:  # rounding left the target at or past the whole sum: the last token with weight
        cols = tl.arange(0, BLOCK)
        last = tl.full((BLOCK,), 0, tl.int64)
        for c in range(0, V, BLOCK):
            ids = (c + cols).to(tl.int64)
            e = tl.load(base + ids, mask=ids < V, other=0.0)
            last = tl.maximum(last, tl.where(e > 0, ids, 0))
        token = tl.max(last, axis=0)
    tl.store(out_ptr + row, token)


@triton.jit
def _chunk_first_max_kernel(x_ptr, top_ptr, at_ptr, V, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): chunk c's max (NaN if it holds one) and that value's first place in the row."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan, has_nan, top = _max_nan_wins(x)
    hit = tl.where(has_nan, nan, (x == top) & ok)
    item = row * tl.num_programs(1) + chunk
    tl.store(top_ptr + item, top)
    tl.store(at_ptr + item, tl.min(tl.where(hit, cols, V), axis=0))


@triton.jit
def _pick_first_max_kernel(top_ptr, at_ptr, out_ptr, CHUNKS, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program (row): the first chunk holding the row's winner (a NaN, else the max) gives the token (chunks
    are in place order, so its first place is the row's)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < CHUNKS
    tops = tl.load(top_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))  # padding: -inf, never a NaN
    nan, has_nan, best = _max_nan_wins(tops)
    hit = tl.where(has_nan, nan, (tops == best) & ok)
    first = tl.min(tl.where(hit, c, CHUNKS_PAD), axis=0)
    tl.store(out_ptr + row, tl.load(at_ptr + row * CHUNKS + first).to(tl.int64))


def _check_rows(t: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 2 or t.dtype not in dtypes or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{what} takes {', '.join(map(str, dtypes))} (rows, V) with unit stride along V, not "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e float32 (rows, V), m float32 (rows, 1)) of logits ``x`` (any float dtype), ``inv_temp`` and ``floor``
    float32 (rows,)."""
    _check_rows(x, "weights", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    rows, vocab = x.shape
    e = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    m = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and vocab:
        chunks = triton.cdiv(vocab, CHUNK)
        tops = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
        _chunk_max_kernel[(rows, chunks)](x, tops, vocab, x.stride(0), CHUNK=CHUNK, num_warps=8)
        _weights_kernel[(rows, chunks)](x, tops, inv_temp.to(torch.float32).contiguous(),
                                        floor.to(torch.float32).contiguous(), e, m, vocab, x.stride(0), e.stride(0),
                                        chunks, CHUNK=CHUNK, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)),
                                        num_warps=8, enable_fp_fusion=False)
    return e, m.unsqueeze(1)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (int64 (rows,)) of logits ``x`` (rows, V), as ``x.argmax(dim=-1)``: the first
    place of the row's max, or of its first NaN where it holds one."""
    _check_rows(x, "first_max", (torch.float32, torch.bfloat16, torch.float16))
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows and vocab:
        chunks = triton.cdiv(vocab, CHUNK)
        tops = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
        at = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
        pdl = pdl_options(x.device)  # greedy at batch 1 follows the LM head on the step's critical path
        _chunk_first_max_kernel[(rows, chunks)](x, tops, at, vocab, x.stride(0), CHUNK=CHUNK, num_warps=8, **pdl)
        _pick_first_max_kernel[(rows,)](tops, at, out, chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)),
                                        num_warps=1, **pdl)
    return out


def lane_sum(e: torch.Tensor, block: int) -> torch.Tensor:
    """Z per row (float64 (rows,)) of float32 weights ``e`` (rows, V) with unit stride along V, in blocks of
    ``block`` tokens (a multiple of 8 x UNROLL; the rule's ``inverse_cdf.Z_BLOCK``)."""
    _check_rows(e, "lane_sum", (torch.float32,))
    if block % (8 * UNROLL):
        raise ValueError(f"lane_sum walks blocks in steps of {8 * UNROLL} tokens, not blocks of {block}")
    rows, vocab = e.shape
    out = torch.empty(rows, dtype=torch.float64, device=e.device)
    if rows:
        nblocks = max(1, triton.cdiv(vocab, block))
        nb = max(2, triton.next_power_of_2(nblocks))
        totals = torch.empty(rows, nb, dtype=torch.float64, device=e.device)
        unroll = max(1, min(UNROLL, 1024 // nb))  # a pipeline stage stays within 32 KB of shared memory
        _lane_sum_kernel[(rows,)](e, totals, out, vocab, e.stride(0), nblocks, ZB=block, NB=nb, UNROLL=unroll,
                                  STAGES=STAGES, num_warps=max(1, min(8, nb // 32)))
    return out


DRAW_BLOCKS = 512  # the blocks a row's running sum is cut into (``draw``): 251 tokens each for 128,256
DRAW_FOLD = 64  # block totals whose loads are issued together while the draw adds them up in order


def draw(e: torch.Tensor, u: torch.Tensor, z_sum: torch.Tensor) -> torch.Tensor:
    """Each row's drawn token (int64 (rows,)): where the row's running float64 sum of ``e`` first passes
    ``u * z_sum``, the running sum taken in blocks (see ``blocked_draw_reference``, its definition)."""
    return _blocked_scan(e, u, z_sum, reach=False)


def first_reaching(e: torch.Tensor, fraction: torch.Tensor, z_sum: torch.Tensor) -> torch.Tensor:
    """Each row's first place (int64 (rows,)) where the running float64 sum of ``e``, taken in the draw's
    blocks, reaches ``fraction * z_sum`` (>=); V where rounding leaves the whole sum short of it. With ``e``
    in descending order and ``fraction`` = top_p, one more than it is the row's nucleus."""
    return _blocked_scan(e, fraction, z_sum, reach=True)


def _blocked_scan(e: torch.Tensor, fraction: torch.Tensor, z_sum: torch.Tensor, reach: bool) -> torch.Tensor:
    _check_rows(e, "the blocked scan", (torch.float32,))
    rows, vocab = e.shape
    out = torch.empty(rows, dtype=torch.int64, device=e.device)
    if rows:
        width = -(-vocab // DRAW_BLOCKS)
        totals = torch.empty(rows, DRAW_BLOCKS, dtype=torch.float64, device=e.device)
        _draw_kernel[(rows,)](e, fraction.to(torch.float64).contiguous(), z_sum.to(torch.float64).contiguous(), totals,
                              out, vocab, width, e.stride(0), NB=DRAW_BLOCKS, UNROLL=16, WALK_UNROLL=16,
                              FOLD=DRAW_FOLD, BLOCK=BLOCK, REACH=reach, num_warps=4)
    return out


def blocked_draw_reference(e: list[float], target: float, blocks: int = DRAW_BLOCKS, reach: bool = False) -> int:
    """``draw``'s rule for one row, in plain Python floats (IEEE float64, one rounding per add). The row is
    cut into ``blocks`` runs of W = ceil(V / blocks) tokens; T_k = block k's weights added in order from 0.0;
    P_0 = 0, P_{k+1} = P_k + T_k; the token lies in the first block k whose P_{k+1} passes the target, at the
    first i there whose P_k + (block k's weights up to i, added in order from 0.0) passes it. Where no
    block passes (rounding left the target at or past P_blocks), the last token with weight (0 if none).
    Against the CPU's single chain (the twin's rule): the same token except where the target lands
    between two roundings of a boundary. ``reach``: ``first_reaching``'s rule, the same walk with "reaches"
    (>=) for "passes", and V where no block reaches the target."""
    vocab = len(e)

    def crosses(running: float) -> bool:
        return running >= target if reach else running > target

    width = -(-vocab // blocks)
    done = 0.0
    for k in range(blocks):
        total = 0.0
        for i in range(k * width, min((k + 1) * width, vocab)):
            total += e[i]
        if crosses(done + total):
            walked = 0.0
            for i in range(k * width, min((k + 1) * width, vocab)):
                walked += e[i]
                if crosses(done + walked):
                    return i
        done += total
    if reach:
        return vocab
    return max((i for i, w in enumerate(e) if w > 0), default=0)
