"""Compile every Triton kernel of ``pat_kernels`` for an H100 (sm_90) on a machine without a GPU, as its
wrapper launches it: run by tests/test_triton_compile.py in a process of its own (Triton's interpreter off).

Triton ships ``ptxas``, so compiling needs no device: a stand-in driver names the target, and each
``JITFunction.run`` compiles (``warmup=True``) instead of launching. Each wrapper is called with small CPU
tensors of the real dtypes, so the kernels are specialised as on the device (unit strides, 16-byte
alignment), with the options the wrapper passes. Outputs are never written (nothing runs). Prints one
JSON line: per compiled kernel its name, shared memory, registers and local memory (spills) per thread
(``cuobjdump``, also shipped with Triton), and counts of PTX instructions the test checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # read when the kernels are decorated: before any import of them
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default today, said out loud
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "csrc")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pat_engine.sampling.inverse_cdf import Z_BLOCK  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"  # ships with Triton


def resource_usage(cubin: bytes) -> dict:
    """Registers and local memory (spills) per thread of a compiled kernel, as ``cuobjdump`` reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    found = dict(re.findall(r"\b(REG|LOCAL):(\d+)", text))
    return {"regs": int(found.get("REG", -1)), "local": int(found.get("LOCAL", -1))}


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks of a driver before it compiles."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def kernel_calls() -> list:
    """Each wrapper call to compile, as a function: split among processes (each compile holds one core)."""
    from pat_kernels import (fused_moe, invariant_matmul, paged_decode_attention, skinny_matmul, triton_activation,
                             triton_norm, triton_rotary, triton_sampler, varlen_prefill)

    bf16, f32 = torch.bfloat16, torch.float32

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape).to(dtype)

    # GEMMs: the skinny GEMM's paths (tl.dot at 16 and 64 rows, split-K and its reduce, the one-row FMA
    # path, float32), the invariant GEMM alone and in chunks
    sk = skinny_matmul
    w = randn(4096, 4096)
    calls = [
        lambda: sk.skinny_matmul(randn(1, 4096), w, config=sk.SkinnyConfig(split_k=1)),
        lambda: sk.skinny_matmul(randn(1, 4096), w, randn(4096), config=sk.SkinnyConfig(split_k=4)),
        lambda: sk.skinny_matmul(randn(64, 4096), w, config=sk.config_for(4096, 4096, 132, 64)),
        lambda: sk.skinny_matmul(randn(1, 4096), w, config=sk.SkinnyConfig(dot=False)),
        lambda: sk.skinny_matmul(randn(8, 4096, dtype=f32), w.float()),
        # the prologues: the norm (with the residual add) at one row both ways and at 8, SiLU-mul at one row
        lambda: sk.skinny_norm_matmul(randn(1, 4096), randn(1, 4096), randn(4096), 1e-5, w,
                                      config=sk.SkinnyConfig(block_n=16, split_k=4, dot=False)),
        lambda: sk.skinny_norm_matmul(randn(1, 4096), randn(1, 4096), randn(4096), 1e-5, w,
                                      config=sk.SkinnyConfig(block_n=64)),
        lambda: sk.skinny_norm_matmul(randn(8, 4096), None, randn(4096), 1e-5, w, config=sk.SkinnyConfig(block_n=16)),
        lambda: sk.skinny_silu_matmul(randn(1, 2 * 14336), randn(4096, 14336), config=sk.SkinnyConfig(block_n=16)),
        lambda: invariant_matmul.invariant_matmul(randn(4, 4096), w),
        lambda: invariant_matmul.invariant_matmul(randn(4, 4096), w, chunks=8),
    ]
    # attention: decode (one split, split with its reduce, split with the reduce fused), varlen prefill
    kv = randn(2, 64, 16, 8, 128)  # (K/V, blocks, page, KV heads, head dim)
    tables = torch.arange(64, dtype=torch.int32).view(4, 16)
    lens = torch.full((4,), 200, dtype=torch.int32)
    calls += [lambda splits=splits, fused=fused: paged_decode_attention.paged_decode_attention(
        randn(4, 32, 128), kv[0], kv[1], tables, lens, 0.088, num_splits=splits, fuse_reduce=fused)
        for splits, fused in ((1, False), (4, False), (4, True))]
    calls.append(lambda: varlen_prefill.varlen_prefill_attention(
        randn(64, 32, 128), kv[0], kv[1], tables, torch.tensor([0, 16, 32, 48, 64], dtype=torch.int32), lens, 0.088,
        max_new_tokens=16))
    # the layer kernels
    cos = sin = randn(8192, 64)
    calls += [
        lambda: triton_norm.add_rms_norm(randn(4, 4096), randn(4, 4096), randn(4096), 1e-5),
        lambda: triton_activation.silu_and_mul(randn(4, 2 * 14336)),
        lambda: triton_rotary.rotary_kv_write(randn(4, 48 * 128), 32, 8, torch.arange(4), cos, sin, kv,
                                              torch.arange(4), randn(128), randn(128)),
    ]

    def moe(tokens: int, dtype: torch.dtype, per_sm: int = fused_moe.PROGRAMS_PER_SM):
        """Qwen3-30B-A3B's layer at TP1: 128 experts of 768, 8 a token; ``per_sm`` 66: an H100's narrow tiles
        (this driver's device is the CPU, which asks for few programs)."""
        experts = torch.stack([torch.randperm(128)[:8].sort().values for _ in range(tokens)])
        table = torch.zeros(128, dtype=torch.int64)  # compiled, never launched: no weight is read
        kept, fused_moe.PROGRAMS_PER_SM = fused_moe.PROGRAMS_PER_SM, per_sm
        try:
            fused_moe.routed_experts(randn(tokens, 2048, dtype=dtype), randn(tokens, 8, dtype=dtype), experts,
                                     table, table, 768)
        finally:
            fused_moe.PROGRAMS_PER_SM = kept

    # blocks of 16 (wide and an H100's narrow tiles), of 32; float32's IEEE dot
    calls += [lambda: moe(4, bf16), lambda: moe(1, bf16, per_sm=66), lambda: moe(512, bf16), lambda: moe(4, f32)]

    def sampler():  # weights, Z, the draw, a top_p nucleus, greedy's first maximum
        e, _ = triton_sampler.weights(randn(4, 128256), torch.ones(4), torch.full((4,), float("-inf")))
        z = triton_sampler.lane_sum(e.float(), Z_BLOCK)
        triton_sampler.lane_sum(randn(2, 151936).float(), Z_BLOCK)  # Qwen's vocabulary: 149 blocks, a wider tile
        triton_sampler.draw(e.float(), torch.rand(4, dtype=torch.float64), z)
        triton_sampler.first_reaching(e.float(), torch.full((4,), 0.9, dtype=torch.float64), z)
        triton_sampler.first_max(randn(4, 128256))

    return calls + [sampler] + [lambda c=c: with_pdl(c) for c in pdl_calls(randn, w, kv, tables, lens, cos)]


