"""Ragged prefill in groups of similar length: the same bits as one call padded to the longest prompt."""

from __future__ import annotations

import pytest
import torch

from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker import step_inputs
from pat_engine.worker.infer_executor import InferExecutor
from pat_engine.worker.step_inputs import prefill_row_groups

BLOCK, BLOCKS_PER_SEQ = 4, 24


def test_groups_bound_the_padding_and_keep_batch_order():
    lens = [16, 250, 40, 17, 100, 256, 24, 60]
    groups = prefill_row_groups(lens, ratio=1.5)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert g == sorted(g)
        assert max(lens[i] for i in g) <= 1.5 * min(lens[i] for i in g)
    assert prefill_row_groups([7, 7, 8]) == [[0, 1, 2]]  # similar lengths: one call, as before
    assert prefill_row_groups([5]) == [[0]]


def _executor(path: str, dtype: torch.dtype) -> InferExecutor:
    ex = InferExecutor(load_model_arch(path), Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), dtype,
                       torch.device("cpu"), block_size=BLOCK, num_blocks=8 * BLOCKS_PER_SEQ + 1)
    ex.load_weights(path)
    return ex


def _prefill(ex: InferExecutor, prompts: list[list[int]], cached: list[int]) -> tuple[list[int], list[float], torch.Tensor]:
    """Prefill ``prompts`` (the first ``cached[i]`` tokens already in the KV cache from an earlier step):
    sampled tokens, their log-probs and the whole KV pool."""
    spec = [SamplingSpec(temperature=1.0, top_k=0, top_p=1.0, seed=i, logprobs=True) for i in range(len(prompts))]
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))]
    if any(cached):
        ex.execute(StepCommand(0, True, [SeqStep(i, p[:c], 0, block_table=t, sampling=s)
                                         for i, (p, c, t, s) in enumerate(zip(prompts, cached, tables, spec)) if c]))
    out = ex.execute(StepCommand(1, True, [SeqStep(i, p[c:], c, block_table=t, sampling=s)
                                           for i, (p, c, t, s) in enumerate(zip(prompts, cached, tables, spec))]))
    return out.tokens, out.logprobs, torch.cat([layer.flatten() for layer in ex.kv.layers])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_one_padded_call(model_dir, monkeypatch, dtype):
    """float64: the same bits. float32 and bfloat16 in the fast numerics mode: SDPA's rounding already
    depends on how wide a row is padded (the batch's longest prompt), so grouping changes it the way
    another batch would; tokens hold and log-probs agree to rounding. The invariant mode prefills
    through the decode kernel, one row per token, and is not grouped (tests/test_invariant_numerics.py)."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 70, 9, 41, 17, 90, 5, 33]
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
    cached = [0, 8, 0, 4, 0, 0, 0, 12]  # some rows continue after a cached prefix
    path = model_dir("llama")
    grouped = _prefill(_executor(path, dtype), prompts, cached)
    assert len(prefill_row_groups([p - c for p, c in zip(lengths, cached)])) > 2  # the case under test
    monkeypatch.setattr(step_inputs, "_PREFILL_GROUP_RATIO", float("inf"))  # one group: the old single call
    single = _prefill(_executor(path, dtype), prompts, cached)
    assert grouped[0] == single[0]
    if dtype == torch.float64:
        assert grouped[1] == single[1] and torch.equal(grouped[2], single[2])  # log-probs and the KV written
    else:
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(torch.tensor(grouped[1]), torch.tensor(single[1]), rtol=0, atol=tol)
        torch.testing.assert_close(grouped[2].float(), single[2].float(), rtol=tol, atol=tol)


def test_the_torch_paths_mask_is_derived_on_the_device_as_the_host_built_it():
    """Prefill steps no longer build their mask on the host (an 8 x 4K prefill's was 134 MB, copied to the GPU
    for kernels that never read it); the torch path derives it from the lengths. Same booleans as the host
    formula: query i of row b sees context j <= min(start_b + i, last_b), padding queries the last token's view."""
    starts, lens, bs = torch.tensor([0, 5, 17, 3]), torch.tensor([7, 1, 4, 7]), 4
    builder = step_inputs.StepInputBuilder(bs, torch.device("cpu"), 32)
    seqs = [SeqStep(i, [1] * int(n), int(s), block_table=list(range(8 * i, 8 * i + 8)),
                    sampling=SamplingSpec(0.0, -1, 1.0, 0, False))
            for i, (s, n) in enumerate(zip(starts, lens))]
    meta = builder.build(StepCommand(1, True, seqs), samples=False).attn
    width = -(-int((starts + lens).max()) // bs)
    query_len = int(lens.max())
    last = starts + lens - 1
    query_pos = torch.minimum(starts[:, None] + torch.arange(query_len)[None, :], last[:, None])
    host = (torch.arange(width * bs)[None, None, :] <= query_pos[:, :, None])[:, None]  # the builder's old formula
    parts = meta.parts or [meta]
    assert len(parts) > 1  # ragged: groups, each its own mask
    for part in parts:
        rows = [int(r) for r in part.cached_lens.tolist()]  # a part's rows, told apart by their starts
        idx = [starts.tolist().index(r) for r in rows]
        got = part.torch_mask(part.block_tables.shape[1] * bs)
        want = host[idx][:, :, : part.query_len, : got.shape[-1]]
        assert torch.equal(got, want)
        assert part.torch_mask(got.shape[-1]) is got  # built once, kept for the step's other layers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_prefill_without_cached_tokens_runs_causal_with_the_masks_bits(model_dir, monkeypatch, dtype):
    """No row with cached tokens: SDPA runs with ``is_causal`` instead of the mask (it skips the blocks above the
    diagonal). Ragged rows (padding queries in every group) give the same tokens, log-probs and KV, bit for
    bit, as through the mask; a group with a row continuing a cached prefix keeps the mask."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 70, 9, 41, 17, 90, 5, 33)]
    path = model_dir("llama")
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k["is_causal"]) or real(*a, **k))
    causal = _prefill(_executor(path, dtype), prompts, [0] * len(prompts))
    assert calls and all(calls)
    built = step_inputs.StepInputBuilder._prefill_attention

    def masked(self, *args, **kwargs):
        meta = built(self, *args, **kwargs)
        meta.causal = False
        return meta

    monkeypatch.setattr(step_inputs.StepInputBuilder, "_prefill_attention", masked)
    calls.clear()
    with_mask = _prefill(_executor(path, dtype), prompts, [0] * len(prompts))
    assert calls and not any(calls)
    assert causal[0] == with_mask[0] and causal[1] == with_mask[1] and torch.equal(causal[2], with_mask[2])
    monkeypatch.setattr(step_inputs.StepInputBuilder, "_prefill_attention", built)
    calls.clear()
    _prefill(_executor(path, dtype), prompts, [0, 8, 0, 4, 0, 0, 0, 12])
    assert False in calls  # the second step's rows 1, 3 and 7 continue a cached prefix: their groups keep the mask
