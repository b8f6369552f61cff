"""Part ``decode``: TP1 decode ms per step through the real ``Engine`` beside the HBM roofline and the
streamed-bytes floor (issues 23 and 30).

Llama-3-8B-shaped random bf16 checkpoint (16.06 GB), requests of fixed length (min = max new tokens,
ignore_eos, greedy), prefix caching off. Rows: batch 1, 16 and 64 at a 64-token prompt, with CUDA graphs
and with ``enforce_eager`` (both engines up at once, their runs interleaved), and 64 x 512 and 64 x 2K
prompts with graphs, and 64 x 512 again as an RL rollout samples it (temperature 1, each token's
log-prob, a seed: the sampler's own cost beside the greedy row; judged by no target); each graphs row also with ``async_scheduling`` on (the same engine, the switch flipped
between runs: each decode step sent before the one in flight is answered, docs/async_scheduling.md).
ms / step: the median decode step of the driver (dispatch to result, the worker round trip included; with
async scheduling, from the previous step's answer to this one's); at batch B a step gives each sequence
one token, so it is the ms per token.

The batch-1 row runs a third way too: on an engine built with ``CANDIDATE``, the settings the kernels part
times as variants but the engine does not default to yet (every layer's GEMM through the skinny GEMM with
its tuned configs, the norms and SiLU-mul in its prologues, the attention's reduce fused, the step's Triton
kernels launched with PDL where the device can), with graphs and with async scheduling, interleaved with
the default engine: what they give the 6.0 ms goal through the real engine, in the same run that measures
the defaults. No GPU has run those settings yet, so a failure of that engine costs its rows only
(``Candidate``): the report names it and keeps the default rows.

Floors: the roofline is every weight byte over the bandwidth (issue 23's 6.0 ms = 1.25x that at the
H100 SXM datasheet's 3.35 TB/s); the floor of a shape is what a step must stream, the weights less the
embedding table (gathered by row) plus the batch's KV at its mean context, over the measured
device-to-device copy bandwidth. Targets (issue 30): batch 1 <= 6.0 ms / token on an H100; every
graphs row within 1.3x of its floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import (Ctx, datasheet_bandwidth, env_switches, kv_bytes_per_token, log,
                             measure_copy_bandwidth, median, roofline_ms, verdict, weight_bytes)
from pat_engine.env import DECODE_REDUCE, GEMM_PROLOGUE, PDL, SKINNY_GEMM, SKINNY_MOST_ROWS

BATCH1_MS_GOAL = 6.0  # issue 30, on an H100 (1.25x the SXM datasheet roofline)
FLOOR_GOAL = 1.3
CANDIDATE = {SKINNY_GEMM.name: str(SKINNY_MOST_ROWS), GEMM_PROLOGUE.name: "fused", DECODE_REDUCE.name: "fused",
             PDL.name: "on"}  # PDL: sm_90 with a Triton that has it, else plain launches (dependent_launch.py)
CANDIDATE_MODES = ("candidate", "candidate async")  # the batch-1 row on the candidate engine, async off / on


@dataclass(frozen=True)
class Shape:
    batch: int
    prompt: int
    new_tokens: int
    eager: bool  # also run on the enforce_eager engine
    sampled: bool = False  # temperature 1 with log-probs (the RL rollout's draw); else greedy

    @property
    def mean_context(self) -> float:
        return self.prompt + self.new_tokens / 2

    @property
    def name(self) -> str:
        return f"{self.batch} x {self.prompt}{' sampled' if self.sampled else ''}"


def shapes(ctx: Ctx) -> tuple[Shape, ...]:
    if ctx.smoke:
        return Shape(1, 8, 4, True), Shape(2, 8, 4, True), Shape(2, 32, 4, False), Shape(2, 32, 4, False, True)
    new = ctx.args.new_tokens
    if ctx.quick:  # one engine: no eager rows (the kernels part times eager steps in process)
        return (Shape(1, 64, new or 64, False), Shape(64, 64, new or 64, False), Shape(64, 512, new or 32, False),
                Shape(64, 2048, new or 32, False), Shape(64, 512, new or 32, False, sampled=True))
    return (Shape(1, 64, new or 128, True), Shape(16, 64, new or 128, True), Shape(64, 64, new or 128, True),
            Shape(64, 512, new or 64, False), Shape(64, 2048, new or 64, False),
            Shape(64, 512, new or 64, False, sampled=True))


def batch1(todo: tuple[Shape, ...]) -> Shape:
    """The greedy batch-1 row: the 6.0 ms goal's, and the one the candidate engine runs."""
    return next(s for s in todo if s.batch == 1 and not s.sampled)


