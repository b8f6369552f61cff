"""Decode throughput: pat-engine (TP1, one worker) vs transformers ``generate`` on the same checkpoint.

Both run on the CPU with the same thread count, greedy, same prompts, EOS ignored.
Two cases per batch size: equal lengths (every request decodes ``--new-tokens``),
and long-tail lengths (requests stop at different lengths, as in RL rollouts).
Reported: useful output tokens/s of each and their ratio, measured side by side
in one run (best of ``--repeats``, alternating).

    python bench/decode_throughput.py [--batch-sizes 1 16] [--new-tokens 128]
"""

from __future__ import annotations

import os

# No OpenMP policy is forced on transformers: this script used to set PASSIVE for both sides, while
# transformers run on its own (as in the table) spins. pat-engine's workers get
# EngineConfig.worker_env (PASSIVE). Which is faster depends on whether the cores are free
# (bench/results/omp_wait_policy_ab.md): the two setups measure different things.

import argparse
import tempfile
import time

import torch

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model


def hf_tokens_per_s(model, prompts: list[list[int]], lengths: list[int]) -> float:
    """Useful tokens/s: a static batch runs every row until its longest request is done."""
    ids = torch.tensor(prompts)
    longest = max(lengths)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=longest,
                         min_new_tokens=longest, do_sample=False)
    elapsed = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == longest
    return sum(lengths) / elapsed


def pat_tokens_per_s(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> float:
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == lengths
    return sum(lengths) / elapsed


def gemm_floor_ms(spec: TinyModelSpec, batch: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """Time of one decode step's matrix products alone (no attention, norms or framework): a floor."""
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = h // spec.num_heads
    shapes = [((spec.num_heads + 2 * spec.num_kv_heads) * hd, h), (h, spec.num_heads * hd), (2 * inter, h), (h, inter)]
    weights = [torch.randn(o, i, dtype=dtype) for o, i in shapes * spec.num_layers] + [torch.randn(v, h, dtype=dtype)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t)
    return best * 1000


def long_tail_lengths(n: int, cap: int, seed: int) -> list[int]:
    """Response lengths with a long tail (lognormal, median cap/5), one request at the cap."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=g) * 0.8) * cap / 5
    lengths = [max(4, min(cap, int(x))) for x in draws]
    lengths[0] = cap
    return lengths


MODELS = {
    # the "tiny-but-not-trivial" model: on a small CPU its GEMMs dominate each step
    "h512": TinyModelSpec(arch="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                          num_heads=8, num_kv_heads=8, max_position=2048),
    # a really tiny model: per-step framework overhead dominates
    "h128": TinyModelSpec(arch="llama", vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=4,
                          num_heads=4, num_kv_heads=4, max_position=2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    rows = []
    for name in args.models:
        spec = MODELS[name]
        with tempfile.TemporaryDirectory() as tmp:
            path = str(write_tiny_model(tmp, spec))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
            with Engine(path, tp=1, dp=1, dtype=args.dtype, threads_per_worker=threads) as engine:
                cases = [(bs, "equal", [args.new_tokens] * bs) for bs in args.batch_sizes]
                cases += [(bs, "long-tail", long_tail_lengths(bs, args.new_tokens, bs)) for bs in args.batch_sizes if bs > 1]
                for bs, kind, lengths in cases:
                    g = torch.Generator().manual_seed(bs)
                    prompts = torch.randint(10, spec.vocab_size - 10, (bs, args.prompt_len), generator=g).tolist()
                    pat_tokens_per_s(engine, prompts, [8] * bs)  # warm-up both
                    hf_tokens_per_s(hf, prompts, [8] * bs)
                    pat = ref = 0.0
                    for _ in range(args.repeats):  # alternate, so slow spells of the machine hit both
                        pat = max(pat, pat_tokens_per_s(engine, prompts, lengths))
                        ref = max(ref, hf_tokens_per_s(hf, prompts, lengths))
                    floor = gemm_floor_ms(spec, bs, getattr(torch, args.dtype))
                    rows.append([f"{name} ({spec.num_layers}L, hidden {spec.hidden_size}, vocab {spec.vocab_size})",
                                 bs, kind, sum(lengths), round(ref, 1), round(pat, 1), f"{pat / ref:.2f}x",
                                 round(floor, 2), round(1000 * bs / ref, 2) if kind == "equal" else "",
                                 round(1000 * bs / pat, 2) if kind == "equal" else ""])
    body = (
        f"Llama-shaped models, {args.dtype}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, EOS "
        f"ignored; {threads} threads for each side, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; best of "
        f"{args.repeats}, the two measured alternately. pat-engine runs TP1 in one worker process and pays "
        "the driver <-> worker round trip every step.\n\n"
        "*equal*: every request generates the same number of tokens (the static batch's best case). "
        "*long-tail*: requests stop at different lengths (lognormal, one at the cap), as in RL rollouts; "
        "transformers' static batch keeps computing every row until the longest is done, pat-engine "
        "drops finished requests. Throughput counts useful (requested) tokens only. *GEMM floor*: the step's "
        "matrix products alone at that batch (no attention, norms or framework), timed in this process; with "
        "equal lengths, ms/step = batch / tok/s.\n\n"
        + markdown_table(["model", "batch", "lengths", "useful tokens", "transformers tok/s", "pat-engine tok/s",
                          "speed-up", "GEMM floor ms/step", "transformers ms/step", "pat-engine ms/step"], rows)
    )
    write_result("decode_throughput", "Decode throughput: pat-engine vs transformers (CPU)", body)


if __name__ == "__main__":
    main()
