"""Part ``sampler``: what the RL draw costs on the device, and the Triton sampler kernels beside torch's (issue 30).

Every earlier GPU figure was greedy, but an RL rollout draws at temperature 1 and asks for each token's
log-prob. On CUDA that runs the sampler's torch path (``pat_engine/sampling/inverse_cdf.py``): some thirty
elementwise kernels over the (rows, vocab) logits, a float64 scan for the draw, and Z, the row sum in
blocks of 1,024 tokens of eight float64 lanes each, whose lanes ATen's outer-dimension scan runs one load,
add and store at a time (the Triton kernel walks every block's lanes side by side: a chain of 128 adds, where
the fourth H100 run's whole-row lanes were 16,032 long). ``PAT_TRITON_SAMPLER=on`` computes the weights, Z and the draw with
``pat_kernels/triton_sampler.py`` instead (the same weights and Z; the draw's running sum in blocks, whose
token differs only where u·Z lands between two roundings of a boundary). At 1 and 64 rows (and 256 without
--quick) of random bf16 logits over the Llama-3 vocabulary (128,256), this part times ``sample_on_device``
for a greedy batch (its first maximum by torch's argmax or the Triton kernel), and a greedy, a temperature-1
and a top_p 0.9 batch with log-probs each way (top_p
sorts each row whole on a GPU; its nucleus is the blocked scan's too under the switch), and Z alone both
ways; it checks that both give the same tokens, log-probs and Z. GPU ms between CUDA events with the stream held
busy ahead of each call (the host's launches still show where they outrun the kernels), calls interleaved,
median.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, env_switches, log, median, time_interleaved, verdict
from pat_engine.env import TRITON_SAMPLER


# The fourth H100 run's Triton rows (bench/results/gpu_check.md, part 3), before Z's blocks of 1,024 tokens
# and the draw's 512 blocks: what the headlines set this run's rows beside (rows -> ms).
BEFORE_BLOCKS_MS = {"Z alone": {1: 0.5772, 64: 0.5791}, "RL draw": {1: 0.726, 64: 0.7749}}


def with_switch(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with ``PAT_TRITON_SAMPLER`` on or off (read on every call), the variable restored after."""
    def run():
        with env_switches({TRITON_SAMPLER.name: "on" if on else "off"}):
            return fn()
    return run


def draw_case(rows: int, vocab: int, device: str, repeats: int, warmup: int) -> dict:
    from pat_engine.sampling.inverse_cdf import lane_sum, weights
    from pat_engine.sampling.sampler import SamplingBatch, sample_on_device
    from pat_engine.sampling.spec import SamplingSpec

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen, device=dev) * 3.0).to(torch.bfloat16)
    positions = list(range(100, 100 + rows))

    def batch(temperature: float, logprobs: bool, top_p: float = 1.0) -> SamplingBatch:
        specs = [SamplingSpec(temperature=temperature, top_k=-1, top_p=top_p, seed=7 + i, logprobs=logprobs)
                 for i in range(rows)]
        return SamplingBatch.build(specs, positions, device=dev, vocab=vocab)

    greedy, greedy_lp, drawn, nucleus = batch(0.0, False), batch(0.0, True), batch(1.0, True), batch(1.0, True, 0.9)
    e = weights(logits, torch.ones(rows, device=dev), torch.full((rows,), float("-inf"), device=dev))[0]
    fns = {
        "greedy, torch": with_switch(False, lambda: sample_on_device(logits, greedy).tokens),
        "greedy, Triton": with_switch(True, lambda: sample_on_device(logits, greedy).tokens),
        "greedy + log-probs, torch": with_switch(False, lambda: sample_on_device(logits, greedy_lp)),
        "greedy + log-probs, Triton": with_switch(True, lambda: sample_on_device(logits, greedy_lp)),
        "temperature 1 + log-probs, torch": with_switch(False, lambda: sample_on_device(logits, drawn)),
        "temperature 1 + log-probs, Triton": with_switch(True, lambda: sample_on_device(logits, drawn)),
        "top_p 0.9 + log-probs, torch": with_switch(False, lambda: sample_on_device(logits, nucleus)),
        "top_p 0.9 + log-probs, Triton": with_switch(True, lambda: sample_on_device(logits, nucleus)),
        "Z alone, torch": with_switch(False, lambda: lane_sum(e)),
        "Z alone, Triton": with_switch(True, lambda: lane_sum(e)),
    }
    same = torch.equal(fns["Z alone, torch"](), fns["Z alone, Triton"]())
    same = same and torch.equal(fns["greedy, torch"](), fns["greedy, Triton"]())
    for kind in ("temperature 1", "top_p 0.9"):
        a, b = fns[f"{kind} + log-probs, torch"](), fns[f"{kind} + log-probs, Triton"]()
        same = same and torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    times = {n: median(t) * 1e3 for n, t in time_interleaved(fns, repeats, warmup, dev).items()}
    return {"rows": rows, "vocab": vocab, "ms": times, "same": same}