def candidate_settings(ctx: Ctx) -> dict[str, str]:
    return {k: v for k, v in CANDIDATE.items() if not (ctx.smoke and k == SKINNY_GEMM.name)}


def floor_ms(ctx: Ctx, s: Shape, bandwidth: float) -> float:
    """(weights less the embedding table + the batch's KV at its mean context) / bandwidth."""
    spec = ctx.spec
    streamed = weight_bytes(spec, 2) - spec.vocab_size * spec.hidden_size * 2
    return roofline_ms(streamed + s.batch * s.mean_context * kv_bytes_per_token(spec, 2), bandwidth)


def _run(engine, s: Shape, new_tokens: int, seed: int, vocab: int, async_on: bool = False) -> dict[str, list[float]]:
    from pat_engine import SamplingParams

    engine.coordinator.stepping.set_async_scheduling(async_on)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, min(vocab, 30000), (s.batch, s.prompt), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True,
                            temperature=1.0 if s.sampled else 0.0, logprobs=s.sampled, seed=seed if s.sampled else None)
    with engine.record_steps() as steps:
        outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == new_tokens for o in outs), "a request did not run to its fixed length"
    dec = [r for r in steps if not r.is_prefill and r.batch_size == s.batch]  # steps of the whole batch
    return {"step_s": [r.seconds for r in dec], "forward_s": [r.forward_seconds for r in dec],
            "tokens": [o.token_ids for o in outs]}


def run(ctx: Ctx) -> PartResult:
    spec, todo = ctx.spec, shapes(ctx)
    rounds = ctx.args.rounds or (1 if ctx.smoke or ctx.quick else 3)
    bw = measure_copy_bandwidth(ctx.device, (64 << 20) if ctx.smoke else (1 << 30))
    sheet = datasheet_bandwidth(ctx.gpu_name)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s; datasheet {sheet[1] if sheet else 'n/a'}")
    modes = ["graphs"] + (["eager"] if any(s.eager for s in todo) else [])
    b1 = batch1(todo)
    engines = {}
    try:
        for mode in modes:  # each sized for its own rows: the long rows' KV only where they run
            mine = [s for s in todo if mode == "graphs" or s.eager]
            engines[mode] = ctx.start_engine(
                eager=mode == "eager", max_batch=max(s.batch for s in mine),
                max_len=max(s.prompt + s.new_tokens for s in mine) + 16,
                kv_tokens=max(s.batch * (s.prompt + s.new_tokens + 16) for s in mine))
        # read as its layers and attention are built; the smoke leaves out the skinny GEMM, which the CPU
        # runs through Triton's interpreter at a second a step
        candidate = Candidate(engines)
        candidate.attempt(lambda: ctx.start_engine(eager=False, max_batch=1, max_len=b1.prompt + b1.new_tokens + 16,
                                                   kv_tokens=b1.prompt + b1.new_tokens + 16), candidate_settings(ctx))
        runs = ["graphs", "async"] + (["eager"] if "eager" in modes else [])  # "async": the graphs engine, flipped

        def order_of(s: Shape) -> list[str]:
            return (runs if s.eager else runs[:2]) + (list(CANDIDATE_MODES) if s is b1 else [])

        def run_mode(mode: str, s: Shape, new_tokens: int, seed: int) -> dict | None:
            if mode not in CANDIDATE_MODES:
                return _run(engines.get(mode, engines["graphs"]), s, new_tokens, seed, spec.vocab_size,
                            mode == "async")
            return candidate.attempt(lambda: _run(engines["candidate"], s, new_tokens, seed, spec.vocab_size,
                                                  mode.endswith("async")))

        for s in todo:  # warm-up: every shape once (lazy allocations, Triton JIT, the allocator)
            for mode in order_of(s):
                run_mode(mode, s, min(8, s.new_tokens), 99)
        got: dict[tuple[str, Shape], dict[str, list[float]]] = {}
        for r in range(rounds):
            for s in todo:
                order = order_of(s)
                for mode in (order if r % 2 == 0 else order[::-1]):
                    res = run_mode(mode, s, s.new_tokens, r * 1000 + s.batch + s.prompt)
                    if res is None:  # the candidate engine failed: its rows are left out, named in the report
                        continue
                    acc = got.setdefault((mode, s), {"step_s": [], "forward_s": [], "tokens": []})
                    acc["step_s"] += res["step_s"]
                    acc["forward_s"] += res["forward_s"]
                    acc["tokens"].append(res["tokens"])  # one entry per round, the same prompts in every mode
            log(f"decode round {r + 1}/{rounds} done")
        stats = {mode: engines[mode].worker_stats()[0]["graphs"] for mode in modes}
    finally:
        for engine in engines.values():
            engine.shutdown()
    if candidate.error:  # a partial record of a failed engine says nothing: its rows go
        got = {key: v for key, v in got.items() if key[0] not in CANDIDATE_MODES}
    return _report(ctx, todo, got, stats, bw, sheet, rounds, candidate.error)


