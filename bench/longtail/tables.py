"""Latency tables for deployments we cannot measure here. Every constant is stated; none is a measurement.

Both model LLaMA3.1-8B in bf16 on 8 GPUs (KV: 2 * 32 layers * 8 heads * 128 * 2 B
= 128 KiB per token, split over TP ranks; weights 16.06 GB).

**8xA40, paper-calibrated** (TP 2/4/8; no TP1: Fig. 4 gives no TP1 point).
Fig. 4's per-token decode latencies: global batch 1: TP2 15.37 ms, TP8 9.64 ms;
global batch 128: TP2 24.41 ms (32 per DP group), TP8 30.87 ms (128 in one group).
Per group step latency:

    step(tp, b, C) = a_tp + s_tp * (b - 1) + g_tp * (C - b * C_REF)

a, s from the two points (linear in the per-group batch between and beyond
them); TP4 takes the geometric mean of TP2 and TP8 for a and s (log-linear in
tp). The context term is KV reading at 70% of the A40's 696 GB/s:
g_tp = (128 KiB / tp) / (0.7 * 696e9); C_REF = 1024 tokens per request is our
assumption for the context at which Fig. 4 was measured (not stated).
Switch: Sec. 5.4's TP2->TP8 case (9 requests at 12K context) took 5.52 s, of
which KV migration 2.36 s and weights 1.03 s. The bandwidth makes Eq. 1 give
2.36 s for that case (3.07 GB/s per rank); weights use our planner's
busiest-sender bytes over it; the fixed cost (5.52 - 2.36 - weights) makes
the modelled total of that case 5.52 s. Prefill: 2 * 8e9 FLOP per token plus
attention (4 * layers * hidden * l^2 per request) at 50% of 149.7 TFLOP/s per GPU.

**8xH100 SXM, analytic** (TP 1/2/4/8), two variants:

  roofline+NCCL: max(memory, compute) + collectives + 1 ms fixed per step, with
    memory = (16.06 GB + C * 128 KiB) / tp / (0.8 * 3.35 TB/s), compute = 2 * 8e9 * b / tp /
    (0.5 * 989 TFLOP/s), 65 all-reduces (2 per layer + embedding) of b * 4096 * 2 B, each
    10 us + 2(tp-1)/tp * bytes / 350 GB/s.
  +batch overheads: the above plus costs that grow with the per-replica batch (what only
    measured tables capture): 20 us of scheduling/sampling per request per step, and 5 ms
    per step when the replica's batch exceeds 160 (CUDA-graph capture limit, eager launch).

  Switch: 150 GB/s per rank (NVLink point-to-point, all ranks sending), fixed 1.0 s
  (graph recapture 0.5 s + rebuild 0.5 s). Prefill at 50% of 989 TFLOP/s.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from longtail.analytic import analytic_table, synthetic_deployment
from pat_engine.model.arch import arch_from_hf_config
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.deployment import reshard_bytes
from pat_engine.predictor.table import ModelShape, ProfileTable, SwitchCost

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
}
SHAPE = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, elt_bytes=2, weight_bytes=16_060_522_496)
KV_TOKEN = 2 * 32 * 8 * 128 * 2  # bytes per token, all ranks together
PARAMS = 8.03e9
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 24576)


@lru_cache(maxsize=None)
def weight_bytes(from_tp: int, to_tp: int) -> int:
    arch = arch_from_hf_config(LLAMA31_8B)
    return reshard_bytes(arch, torch.bfloat16, Layout.for_world(8, from_tp), Layout.for_world(8, to_tp))


def _prefill(peak_flops: float, eff: float):
    def prefill(tp: int, n: int, l: float) -> float:
        flops = n * (2 * PARAMS * l + 4 * 32 * 4096 * l * l)
        return flops / (tp * peak_flops * eff)

    return prefill


# ---- 8xA40, calibrated to Fig. 4 and Sec. 5.4 ------------------------------------------------------------

A40_FIG4 = {2: (15.37e-3, 24.41e-3, 32), 8: (9.64e-3, 30.87e-3, 128)}  # tp: (batch-1 s, batch-128 s, per group)
A40_C_REF = 1024
A40_HBM = 696e9 * 0.7


def a40_coefficients() -> dict[int, tuple[float, float]]:
    coef = {tp: (lo, (hi - lo) / (b - 1)) for tp, (lo, hi, b) in A40_FIG4.items()}
    (a2, s2), (a8, s8) = coef[2], coef[8]
    coef[4] = (math.sqrt(a2 * a8), math.sqrt(s2 * s8))  # halfway in log2(tp)
    return coef


def a40_table() -> ProfileTable:
    coef = a40_coefficients()

    def step(tp: int, b: int, total: float) -> float:
        a, s = coef[tp]
        g = KV_TOKEN / tp / A40_HBM
        return max(a + s * (b - 1) + g * (total - b * A40_C_REF), 0.5 * a)

    # Sec. 5.4 reference switch: TP2 -> TP8, 9 unfinished requests at 12K context
    v_send = 9 * 12288 * SHAPE.kv_bytes_per_token_per_rank(2)  # Eq. 1 on the busiest TP2 rank
    bandwidth = v_send / 2.36
    fixed = 5.52 - 2.36 - weight_bytes(2, 8) / bandwidth
    tps = (2, 4, 8)
    costs = [SwitchCost(a, b, fixed, weight_bytes(a, b)) for a in tps for b in tps if a != b]
    dep = synthetic_deployment(8, tps, "Llama-3.1-8B", "cuda: 8x NVIDIA A40 (paper-calibrated)")
    return analytic_table(dep, SHAPE, step, _prefill(149.7e12, 0.5), BATCHES, CONTEXTS, bandwidth, costs,
                          "paper-calibrated (Fig. 4, Sec. 5.4); see bench/longtail/tables.py",
                          fig4_check={f"TP{tp}": [round(step(tp, 1, A40_C_REF) * 1e3, 2),
                                                  round(step(tp, b, b * A40_C_REF) * 1e3, 2)]
                                      for tp, (_, _, b) in A40_FIG4.items()})


# ---- 8xH100, analytic ---------------------------------------------------------------------------------------

H100_BW = 0.8 * 3.35e12
H100_FLOPS = 0.5 * 989e12
NVLINK_BUS = 350e9
ALLREDUCE_LAT = 10e-6
STEP_FIXED = 1e-3
PER_REQUEST = 20e-6
GRAPH_MAX_BS = 160
EAGER_PENALTY = 5e-3


def h100_step(with_batch_overheads: bool):
    def step(tp: int, b: int, total: float) -> float:
        memory = (SHAPE.weight_bytes + total * KV_TOKEN) / tp / H100_BW
        compute = 2 * PARAMS * b / tp / H100_FLOPS
        comm = 0.0
        if tp > 1:
            nbytes = b * 4096 * 2
            comm = 65 * (ALLREDUCE_LAT + 2 * (tp - 1) / tp * nbytes / NVLINK_BUS)
        out = max(memory, compute) + comm + STEP_FIXED
        if with_batch_overheads:
            out += PER_REQUEST * b + (EAGER_PENALTY if b > GRAPH_MAX_BS else 0.0)
        return out

    return step


def h100_table(with_batch_overheads: bool) -> ProfileTable:
    tps = (1, 2, 4, 8)
    bandwidth = 150e9
    costs = [SwitchCost(a, b, 1.0, weight_bytes(a, b)) for a in tps for b in tps if a != b]
    label = "+batch overheads" if with_batch_overheads else "roofline+NCCL"
    dep = synthetic_deployment(8, tps, "Llama-3.1-8B", f"cuda: 8x NVIDIA H100 SXM (analytic, {label})")
    return analytic_table(dep, SHAPE, h100_step(with_batch_overheads), _prefill(989e12, 0.5), BATCHES, CONTEXTS,
                          bandwidth, costs, f"analytic ({label}); see bench/longtail/tables.py")
