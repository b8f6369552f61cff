"""The trainer's side of the same numbers: per-token log-probs of given sequences in one process.

``reference_logprobs`` runs each (prompt, response) pair as one prefill through an
``InferExecutor`` built as an engine in ``numerics="invariant"`` builds a rank: the row-parallel
chunk count follows from the declared ``max_tp`` (not from any world size), every GEMM is the
invariant one, prefill attention goes through the decode kernel (docs/numerics.md). That prefill
gives every position the hidden state, to the bit, that the engine's prefill or decode step gave
it at any layout and deployment size, in any batch, and the log-probs come from the same logits
by the sampler's own rule (sampling/logprobs.py). So a response's reference log-probs equal the
``RequestOutput.logprobs`` the invariant engine returned (raw log-probs, the default
``logprobs_mode``) for the same model, dtype and ``max_tp``.

CPU only, and the GEMMs must see the engine workers' thread count (``EngineConfig.worker_threads``,
the default here): on this project's machine oneDNN's rows do not depend on it, elsewhere they may.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pat_engine.config import DEFAULT_MAX_TP, EngineConfig
from pat_engine.errors import InvalidRequestError
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.infer_executor import InferExecutor


def reference_logprobs(model: str, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], dtype: str = "auto",
                       world: int = 1, block_size: int = 16, threads: int | None = None, device: str = "cpu",
                       attention_backend: str = "auto", max_tp: int = DEFAULT_MAX_TP) -> list[list[float]]:
    """The log-prob of every response token given the tokens before it, for each (prompt, response).

    Args:
        model: the checkpoint directory the engine serves.
        sequences: (prompt token ids, response token ids) pairs; the prompt must not be empty.
        dtype: as ``Engine(dtype=...)``.
        world: the engine's world size (tp * dp): only the default thread count follows it.
        block_size: KV block size (the engine's ``block_size``; it does not change the bits).
        threads: torch threads; default the engine workers' (``EngineConfig.worker_threads``).
        device, attention_backend: as the engine's (``EngineConfig``): the same kernels give the same bits,
            so a trainer next to a GPU engine passes "cuda" (its "auto" backend is then the Triton one).
        max_tp: as the engine's (``EngineConfig.max_tp``): it fixes the row-parallel reduction tree.
    Returns:
        one list per pair, ``len(response)`` log-probs.
    """
    cfg = EngineConfig(model=str(model), tp=1, dp=world, dtype=dtype, block_size=block_size, numerics="invariant",
                       device=device, attention_backend=attention_backend, max_tp=max_tp)
    if any(len(prompt) == 0 for prompt, _ in sequences):
        raise InvalidRequestError("reference_logprobs: every prompt needs at least one token")
    arch = load_model_arch(cfg.model)
    longest = max((len(p) + len(r) for p, r in sequences), default=1)
    blocks = -(-longest // block_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or cfg.worker_threads())
    try:
        ex = InferExecutor(arch, Layout(1, world), TPGroup(rank=0, size=1, ranks=(0,)), cfg.torch_dtype(),
                           torch.device(cfg.device), block_size, blocks + 1, numerics="invariant",
                           attention=cfg.attention_backend, max_tp=cfg.max_tp)
        ex.load_weights(cfg.model)
        out = []
        for i, (prompt, response) in enumerate(sequences):
            if not response:
                out.append([])
                continue
            tokens = list(prompt) + list(response)
            step = SeqStep(i, tokens, 0, block_table=list(range(1, 1 + -(-len(tokens) // block_size))),
                           sampling=SamplingSpec(0.0, -1, 1.0, 0, False), prompt_logprobs=0)
            result = ex.execute(StepCommand(i, True, [step], released=[i - 1] if i else []))
            out.append(result.prompt_logprobs[i].logprobs[len(prompt) - 1 :])
        return out
    finally:
        torch.set_num_threads(previous)
