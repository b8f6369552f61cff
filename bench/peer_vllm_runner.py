"""vLLM CPU side of bench/peer_cpu.py: runs inside vLLM's own virtual environment (never imports pat_engine).

Starts one ``vllm.LLM`` and answers JSON lines on stdin/stdout, so the parent can interleave it with
the other engines: ``{"prompts": [[ids...], ...], "new_tokens": N}`` -> ``{"seconds": s, "tokens": [[...]]}``.
A request may instead give ``"max_tokens": [per prompt]`` with ``n``, ``temperature``, ``top_p``, ``seed``
and ``logprobs`` (bench/peer_rollout.py); ``tokens`` then lists every sample, prompt by prompt.
The first line it prints is ``{"ready": true, "startup_s": s}`` (or ``{"error": ...}``).

    python peer_vllm_runner.py MODEL_DIR TP [MAX_MODEL_LEN [DTYPE]]
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, tp = sys.argv[1], int(sys.argv[2])
    max_len = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
    # The protocol gets its own copy of stdout; fd 1 then points at stderr, so that nothing vLLM or
    # the processes it starts print (they inherit fd 1) can mix with the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True,
                  max_model_len=max_len, seed=0, distributed_executor_backend="mp" if tp > 1 else None)
    except Exception as exc:  # reported to the parent, which records the reason
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        lengths = req.get("max_tokens") or [req["new_tokens"]] * len(req["prompts"])
        params = [SamplingParams(temperature=req.get("temperature", 0.0), top_p=req.get("top_p", 1.0),
                                 n=req.get("n", 1), seed=req.get("seed"), logprobs=req.get("logprobs"),
                                 max_tokens=m, min_tokens=m, ignore_eos=True, detokenize=False) for m in lengths]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        if req.get("fresh_cache"):  # untimed: no prompt of an earlier run found in the prefix cache
            llm.reset_prefix_cache()
        t = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = [list(o.token_ids) for r in results for o in r.outputs]
        out.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