class Candidate:
    """The candidate engine's runs, whose failure costs its own rows only: the candidate settings are what no
    GPU has run yet (a launch the device's software refuses, say), and the default rows beside them are the
    part's headline."""

    def __init__(self, engines: dict):
        self.engines, self.error = engines, None

    def attempt(self, call, settings: dict[str, str] | None = None):
        """``call()``'s result (under ``settings``, the engine's start), or None once the candidate failed;
        on the first failure the error is kept and the engine shut down."""
        if self.error is not None:
            return None
        try:
            if settings is None:
                return call()
            with env_switches(settings):
                self.engines["candidate"] = call()
            return self.engines["candidate"]
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:400]
            log(f"decode: the candidate engine failed, its rows are left out: {self.error}")
            engine = self.engines.pop("candidate", None)
            if engine is not None:
                try:
                    engine.shutdown()
                except Exception as down:  # noqa: BLE001  the error above is the one to report
                    log(f"decode: shutting the failed candidate engine down: {down}")
            return None


def _report(ctx: Ctx, todo, got, stats, bw: float, sheet, rounds: int, candidate_error: str | None = None
            ) -> PartResult:
    spec = ctx.spec
    wbytes = weight_bytes(spec, 2)
    rows, data, async_data, sampled_data, misses = [], [], [], [], []
    for s in todo:
        fl = floor_ms(ctx, s, bw)
        for mode in [m for m in ("graphs", "async", "eager", *CANDIDATE_MODES) if (m, s) in got]:
            a = got[(mode, s)]
            step = median(a["step_s"]) * 1e3
            rows.append([s.batch, s.prompt, "temperature 1 + log-probs" if s.sampled else "greedy", mode,
                         len(a["step_s"]), step, median(a["forward_s"]) * 1e3, s.batch / step * 1e3, fl, step / fl,
                         roofline_ms(wbytes, sheet[0]) if sheet else "n/a",
                         step / roofline_ms(wbytes, sheet[0]) if sheet else "n/a"])
            if mode in ("graphs", "async"):  # "rows": the synchronous greedy steps pat-profile's table predicts
                row = {"batch": s.batch, "prompt": s.prompt, "new_tokens": s.new_tokens, "step_ms": step,
                       "forward_ms": median(a["forward_s"]) * 1e3, "mean_context": s.mean_context, "floor_ms": fl}
                (sampled_data if s.sampled else data if mode == "graphs" else async_data).append(row | {"mode": mode})
        best = min(median(got[(m, s)]["step_s"]) * 1e3 for m in ("graphs", "async"))
        if best > FLOOR_GOAL * fl and not s.sampled:
            misses.append(f"{s.name} ({best / fl:.2f}x)")
    table = markdown_table(
        ["batch", "prompt", "draw", "mode", "steps", "ms / step (driver)", "ms / step (worker forward)", "tok/s",
         "floor ms (streamed weights + KV / measured BW)", "x floor", "roofline ms (all weights / datasheet)",
         "x datasheet roofline"], rows)
    # fixed-length requests: async scheduling runs the synchronous batches, so even "fast" numerics match
    differ = [s.name for s in todo if got[("async", s)]["tokens"] != got[("graphs", s)]["tokens"]]
    same_tokens = (f"**async scheduling's tokens equal the synchronous run's at every row: {verdict(not differ)}**"
                   + (f" (differ: {', '.join(differ)})" if differ else ""))
    b1_sync = next(d for d in data if d["batch"] == 1)["step_ms"]
    b1_async = next(d for d in async_data if d["batch"] == 1)["step_ms"]
    b1, b1_mode = min((b1_sync, "graphs"), (b1_async, "graphs + async scheduling"))
    b1_shape = batch1(todo)
    ran = candidate_error is None
    cand = {m: median(got[(m, b1_shape)]["step_s"]) * 1e3 for m in CANDIDATE_MODES} if ran else {}
    cand_same = ran and got[(CANDIDATE_MODES[0], b1_shape)]["tokens"] == got[("graphs", b1_shape)]["tokens"]
    settings = " ".join(f"{k}={v}" for k, v in candidate_settings(ctx).items())
    if ctx.smoke:
        headlines = ["smoke: goals not judged", same_tokens]
    else:
        on_h100 = bool(ctx.gpu_name) and "H100" in ctx.gpu_name
        goal_ms = BATCH1_MS_GOAL if on_h100 else 1.25 * roofline_ms(wbytes, sheet[0] if sheet else bw)
        if ran:
            candidate_line = (f"batch 1 on an engine built with `{settings}` (not the defaults): graphs "
                              f"{cand['candidate']:.2f} ms, graphs + async scheduling {cand['candidate async']:.2f} "
                              f"ms / token (target <= {goal_ms:.2f} ms: {verdict(min(cand.values()) <= goal_ms)} with "
                              f"them); greedy tokens equal to the default engine's: "
                              f"{'yes' if cand_same else 'no (another GEMM order in bf16)'}")
        else:
            candidate_line = f"batch 1 on an engine built with `{settings}`: FAILED, its rows left out ({candidate_error})"
        headlines = [f"**batch 1 with {b1_mode}: {b1:.2f} ms / token (target <= {goal_ms:.2f} ms"
                     f"{'' if on_h100 else ', 1.25x this device roofline'}): {verdict(b1 <= goal_ms)}** "
                     f"(graphs {b1_sync:.2f} ms, graphs + async scheduling {b1_async:.2f} ms)",
                     candidate_line, same_tokens,
                     f"**every decode row within {FLOOR_GOAL}x of its floor (graphs, with or without async "
                     f"scheduling): "
                     f"{verdict(not misses)}{' (' + ', '.join(misses) + ')' if misses else ''}**"]
        headlines += [_sampling_line(s, got) for s in todo if s.sampled]
    g = stats["graphs"]
    lines = [
        f"Model: {'a toy Llama' if ctx.smoke else 'Llama-3-8B shape'} (hidden {spec.hidden_size}, {spec.num_layers} "
        f"layers, {spec.num_heads} / {spec.num_kv_heads} heads, intermediate {spec.intermediate_size}, vocab "
        f"{spec.vocab_size}), random bf16, {wbytes / 1e9:.2f} GB of weights. Engines: tp=1, device={ctx.device}, "
        f"prefix caching off, each sized for its rows; {rounds} round(s) after a warm-up run of every row, "
        f"graphs, async (the graphs engine with async_scheduling on) and eager in turn (the order swapped every "
        f"round). Steps counted: decode steps of the whole batch. The batch-1 row also on an engine built with "
        f"`{settings}` (modes `candidate` and `candidate async`)"
        + (f"; that engine FAILED and its rows are left out: `{candidate_error}`." if candidate_error else "."),
        "",
        f"Bandwidth: measured device-to-device copy {bw / 1e9:.0f} GB/s (2 x bytes / time); datasheet: "
        f"{sheet[1] if sheet else 'n/a'}. Floor: (weights less the embedding table + KV at the mean context "
        f"prompt + new/2) / measured bandwidth.",
        "",
        table,
        "",
        f"Graphs engine: captured {g.get('captured')} in {g.get('capture_s', 0):.2f} s "
        f"({g.get('capture_s_per_size', 0) * 1e3:.0f} ms per size); replays {g.get('replays')}, eager decodes "
        f"{g.get('eager_decodes')}."
        + (f" Eager engine: {stats['eager'].get('captures')} captures, {stats['eager'].get('replays')} replays."
           if "eager" in stats else " No eager engine in this run (--quick): the kernels part times eager steps "
           "in process at batch 1 and 64."),
    ]
    if ctx.smoke:
        lines.append("\n**Smoke:** graph_backend \"standin\" (eager replays) on the CPU; no datasheet bandwidth.")
    return PartResult("\n".join(lines), headlines, {"rows": data, "async_rows": async_data,
                                                    "sampled_rows": sampled_data, "copy_bandwidth": bw,
                                                    "candidate": {"settings": candidate_settings(ctx), **cand,
                                                                  "same_tokens": cand_same,
                                                                  "error": candidate_error}})


def _sampling_line(s: Shape, got) -> str:
    """The sampled row beside the greedy row of its shape: what temperature-1 draws with log-probs cost."""
    ms = {m: median(got[(m, s)]["step_s"]) * 1e3 for m in ("graphs", "async")}
    greedy = next((g for g in got if g[0] == "graphs" and not g[1].sampled and (g[1].batch, g[1].prompt) ==
                   (s.batch, s.prompt)), None)
    beside = ""
    if greedy is not None:
        g = median(got[greedy]["step_s"]) * 1e3
        beside = f"; greedy {g:.2f} ms: the draw and its log-probs add {ms['graphs'] - g:+.2f} ms a step"
    return (f"RL sampling ({s.name}: temperature 1, log-probs): {ms['graphs']:.2f} ms / step with graphs, "
            f"{ms['async']:.2f} with async scheduling{beside}")
