"""Every Triton kernel compiles for an H100 (sm_90) on this GPU-less machine, as its wrapper launches it.

The interpreter tests run each kernel's Python in numpy; what only the compiler sees (a loop-carried
value whose type changes, an unsupported op, a layout the target refuses) would first show on a lent
GPU. ``triton_sm90_compile.py`` compiles them all through Triton's own ``ptxas`` in a process of its own,
and reports what the PTX holds, so the kernels' promises that live in the generated code are checked
here: the kernels that round every operation on its own (norm, SiLU-mul, rotary, the sampler's weights)
carry no fused multiply-add, nor do the skinny GEMM's prologues that compute two of them; the skinny
GEMM's tl.dot path streams its weight through 16-byte asynchronous copies (a software pipeline); the sampler's Z walk loads its next steps asynchronously
while its chains of adds run. The decode step's kernels compiled again with programmatic dependent launch
(``PAT_PDL=on``, pat_kernels/dependent_launch.py) wait for the kernel ahead before anything else, launch
with the attribute, and only the GEMM asks L2 for weights before that wait; without it no kernel waits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triton_markers import needs_triton

SCRIPT = Path(__file__).with_name("triton_sm90_compile.py")
KERNELS = {"_skinny_matmul_kernel", "_skinny_reduce_kernel", "_matmul_kernel", "_decode_partial_kernel",
           "_decode_reduce_kernel", "_varlen_prefill_kernel", "_rms_norm_kernel", "_silu_mul_kernel",
           "_rotary_kv_kernel", "_chunk_max_kernel", "_weights_kernel", "_lane_sum_kernel", "_draw_kernel",
           "_chunk_first_max_kernel", "_pick_first_max_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"}
ROUND_EACH_OP = {"_rms_norm_kernel", "_silu_mul_kernel", "_rotary_kv_kernel", "_weights_kernel", "_combine_kernel"}
PDL_KERNELS = {"_skinny_matmul_kernel", "_skinny_reduce_kernel", "_decode_partial_kernel", "_decode_reduce_kernel",
               "_rms_norm_kernel", "_silu_mul_kernel", "_rotary_kv_kernel", "_chunk_first_max_kernel",
               "_pick_first_max_kernel"}


SHARES = 2  # processes compiling at once: one a core of CI's two


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(k), str(SHARES)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(SHARES)]
    records = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        records += json.loads(out.strip().splitlines()[-1])
    return records


@pytest.fixture(scope="module")
def plain(compiled) -> list[dict]:
    """The kernels as launched without PDL (the tests below that count kernels count these)."""
    return [r for r in compiled if not r["pdl"]]


@pytest.mark.slow
@needs_triton
def test_every_kernel_compiles_for_sm90(compiled):
    assert {r["kernel"] for r in compiled} == KERNELS


@pytest.mark.slow
@needs_triton
def test_the_blocked_scan_compiles_for_the_draw_and_for_the_nucleus(plain):
    assert sum(r["kernel"] == "_draw_kernel" for r in plain) == 2  # REACH off (the draw) and on (top_p)


@pytest.mark.slow
@needs_triton
def test_the_fused_decode_reduce_counts_its_splits_with_an_atomic(plain):
    partials = [r for r in plain if r["kernel"] == "_decode_partial_kernel"]
    assert len(partials) == 3 and sorted(r["atomics"] > 0 for r in partials) == [False, False, True]


H100_SHARED_PER_BLOCK = 232448  # bytes a block may opt into on sm_90 (227 KiB)


@pytest.mark.slow
@needs_triton
def test_every_kernel_fits_an_h100s_shared_memory(compiled):
    """Triton checks this only when it loads a kernel on the device (OutOfResources at the first launch)."""
    for r in compiled:
        assert 0 <= r["shared"] <= H100_SHARED_PER_BLOCK, r


@pytest.mark.slow
@needs_triton
def test_no_kernel_spills_registers(compiled):
    for r in compiled:
        assert r["regs"] > 0 and r["local"] == 0, r


@pytest.mark.slow
@needs_triton
def test_kernels_that_round_each_operation_carry_no_fma(compiled):
    for r in compiled:
        if r["kernel"] in ROUND_EACH_OP:
            assert r["fma_f32"] == 0, r


@pytest.mark.slow
@needs_triton
def test_the_skinny_gemms_prologues_round_each_operation_and_keep_the_pipeline(plain):
    """The norm and SiLU-mul computed in the GEMM's prologue carry no FMA, as their own kernels; with tl.dot the
    weight still streams through 16-byte asynchronous copies."""
    prologues = [r for r in plain if r["kernel"] == "_skinny_matmul_kernel" and r["prologue"]]
    assert len(prologues) == 4 and all(r["fma_f32"] == 0 for r in prologues), prologues
    assert sum(r["cp_async_16"] > 0 for r in prologues) == 3  # the three tl.dot configs (one is the CUDA-core path)


@pytest.mark.slow
@needs_triton
def test_the_skinny_gemm_streams_its_weight_through_a_pipeline(compiled):
    dot_paths = [r for r in compiled if r["kernel"] == "_skinny_matmul_kernel" and r["ld_global"] == 0]
    assert len(dot_paths) >= 3 and all(r["cp_async_16"] > 0 for r in dot_paths)
    from pat_kernels.triton_sampler import UNROLL

    lane = next(r for r in compiled if r["kernel"] == "_lane_sum_kernel")
    assert lane["cp_async_16"] + lane["cp_async_small"] >= UNROLL  # Z's walk: the next steps' loads fly during the adds
    assert lane["ld_global"] <= 128  # the rest: the fold's reads of the blocks' totals (128256 tokens: 126 blocks)


@pytest.mark.slow
@needs_triton
def test_with_pdl_every_step_kernel_waits_for_the_one_ahead_and_only_the_gemm_prefetches(compiled):
    """Each decode-step kernel launched with PDL carries the wait (before its first read of another kernel's
    output: the kernels call it first) and the early release of the next, and launches with the attribute;
    only the skinny GEMM asks L2 for its weight first. Launched plainly, no kernel waits or prefetches (a wait
    there would be harmless, but the flag must reach the compiler only when asked)."""
    with_pdl = [r for r in compiled if r["pdl"]]
    assert {r["kernel"] for r in with_pdl} == PDL_KERNELS
    for r in with_pdl:
        assert r["launch_pdl"] and r["gdc_wait"] == 1 and r["gdc_launch"] == 1, r
        assert r["accesses_before_wait"] == 0, r  # only the prefetch (no value, never stale) comes first
        assert (r["prefetch_l2"] > 0) == (r["kernel"] == "_skinny_matmul_kernel"), r
    for r in compiled:
        if not r["pdl"]:
            assert not r["launch_pdl"] and r["gdc_wait"] == r["gdc_launch"] == r["prefetch_l2"] == 0, r


@pytest.mark.slow
@needs_triton
def test_pdl_leaves_the_skinny_gemms_pipeline_and_registers_as_they_were(compiled):
    """The same config with and without PDL: the weight streams through the same asynchronous copies, in the
    same registers and shared memory (the prefetch holds no value)."""
    def one_row_split(pdl):  # SkinnyConfig(split_k=4) at one row, as triton_sm90_compile.py launches it
        return [r for r in compiled if r["kernel"] == "_skinny_matmul_kernel" and r["pdl"] == pdl
                and not r["prologue"] and r["partial"] and r["shared"] == 73728][0]

    with_pdl, without = one_row_split(True), one_row_split(False)
    for key in ("cp_async_16", "regs", "shared", "local"):
        assert with_pdl[key] == without[key], (key, with_pdl, without)
