"""Part ``prefill``: packed varlen prefill throughput against the device's own bf16 GEMM (issue 30, item 3).

One ``InferExecutor`` in this process (Llama-3-8B shape, bf16, TP1, the engine's defaults: attention
"auto", i.e. the Triton varlen kernel on a GPU), prompts of random ids prefilled two ways: every prompt
in one step (the packed kernel at its widest), and whole prompts packed up to the engine's
``max_num_batched_tokens`` (8192) a step, as the scheduler cuts them. Seconds per run = the sum of its
steps' wall times (synchronised; sampling of each prompt's first token included).

Model FLOPs, counted as the forward computes them: 2 x (the layers' q, k, v, o, gate, up, down weights)
x tokens, plus the LM head on the one row per prompt that is sampled (2 x vocab x hidden), plus causal
attention, 4 x head_dim x q heads x layers x n(n+1)/2 per prompt of n tokens (QK^T and PV over the
lower triangle, the diagonal included). The embedding (a gather), norms and elementwise work are not
counted. The reference is an 8192^3 bf16 matmul timed in the same process (CUDA events).
Goal: >= 65% of the measured GEMM throughput at 8 x 4K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import markdown_table
from gpucheck import executor
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, layer_matmul_params, log, median, time_interleaved, verdict
from pat_engine.tiny_model import TinyModelSpec

GOAL = 0.65
ENGINE_STEP_TOKENS = 8192  # EngineConfig.max_num_batched_tokens's default


@dataclass(frozen=True)
class Flops:
    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def prefill_flops(spec: TinyModelSpec, prompt_lens: list[int]) -> Flops:
    """FLOPs of one prefill of ``prompt_lens`` (see the module docstring for what is counted)."""
    hd = spec.head_dim or spec.hidden_size // spec.num_heads
    tokens = sum(prompt_lens)
    matmul = 2 * layer_matmul_params(spec) * spec.num_layers * tokens
    matmul += 2 * spec.vocab_size * spec.hidden_size * len(prompt_lens)  # the LM head, last row of each prompt
    attention = 4 * hd * spec.num_heads * spec.num_layers * sum(n * (n + 1) // 2 for n in prompt_lens)
    return Flops(float(matmul), float(attention))


def gemm_flops_per_s(device: str, n: int, repeats: int) -> float:
    """bf16 FLOP/s of an n x n x n matmul (2 n^3 FLOPs), median of ``repeats`` calls."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
    secs = median(time_interleaved({"mm": lambda: a @ b}, repeats, 3, device)["mm"])
    return 2 * n**3 / secs


def run(ctx: Ctx) -> PartResult:
    if ctx.smoke:
        shapes, gemm_n, repeats, step_tokens = ((4, 16), (2, 32)), 256, 1, 32
    else:
        shapes, gemm_n, step_tokens = ((64, 512), (8, 4096)), 8192, ENGINE_STEP_TOKENS
        repeats = 2 if ctx.quick else 3
    gemm = gemm_flops_per_s(ctx.device, gemm_n, 10 if not ctx.smoke else 2)
    log(f"GEMM {gemm_n}^3 bf16: {gemm / 1e12:.1f} TFLOP/s")
    most = max(b * n for b, n in shapes)
    ex = executor.build(ctx, executor.blocks_for(most) + max(b for b, _ in shapes))
    rows, headline = [], None
    for batch, n in shapes:
        prompts = executor.random_prompts(batch, n, ctx.spec.vocab_size, batch)
        flops = prefill_flops(ctx.spec, [n] * batch)
        for label, cut in (("one step", None), (f"steps of <= {step_tokens} tokens", step_tokens)):
            runs = []
            for r in range(repeats + 1):  # the first run warms up (Triton compiles, the allocator grows)
                seqs = executor.Sequences(ex, prompts, 1)
                secs = seqs.prefill(cut)
                seqs.release()
                if r:
                    runs.append((sum(secs), len(secs)))
            s = median([t for t, _ in runs])
            rate = flops.total / s
            rows.append([f"{batch} x {n}", label, runs[0][1], s * 1e3, batch * n / s, rate / 1e12, rate / gemm,
                         flops.attention / flops.total])
            if (batch, n) == shapes[-1] and cut is None:
                headline = rate / gemm
        log(f"prefill {batch} x {n} done")
    table = markdown_table(["prompts", "packed as", "steps", "ms (median)", "tokens/s", "model TFLOP/s",
                            "of measured GEMM", "attention share of FLOPs"], rows)
    last = f"{shapes[-1][0]} x {shapes[-1][1]}"
    headlines = ([f"**prefill {last} in one step: {headline:.0%} of the measured bf16 GEMM throughput "
                  f"({gemm / 1e12:.0f} TFLOP/s; target >= {GOAL:.0%}): {verdict(headline >= GOAL)}**"]
                 if not ctx.smoke else ["smoke: goal not judged"])
    setup = (f"Measured bf16 GEMM ({gemm_n}^3, median of 10 calls): **{gemm / 1e12:.1f} TFLOP/s**. Median of "
             f"{repeats} run(s) after one warm-up run per row; model FLOPs as the module docstring counts them "
             f"(2 x the layers' matmul weights x tokens + the LM head per prompt + causal attention).")
    if ctx.smoke:
        setup += " **Smoke:** a toy Llama on the CPU (torch attention); the numbers measure nothing."
    return PartResult("\n\n".join([setup, table]), headlines,
                      {"gemm_flops": gemm, "rows": [dict(zip(("shape", "packed", "steps", "ms", "tokens_s", "tflops",
                                                              "of_gemm", "attn_share"), r)) for r in rows]})