def pdl_calls(randn, w, kv, tables, lens, cos) -> list:
    """The decode step's kernels again, launched with programmatic dependent launch (``PAT_PDL=on``): the
    skinny GEMM split (with its reduce) and on the CUDA cores with the norm prologue, the layer kernels, the
    decode attention with its reduce kernel and with the reduce fused, greedy's first maximum."""
    from pat_kernels import (paged_decode_attention, skinny_matmul as sk, triton_activation, triton_norm, triton_rotary,
                             triton_sampler)

    return [
        lambda: sk.skinny_matmul(randn(1, 4096), w, config=sk.SkinnyConfig(split_k=4)),
        lambda: sk.skinny_norm_matmul(randn(1, 4096), randn(1, 4096), randn(4096), 1e-5, w,
                                      config=sk.SkinnyConfig(block_n=16, dot=False)),
        lambda: triton_norm.add_rms_norm(randn(4, 4096), randn(4, 4096), randn(4096), 1e-5),
        lambda: triton_activation.silu_and_mul(randn(4, 2 * 14336)),
        lambda: triton_rotary.rotary_kv_write(randn(4, 48 * 128), 32, 8, torch.arange(4), cos, cos, kv,
                                              torch.arange(4)),
        *[lambda fused=fused: paged_decode_attention.paged_decode_attention(
            randn(4, 32, 128), kv[0], kv[1], tables, lens, 0.088, num_splits=4, fuse_reduce=fused)
          for fused in (False, True)],
        lambda: triton_sampler.first_max(randn(1, 128256)),  # greedy after the LM head
    ]


def with_pdl(call) -> None:
    """``call`` inside ``programmatic_launch``, the device taken as one that launches with PDL (an H100's)."""
    from pat_kernels import dependent_launch

    supports = dependent_launch.device_supports
    dependent_launch.device_supports = lambda device: True
    try:
        with dependent_launch.programmatic_launch(True):
            call()
    finally:
        dependent_launch.device_supports = supports


MEMORY_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)")


def accesses_before_wait(ptx: str) -> int | None:
    """Global loads, stores, async copies and atomics the PTX holds before its ``griddepcontrol.wait`` (None
    without one): under PDL a kernel may touch no memory another kernel writes before it waits."""
    head, found, _ = ptx.partition("griddepcontrol.wait")
    return len(MEMORY_ACCESS.findall(head)) if found else None


def compile_share(share: int, shares: int) -> list[dict]:
    """Compile calls ``share``, ``share + shares``, ... of ``kernel_calls``; a record per compiled kernel."""
    out: list[dict] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]
        out.append({"kernel": self.fn.__name__, "shared": kernel.metadata.shared,
                    "prologue": bool(kwargs.get("NORM") or kwargs.get("SILU")), "partial": bool(kwargs.get("PARTIAL")),
                    "pdl": bool(kwargs.get("PDL")),
                    "launch_pdl": bool(getattr(kernel.metadata, "launch_pdl", False)),
                    "gdc_wait": ptx.count("griddepcontrol.wait"),
                    "gdc_launch": ptx.count("griddepcontrol.launch_dependents"),
                    "prefetch_l2": ptx.count("prefetch.global.L2"), "accesses_before_wait": accesses_before_wait(ptx),
                    "cp_async_16": ptx.count("cp.async.cg.shared.global"),
                    "cp_async_small": ptx.count("cp.async.ca.shared.global"), "fma_f32": ptx.count("fma.rn.f32"),
                    "ld_global": ptx.count("ld.global"), "atomics": ptx.count("atom."),
                    **resource_usage(kernel.asm["cubin"])})
        return kernel

    JITFunction.run = compile_only
    driver.set_active(CompileOnlyDriver())
    for call in kernel_calls()[share::shares]:
        call()
    return out


if __name__ == "__main__":  # argv: [share shares], default the whole list
    share, shares = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (0, 1)
    print(json.dumps(compile_share(share, shares)))
