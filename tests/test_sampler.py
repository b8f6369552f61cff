"""Sampling: greedy is argmax; seeded draws depend only on (seed, position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pat_engine.sampling.params import SamplingParams
from pat_engine.sampling.sampler import SamplingBatch, sample
from pat_engine.sampling.seeds import uniform_for, uniforms
from pat_engine.sampling.spec import SamplingSpec
from sampler_reference import reference_sample


def test_uniform_is_a_pure_function_of_seed_and_position():
    assert uniform_for(3, 10) == uniform_for(3, 10)
    draws = [uniform_for(3, p) for p in range(2000)]
    assert len(set(draws)) == 2000 and all(0 <= u < 1 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03


def test_spec_of_params_carries_every_setting_the_workers_use():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=True, top_logprobs=3,
                            logprobs_mode="processed", repetition_penalty=1.2, frequency_penalty=0.5,
                            presence_penalty=-0.5, logit_bias={7: 2.0})
    spec = SamplingSpec.of(params, 11, prompt_len=4)
    assert spec == SamplingSpec(0.7, 5, 0.9, 11, True, True, 3, 1.2, 0.5, -0.5, 0.05, ((7, 2.0),), 4)
    assert spec.has_penalties
    plain = SamplingSpec.of(SamplingParams(top_logprobs=3), 2, prompt_len=1)  # no log-probs asked: no top-k of them
    assert plain.top_logprobs == 0 and not plain.processed_logprobs and not plain.has_penalties


def test_greedy_top_k_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    greedy = SamplingSpec(0.0, -1, 1.0, 0, False)
    assert sample(logits, [greedy], [0])[0] == [1]
    top1 = SamplingSpec(1.0, 1, 1.0, 5, True)
    tokens, logprobs = sample(logits, [top1], [7])
    assert tokens == [1] and abs(logprobs[0] - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-12
    # top_p small enough keeps only the most likely token
    assert all(sample(logits, [SamplingSpec(1.0, -1, 0.1, s, False)], [0])[0] == [1] for s in range(20))
    # with no filtering, many seeds visit several tokens, each within the support
    seen = {sample(logits, [SamplingSpec(1.0, -1, 1.0, s, False)], [0])[0][0] for s in range(200)}
    assert seen == {0, 1, 2, 3}


def test_suppressed_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64)
    tokens, _ = sample(logits, [SamplingSpec(0.0, -1, 1.0, 0, False)], [0], [(1,)])
    assert tokens == [2]


def test_processed_logprobs_are_under_the_sampled_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    raw_spec = SamplingSpec(0.5, 2, 1.0, 3, True)
    processed_spec = SamplingSpec(0.5, 2, 1.0, 3, True, processed_logprobs=True)
    (tok,), (raw,) = sample(logits, [raw_spec], [4])
    (tok2,), (processed,) = sample(logits, [processed_spec], [4])
    assert tok == tok2 and tok in (1, 3)
    assert abs(raw - torch.log_softmax(logits, -1)[0, tok].item()) < 1e-12
    kept = torch.softmax(logits[0, [1, 3]] / 0.5, -1)  # top-2 after temperature, renormalised
    assert abs(processed - torch.log(kept[0 if tok == 1 else 1]).item()) < 1e-12


def test_vectorised_uniforms_equal_the_scalar_hash():
    seeds = [0, 1, 7, 2**31 - 1, 2**63 - 1, 2**63 + 5, 2**64 - 1, -3, 123456789012345]
    positions = [0, 1, 5, 1000, 2**20, 77, 3, 9, 31]
    got = uniforms(seeds, positions)
    assert got.dtype == np.float64 and got.tolist() == [uniform_for(s, p) for s, p in zip(seeds, positions)]


def test_host_side_settings_have_the_bits_the_device_formulas_gave():
    """The batch's float32 inverse temperatures are computed on the host: the bits of the device formula
    ``(1.0 / temperature_float64).to(float32)``."""
    temps = [0.3, 0.7, 1.0, 1.3, 2.0, 1 / 3, 0.9999999, 1e-3, 7.25]
    batch = SamplingBatch.build([SamplingSpec(t, -1, 1.0, 5, False) for t in temps], list(range(len(temps))))
    want = (1.0 / torch.tensor(temps, dtype=torch.float64)).to(torch.float32)
    assert torch.equal(batch.inv_temp.view(torch.int32), want.view(torch.int32))


def _random_specs(g: torch.Generator, n: int, vocab: int) -> list[SamplingSpec]:
    specs = []
    for _ in range(n):
        kind = int(torch.randint(0, 6, (1,), generator=g))
        temperature = [0.0, 0.3, 0.7, 1.0, 1.3, 2.0][int(torch.randint(0, 6, (1,), generator=g))]
        top_k = [-1, 0, 1, 5, 50, vocab, vocab + 7][int(torch.randint(0, 7, (1,), generator=g))]
        top_p = [1.0, 0.9, 0.5, 0.05, 0.999][int(torch.randint(0, 5, (1,), generator=g))]
        seed = int(torch.randint(0, 2**62, (1,), generator=g)) * (-1 if kind == 0 else 1)
        min_p = [0.0, 0.0, 0.05, 0.3][int(torch.randint(0, 4, (1,), generator=g))]
        specs.append(SamplingSpec(temperature, top_k, top_p, seed, kind != 1, processed_logprobs=kind >= 4,
                                  min_p=min_p))
    return specs


@pytest.mark.parametrize("sampler", ["kernel", "torch"])
def test_batched_sampler_equals_the_per_row_reference(sampler, monkeypatch):
    """Many random rows, mixed settings (greedy, temperature, top-k, top-p, min_p, ties), float64,
    float32 and bfloat16; through the C++ kernel and through its torch twin."""
    monkeypatch.setenv("PAT_CPU_SAMPLER", sampler)
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        vocab = [7, 64, 390, 1000, 2100][trial % 5]  # 2100: three blocks of Z
        batch = int(torch.randint(1, 16, (1,), generator=g))
        dtype = [torch.float32, torch.float64, torch.bfloat16][trial % 3]
        logits = (torch.randn(batch, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
        if trial % 4 == 0:  # exact ties: quantised logits
            logits = (logits * 2).round() / 2
        specs = _random_specs(g, batch, vocab)
        positions = torch.randint(0, 5000, (batch,), generator=g).tolist()
        suppressed = [tuple(torch.randint(0, vocab, (int(torch.randint(0, 3, (1,), generator=g)),),
                                          generator=g).tolist()) for _ in range(batch)]
        for sup in (None, suppressed):
            want = reference_sample(logits, specs, positions, sup)
            got = sample(logits, specs, positions, sup)
            assert got[0] == want[0], (trial, specs)
            assert (got[1] is None) == (want[1] is None)
            if want[1] is not None:
                assert got[1] == want[1], trial


def test_top_k_ties_at_the_cut_follow_the_stable_order():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]], dtype=torch.float64)
    for seed in range(50):
        for k in (1, 2, 3):
            spec = SamplingSpec(1.0, k, 1.0, seed, True, processed_logprobs=True)
            assert sample(logits, [spec], [seed]) == reference_sample(logits, [spec], [seed])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_kernel_and_its_torch_twin_agree_bit_for_bit(dtype):
    """Every vocabulary size around the eight lanes, temperatures, min_p floors, masked tokens; and
    a row alone equals the same row inside a batch."""
    from pat_engine.sampling import inverse_cdf as icdf

    if icdf.cpu_sample is None or not icdf.cpu_sample.usable(torch.zeros(1, dtype=dtype)):
        pytest.skip("the CPU kernels are not built here")
    g = torch.Generator().manual_seed(1)
    for vocab in (1, 7, 8, 9, 1000, 32003):
        rows = 13
        x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
        x[0, : vocab // 2] = float("-inf")
        inv_temp = torch.rand(rows, generator=g) * 2 + 0.3
        floor = torch.where(torch.rand(rows, generator=g) < 0.5, torch.log(torch.rand(rows, generator=g) * 0.2),
                            torch.tensor(float("-inf")))
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        for draw in (True, False):
            kernel = icdf.cpu_sample.inverse_cdf(x, inv_temp, floor, u, draw)
            twin = icdf._torch_inverse_cdf(x, inv_temp, floor, u, draw)
            assert all(torch.equal(a, b) for a, b in zip(kernel, twin)), (vocab, draw)
        alone = icdf.cpu_sample.inverse_cdf(x[3:4].contiguous(), inv_temp[3:4], floor[3:4], u[3:4], True)
        batch = icdf.cpu_sample.inverse_cdf(x, inv_temp, floor, u, True)
        assert all(torch.equal(a[0], b[3]) for a, b in zip(alone, batch))


def test_the_kernel_keeps_the_first_maximum_and_the_scan_ends_of_interleaved_rows():
    """The kernel finds the max in sixteen lanes and scans up to eight rows together: ties across
    lanes still go to the lowest id, a row whose draw lands in the last chunk or past the whole sum
    (u * Z rounding above it) takes the last token with mass, and rows ending early leave the others'
    sums alone (37 rows: groups of eight and a remainder, each row equal to the twin and to itself alone)."""
    from pat_engine.sampling import inverse_cdf as icdf

    if icdf.cpu_sample is None or not icdf.cpu_sample.usable(torch.zeros(1)):
        pytest.skip("the CPU kernels are not built here")
    g = torch.Generator().manual_seed(3)
    rows, vocab = 37, 4099
    x = torch.randn(rows, vocab, generator=g)
    x[1, [5, 20, 4000]] = 9.0  # the same maximum in three lanes: the first is id 5
    x[2, :-3] = float("-inf")  # mass only at the very end
    inv_temp, floor = torch.ones(rows), torch.full((rows,), float("-inf"))
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[2], u[3] = 1.0 - 2.0**-53, 0.0
    for draw in (True, False):
        kernel = icdf.cpu_sample.inverse_cdf(x, inv_temp, floor, u, draw)
        twin = icdf._torch_inverse_cdf(x, inv_temp, floor, u, draw)
        assert all(torch.equal(a, b) for a, b in zip(kernel, twin)), draw
    assert icdf.cpu_sample.inverse_cdf(x, inv_temp, floor, u, False)[0][1] == 5
    drawn = icdf.cpu_sample.inverse_cdf(x, inv_temp, floor, u, True)[0]
    assert drawn[2] >= vocab - 3
    for r in (0, 7, 8, 36):
        alone = icdf.cpu_sample.inverse_cdf(x[r:r + 1], inv_temp[:1], floor[:1], u[r:r + 1], True)[0]
        assert alone[0] == drawn[r]


def test_the_polynomial_exp_is_within_two_ulp():
    from pat_engine.sampling.inverse_cdf import pexp

    z = -torch.rand(100_000, generator=torch.Generator().manual_seed(2)) * 87
    exact = torch.exp(z.double())
    assert ((pexp(z).double() - exact) / exact).abs().max() < 2.5e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefix_kernel_equals_masking_the_row(dtype, monkeypatch):
    """top_k / top_p rows through the C++ prefix kernel (histogram, the cut bucket sorted, or the highest
    buckets where the bucket sums may round) against the torch path (partial topk, the row masked to its
    prefix): flat and peaked rows, quantised ties, a near-uniform row (most tokens kept: the draw masks
    the row), and a spike over a tail of tiny weights that top_p 0.999+ reaches into (the bucket sums
    are not exact there, so the kernel sorts the highest buckets)."""
    from pat_engine.sampling import inverse_cdf as icdf

    if icdf.cpu_sample is None or not icdf.cpu_sample.usable(torch.zeros(1, dtype=dtype)):
        pytest.skip("the CPU kernels are not built here")
    g = torch.Generator().manual_seed(3)
    vocab, rows = 20000, 13
    flat = torch.randn(rows, vocab, generator=g) * 3
    peaked = -1.2 * torch.log(torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).float() + 1)
    near_uniform = torch.randn(rows, vocab, generator=g) * 0.05
    spike = -20 + torch.rand(rows, vocab, generator=g) * 3
    spike[:, 7] = 0.0
    for logits in (flat, peaked, (flat * 2).round() / 2, near_uniform, spike):
        logits = logits.to(dtype)
        specs = [SamplingSpec(t, k, p, seed=50 + i, logprobs=True, processed_logprobs=True, min_p=mp)
                 for i, (t, k, p, mp) in enumerate(
                     [(1.0, -1, 0.95, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 300, 0.9, 0.0), (1.0, -1, 0.5, 0.05),
                      (1.0, 1, 1.0, 0.0), (2.0, -1, 0.999, 0.0), (1.0, vocab, 0.99, 0.0), (0.3, -1, 0.95, 0.0),
                      (1.0, 7, 0.3, 0.0), (1.0, -1, 1.0, 0.0), (1.0, -1, 0.95, 0.2), (1.0, 20000, 1.0, 0.0),
                      (1.0, -1, 0.9999999, 0.0)])]
        positions = list(range(100, 100 + rows))
        got = sample(logits, specs, positions)
        monkeypatch.setenv("PAT_CPU_SAMPLER", "torch")
        want = sample(logits, specs, positions)
        monkeypatch.delenv("PAT_CPU_SAMPLER")
        assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_greedy_batch_takes_its_tokens_and_logprobs_from_one_pass(dtype):
    """A greedy batch asking for log-probs gets argmax and ``token_logprobs`` at it, to the bit."""
    from pat_engine.sampling.logprobs import greedy_logprobs, token_logprobs

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(19, 3001, generator=g) * 3).to(dtype)
    x[4, [7, 2000]] = 50.0  # a tie: the first maximum
    tokens, logprobs = greedy_logprobs(x)
    assert torch.equal(tokens, x.argmax(dim=-1)) and tokens[4] == 7
    assert torch.equal(logprobs, token_logprobs(x, tokens))
    specs = [SamplingSpec(0.0, 0, 1.0, 0, True)] * 19
    assert sample(x, specs, list(range(19))) == (tokens.tolist(), logprobs.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_rows_take_the_first_maximum_as_torch_argmax_does(dtype):
    from pat_engine.sampling.inverse_cdf import first_max

    g = torch.Generator().manual_seed(9)
    wide = (torch.randn(23, 5003, generator=g) * 2).to(dtype)
    x = wide[:, :4999]  # rows with a stride longer than the row
    x[3, [17, 4000, 4998]] = 40.0  # ties in three lanes
    x[5, :] = float("-inf")
    x[5, 4998] = 0.0  # the maximum in the tail past the last full group of lanes
    assert torch.equal(first_max(x), x.argmax(dim=-1)) and first_max(x)[3] == 17
