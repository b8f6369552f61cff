"""Decode throughput: pat-engine (TP1, one worker) vs transformers ``generate`` on the same checkpoint.

Both run on the CPU with the same thread count, greedy, same prompts, EOS ignored
so every request decodes ``--new-tokens`` tokens. Reported: output tokens/s of
each and their ratio, measured side by side in one run (best of ``--repeats``).

    python bench/decode_throughput.py [--batch-sizes 1 16] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model


def hf_tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    elapsed = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def pat_tokens_per_s(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(arch="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                         num_heads=8, num_kv_heads=8, max_position=2048)
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(tmp, spec))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        with Engine(path, tp=1, dp=1, dtype=args.dtype, threads_per_worker=threads) as engine:
            for bs in args.batch_sizes:
                g = torch.Generator().manual_seed(bs)
                prompts = torch.randint(10, spec.vocab_size - 10, (bs, args.prompt_len), generator=g).tolist()
                pat_tokens_per_s(engine, prompts, 8)  # warm-up both
                hf_tokens_per_s(hf, prompts, 8)
                pat = max(pat_tokens_per_s(engine, prompts, args.new_tokens) for _ in range(args.repeats))
                ref = max(hf_tokens_per_s(hf, prompts, args.new_tokens) for _ in range(args.repeats))
                rows.append([bs, args.new_tokens, round(ref, 1), round(pat, 1), f"{pat / ref:.2f}x"])
    body = (
        f"Model: Llama-shaped, 4 layers, hidden 512, 8 heads, intermediate 1536, vocab 8192, {args.dtype}; "
        f"prompt {args.prompt_len} tokens; {threads} threads for each side; best of {args.repeats}.\n\n"
        + markdown_table(["batch", "new tokens", "transformers tok/s", "pat-engine tok/s", "speed-up"], rows)
    )
    write_result("decode_throughput", "Decode throughput: pat-engine vs transformers (CPU)", body)


if __name__ == "__main__":
    main()