def _before_blocks(rows: int, draw_ms: float, z_ms: float) -> str:
    """The fourth H100 run's figures at these rows, where it measured them (another device: only a scale)."""
    if rows not in BEFORE_BLOCKS_MS["Z alone"]:
        return ""
    return (f"; the fourth H100 run, before the blocks: RL draw {BEFORE_BLOCKS_MS['RL draw'][rows]:.3f} ms, Z alone "
            f"{BEFORE_BLOCKS_MS['Z alone'][rows]:.3f} ms (now {draw_ms:.3f} and {z_ms:.3f})")


def run(ctx: Ctx) -> PartResult:
    if ctx.smoke:
        rows_list, vocab, repeats, warmup = (1, 4), ctx.spec.vocab_size, 2, 1
    else:
        rows_list, vocab = ((1, 64) if ctx.quick else (1, 64, 256)), ctx.spec.vocab_size
        repeats, warmup = (10 if ctx.quick else 20), 3
    cases = []
    for rows in rows_list:
        c = draw_case(rows, vocab, ctx.device, repeats, warmup)
        cases.append(c)
        log(f"sampler {rows} x {vocab}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in c["ms"].items()))
    names = list(cases[0]["ms"])
    table = markdown_table(["rows", "vocab"] + [f"{n} ms" for n in names] + ["same tokens, log-probs, Z"],
                           [[c["rows"], c["vocab"], *[c["ms"][n] for n in names], c["same"]] for c in cases])
    headlines = []
    for c in cases:
        ms = c["ms"]
        torch_ms, triton_ms = ms["temperature 1 + log-probs, torch"], ms["temperature 1 + log-probs, Triton"]
        headlines.append(
            f"RL draw at {c['rows']} x {c['vocab']} (temperature 1, log-probs): {torch_ms:.3f} ms through the "
            f"torch twin, {triton_ms:.3f} ms through the Triton kernels (Z alone "
            f"{ms['Z alone, torch']:.3f} vs {ms['Z alone, Triton']:.3f}; top_p 0.9 "
            f"{ms['top_p 0.9 + log-probs, torch']:.3f} vs {ms['top_p 0.9 + log-probs, Triton']:.3f}); "
            f"greedy {ms['greedy, torch']:.3f} vs {ms['greedy, Triton']:.3f} ms; "
            f"same bits: {verdict(c['same'])}" + _before_blocks(c['rows'], triton_ms, ms['Z alone, Triton']))
    if ctx.smoke:
        headlines = ["smoke: not judged"] + [f"same bits at {c['rows']} rows: {verdict(c['same'])}" for c in cases]
    setup = (f"bf16 logits (standard normal x 3), {'the toy' if ctx.smoke else 'the Llama-3'} vocabulary, every row "
             f"seeded; `sample_on_device` as a decode step calls it (the draw, its log-prob, nothing read back). "
             f"{repeats} calls of each after {warmup} warm-ups, interleaved, median GPU ms between events "
             f"(`time_interleaved`).")
    if ctx.smoke:
        setup = "**Smoke:** on the CPU under TRITON_INTERPRET=1 (the C++ sampler serves CPU rows: the torch path " \
                "runs only where it does not). Times measure nothing. " + setup
    return PartResult("\n\n".join([setup, table]), headlines, {"cases": cases})
