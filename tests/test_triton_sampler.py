"""The sampler's Triton kernels (``pat_kernels/triton_sampler.py``), run by Triton's CPU interpreter.

Each row's weights e and max m have the torch twin's bits (``inverse_cdf._torch_weights``: the formulas of
the C++ kernel) for float32, bfloat16 and float64 logits, temperatures, min_p floors, suppressed (-inf)
tokens and NaN rows, at widths that are not a multiple of the kernel's block. Z has the twin's bits
(``lane_sum`` with the switch off: a cumsum down each of eight lanes) for row lengths that are and are not
multiples of eight and longer than one step of the kernel's walk, on weights spread over many binades
(where another order of the float64 adds gives other bits: checked). The draw follows its own rule, the
running sum in blocks (``blocked_draw_reference``), which gives the CPU chain's tokens but where the target
lands between two roundings of a boundary (one such case built by hand). The top_p nucleus takes the same
walk to where the sum reaches its target (>=: a sum that meets it exactly ends the nucleus there). Greedy's
first maximum is torch's argmax (ties, NaN, -inf rows, masked chunks). Through
the sampler (its torch path, ``PAT_CPU_SAMPLER=torch``; the CPU's partial sort and the GPU's whole one),
``PAT_TRITON_SAMPLER=on`` draws the same tokens with the same log-probs on these rows, top_p rows too.
The ``gpu`` test repeats the bits compiled at a real vocabulary.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from triton_markers import DEV, gpu, needs_triton

from pat_engine.sampling import inverse_cdf

Z = inverse_cdf.Z_BLOCK  # Z's blocks, as the sampler passes them to the kernel

SLOW = pytest.mark.slow  # the interpreter walks a row's blocks in Python: the fast tier keeps one case of each


def _weights(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Non-negative float32 weights over ~60 binades, as a softmax's tail puts them."""
    g = torch.Generator().manual_seed(seed)
    e = torch.exp(-torch.rand(rows, vocab, generator=g) * 40.0)
    e[:, ::97] = 0.0  # tokens below a min_p floor
    return e.to(DEV)


def _kernel():
    from pat_kernels import triton_sampler

    return triton_sampler


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN and -inf rows' casts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_weights_and_max_have_the_torch_twins_bits(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 9000, generator=g) * 6).to(dtype)  # 9000: two full chunks of 4096 and a masked one
    x[1, ::7] = float("-inf")  # suppressed tokens
    x[2] = float("-inf")  # a row with nothing left
    x[3, 8500] = float("nan")  # in the last chunk
    x[0, 8999] = 30.0  # row 0's max in the last chunk: every chunk's weights need the other chunks' max
    x = x.to(DEV)
    inv_temp = torch.tensor([1.0, 1 / 0.7, 1.0, 1.0, 1 / 1.3], dtype=torch.float32, device=DEV)
    floor = torch.tensor([float("-inf"), float("-inf"), -2.0, float("-inf"), float(torch.log(torch.tensor(0.05)))],
                         dtype=torch.float32, device=DEV)
    e, m = _kernel().weights(x, inv_temp, floor)
    want_e, want_m = inverse_cdf._torch_weights(x, inv_temp, floor)
    assert e.dtype == torch.float32 and m.shape == (5, 1)
    assert torch.equal(e, want_e) and torch.equal(m[[0, 1, 2, 4]], want_m[[0, 1, 2, 4]])
    assert torch.isnan(m[3]).all() and torch.isnan(want_m[3]).all()
    assert (e[0] > 0).all() and (e[4] == 0).any() and (e[4] > 0).any()  # the floor drops some, not all
    strided = torch.zeros(5, 9100, dtype=dtype, device=DEV)[:, :9000]
    strided.copy_(x)
    assert torch.equal(_kernel().weights(strided, inv_temp, floor)[0], want_e)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_is_torchs_argmax(dtype):
    """The first place of the max (ties in two chunks, in one chunk), of the first NaN where there is one,
    0 for a row of -inf, a max in the masked last chunk; rows of a wider tensor."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(7, 9000, generator=g) * 4).to(dtype)  # two full chunks of 4096 and a masked one
    x[0, 8999] = 50.0  # the max in the last, masked chunk
    x[1, [5000, 100, 8000]] = 40.0  # a tie across chunks: the first chunk's place wins
    x[2, [300, 200]] = 40.0  # a tie inside a chunk
    x[3] = float("-inf")
    x[4, [7000, 6000]] = float("nan")  # NaN wins, the first one
    x[5, 4096] = 40.0  # a chunk's first place
    x = x.to(DEV)
    got = _kernel().first_max(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert got[:6].tolist() == [8999, 100, 200, 0, 6000, 4096]
    wide = torch.full((7, 9100), 99.0, dtype=dtype, device=DEV)[:, :9000]
    wide.copy_(x)
    assert torch.equal(_kernel().first_max(wide), got)
    small = x[:, :5]  # one masked chunk
    assert torch.equal(_kernel().first_max(small.contiguous()), small.argmax(dim=-1))


def test_greedy_rows_take_the_triton_first_max_where_the_sampler_kernels_serve(monkeypatch):
    """``inverse_cdf.first_max`` (greedy rows without log-probs) runs the kernel where ``PAT_TRITON_SAMPLER``
    serves the tensor (CUDA by default), torch's argmax elsewhere."""
    from pat_engine import env

    calls = []
    monkeypatch.setattr(inverse_cdf, "cpu_sample", None)  # the C++ kernel would take CPU rows first
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: True)
    fake = types.ModuleType("pat_kernels.triton_sampler")  # the kernel's wiring only: no Triton needed
    fake.first_max = lambda x: calls.append(x.shape) or x.argmax(dim=-1)
    monkeypatch.setitem(sys.modules, "pat_kernels.triton_sampler", fake)
    x = torch.randn(3, 50)
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "on")
    assert torch.equal(inverse_cdf.first_max(x), x.argmax(dim=-1)) and calls == [(3, 50)]
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    inverse_cdf.first_max(x)
    inverse_cdf.first_max(x.double())
    assert calls == [(3, 50)]


@needs_triton
@pytest.mark.parametrize("vocab", [1, 8, 517, 1000, 2048, 5003])
def test_z_has_the_torch_twins_bits(vocab, monkeypatch):
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    e = _weights(3, vocab, seed=vocab)
    want = inverse_cdf.lane_sum(e)  # the torch twin
    got = _kernel().lane_sum(e, Z)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(_kernel().lane_sum(e[1:2], Z), want[1:2])  # a row alone
    if vocab >= 517:  # the order is visible in these bits: a plain float64 sum differs
        assert not torch.equal(e.double().sum(dim=1), want)


@needs_triton
def test_z_is_taken_in_blocks_by_the_kernel_the_twin_and_the_cpu_kernel(monkeypatch):
    """Z's rule (blocks of Z_BLOCK tokens, eight lanes each, the totals in order), written out in plain floats
    by tests/sampler_reference.py, is what the Triton kernel, the torch twin and the C++ kernel compute; on
    these rows a single walk of eight lanes down the whole row gives other bits."""
    from pat_kernels import cpu_sample
    from sampler_reference import _lanes

    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    vocab = 3 * Z + 517
    e = _weights(4, vocab, seed=3)
    want = torch.tensor([_lanes(row) for row in e.double().tolist()], dtype=torch.float64)
    assert torch.equal(_kernel().lane_sum(e, Z).cpu(), want)
    assert torch.equal(inverse_cdf.lane_sum(e).cpu(), want)
    whole_row = [_lanes_unblocked(row) for row in e.double().tolist()]
    assert whole_row != want.tolist()
    if cpu_sample.usable(e.cpu()):  # its weights from logits whose e are these: log e, temperature 1
        x = e.cpu().log()
        ones, floor = torch.ones(4), torch.full((4,), float("-inf"))
        e_cpu = cpu_sample.weights(x, ones, floor)
        z_cpu = cpu_sample.inverse_cdf(x, ones, floor, torch.zeros(4, dtype=torch.float64), False)[2]
        assert torch.equal(z_cpu, torch.tensor([_lanes(row) for row in e_cpu.double().tolist()], dtype=torch.float64))


def _lanes_unblocked(e: list[float]) -> float:
    acc = [0.0] * 8
    for i, v in enumerate(e):
        acc[i % 8] += v
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@needs_triton
def test_rows_of_a_wider_tensor_and_bad_input():
    wide = _weights(4, 600, seed=1)
    view = wide[:, :517]  # rows 600 apart
    assert torch.equal(_kernel().lane_sum(view, Z), inverse_cdf.lane_sum(view.contiguous()))
    assert _kernel().lane_sum(wide[:0], Z).shape == (0,)
    for bad in (wide.double(), wide[0], wide.t()):
        with pytest.raises(ValueError, match="float32"):
            _kernel().lane_sum(bad, Z)


@needs_triton
@pytest.mark.parametrize("vocab", [pytest.param(1, marks=SLOW), pytest.param(5, marks=SLOW),
                                   pytest.param(127, marks=SLOW), 700, pytest.param(2051, marks=SLOW)])
def test_the_draw_follows_its_blocked_rule(vocab):
    """The kernel's token is ``blocked_draw_reference``'s (plain Python floats) and, on these rows, the CPU's
    single chain's (the twin's rule); a target past the whole sum takes the last token with weight."""
    sk = _kernel()
    g = torch.Generator().manual_seed(vocab)
    e = _weights(4, vocab, seed=vocab)
    e[3] = 0.0  # a row with no weight: token 0, as the twin gives
    z = sk.lane_sum(e, Z)
    u = torch.rand(4, generator=g, dtype=torch.float64).to(DEV)
    got = sk.draw(e, u, z)
    rows = e.double().cpu().tolist()
    assert got.tolist() == [sk.blocked_draw_reference(rows[r], float(u[r] * z[r])) for r in range(4)]
    chain = (e.double().cumsum(dim=-1) <= (u * z).unsqueeze(1)).sum(dim=-1)
    last = torch.where(e > 0, torch.arange(vocab, device=DEV), 0).max(dim=-1).values
    assert torch.equal(got, torch.where(chain >= vocab, last, chain))
    past = sk.draw(e, torch.full((4,), 2.0, dtype=torch.float64, device=DEV), z)  # target 2Z
    assert torch.equal(past, last)


@needs_triton
def test_the_draw_sums_in_blocks_not_in_one_chain():
    """Where the two orders round differently at the target, the kernel takes its blocks' token: 1.0 then
    two 2^-53 weights stay 1.0 in one chain (each add rounds back), but make 1 + 2^-52 as a block's total."""
    sk = _kernel()
    vocab = 2 * sk.DRAW_BLOCKS  # blocks of two tokens
    e = torch.zeros(1, vocab)
    e[0, 0], e[0, 2], e[0, 3], e[0, vocab - 1] = 1.0, 2.0**-53, 2.0**-53, 1.0
    e = e.to(DEV)
    u, z = torch.tensor([0.5], dtype=torch.float64, device=DEV), torch.tensor([2.0], dtype=torch.float64, device=DEV)
    assert sk.draw(e, u, z).tolist() == [3] == [sk.blocked_draw_reference(e[0].double().cpu().tolist(), 1.0)]
    assert int((e.double().cumsum(dim=-1) <= 1.0).sum()) == vocab - 1  # the single chain passes 1.0 at the end


@SLOW  # the fast tier keeps the hand-built case below
@needs_triton
@pytest.mark.parametrize("vocab", [3, 700, 2051])
def test_the_nucleus_follows_its_blocked_rule(vocab):
    """``first_reaching`` on rows in descending order is ``blocked_draw_reference(reach=True)`` and, on these
    rows, the single chain's place (the count of running sums below top_p * Z); a target past the whole sum
    gives V (the twin's count, V + 1 for the nucleus, then clamped by the caller)."""
    sk = _kernel()
    e = _weights(4, vocab, seed=vocab).sort(dim=-1, descending=True).values
    z = sk.lane_sum(e, Z)
    top_p = torch.tensor([0.9, 0.5, 0.99, 1e-9], dtype=torch.float64, device=DEV)
    got = sk.first_reaching(e, top_p, z)
    rows = e.double().cpu().tolist()
    assert got.tolist() == [sk.blocked_draw_reference(rows[r], float(top_p[r] * z[r]), reach=True) for r in range(4)]
    chain = (e.double().cumsum(dim=-1) < (top_p * z).unsqueeze(1)).sum(dim=-1)
    assert torch.equal(got, chain) and int(got[3]) == 0
    assert sk.first_reaching(e, torch.full((4,), 2.0, dtype=torch.float64, device=DEV), z).tolist() == [vocab] * 4


@needs_triton
def test_the_nucleus_stops_where_the_sum_reaches_top_p_and_the_draw_where_it_passes():
    """At a target the running sum meets exactly, the nucleus ends on that token (>=) and the draw takes the
    next (>): 0.5 + 0.25 = 0.75 exactly."""
    sk = _kernel()
    e = torch.tensor([[0.5, 0.25, 0.125, 0.125] + [0.0] * (2 * sk.DRAW_BLOCKS - 4)], device=DEV)  # blocks of two
    one = torch.ones(1, dtype=torch.float64, device=DEV)
    frac = torch.tensor([0.75], dtype=torch.float64, device=DEV)
    assert sk.first_reaching(e, frac, one).tolist() == [1] and sk.draw(e, frac, one).tolist() == [2]
    assert inverse_cdf.nucleus_sizes(e, frac, one).tolist() == [2]  # the twin's nucleus: two tokens


@needs_triton
@SLOW  # the whole sampler twice (6 s under the interpreter); the fast tier keeps each kernel's own tests
@pytest.mark.parametrize("gpu_way", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_draws_the_same_tokens_and_log_probs_with_it(dtype, gpu_way, monkeypatch):
    from pat_engine.sampling import host
    from pat_engine.sampling.sampler import SamplingBatch, sample_on_device
    from pat_engine.sampling.spec import SamplingSpec

    monkeypatch.setenv("PAT_CPU_SAMPLER", "torch")  # the torch path (the C++ kernel would serve the CPU)
    if gpu_way:  # top_p rows' prefix as on a GPU: every row sorted whole, nothing read on the host
        monkeypatch.setattr(host, "reads_are_free", lambda x: False)
    logits = (torch.randn(8, 700, generator=torch.Generator().manual_seed(2)) * 4).to(dtype).to(DEV)
    specs = [SamplingSpec(temperature=t, top_k=k, top_p=p, seed=s, logprobs=True, min_p=m)
             for t, k, p, s, m in ((1.0, -1, 1.0, 1, 0.0), (0.7, -1, 1.0, 2, 0.0), (1.0, -1, 1.0, 3, 0.05),
                                   (0.0, -1, 1.0, 4, 0.0), (1.3, -1, 1.0, 5, 0.0), (1.0, -1, 1.0, 6, 0.0),
                                   (1.0, -1, 0.9, 7, 0.0), (0.8, 40, 0.95, 8, 0.0))]

    def draw():
        batch = SamplingBatch.build(specs, list(range(10, 18)), device=DEV, vocab=700)
        out = sample_on_device(logits, batch)
        return out.tokens, out.logprobs

    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    want = draw()
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "on")
    calls = []
    for name in ("lane_sum", "weights", "draw", "first_reaching"):
        kernel = getattr(_kernel(), name)
        monkeypatch.setattr(_kernel(), name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    got = draw()
    assert {"lane_sum", "weights", "draw", "first_reaching"} <= set(calls), "a Triton sampler kernel never ran"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@SLOW  # the fast tier keeps the executor's wiring (tests/test_invariant_numerics.py)
@needs_triton
def test_batch_invariant_draws_run_the_kernels_and_draw_a_row_alone_as_in_its_batch(monkeypatch):
    """Inside ``batch_invariant_draws`` (the invariant mode's sampling on CUDA) the sampler's torch path takes
    the Triton kernels without the switch, on the GPU's way (nothing read on the host): a row drawn alone gets
    the token and log-prob it gets among eight, top_p rows too; outside it, or with ``on=False``, torch's."""
    from pat_engine.sampling import host
    from pat_engine.sampling.sampler import SamplingBatch, sample_on_device
    from pat_engine.sampling.spec import SamplingSpec

    monkeypatch.setenv("PAT_CPU_SAMPLER", "torch")
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    monkeypatch.setattr(host, "reads_are_free", lambda x: False)
    logits = (torch.randn(8, 700, generator=torch.Generator().manual_seed(9)) * 4).to(DEV)
    specs = [SamplingSpec(temperature=1.0, top_k=-1, top_p=0.9 if i % 3 == 0 else 1.0, seed=40 + i, logprobs=True)
             for i in range(8)]

    def draw(rows: list[int]):
        batch = SamplingBatch.build([specs[r] for r in rows], [30 + r for r in rows], device=DEV, vocab=700)
        out = sample_on_device(logits[rows], batch)
        return out.tokens.tolist(), out.logprobs.tolist()

    calls = []
    for name in ("draw", "first_reaching"):
        kernel = getattr(_kernel(), name)
        monkeypatch.setattr(_kernel(), name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    draw([0])
    with inverse_cdf.batch_invariant_draws(False):
        draw([0])
    assert calls == []
    with inverse_cdf.batch_invariant_draws():
        together = draw(list(range(8)))
        alone = [draw([r]) for r in (0, 3, 5)]
    assert {"draw", "first_reaching"} <= set(calls)
    for (tokens, logprobs), r in zip(alone, (0, 3, 5)):
        assert tokens == [together[0][r]] and logprobs == [together[1][r]]


@pytest.mark.gpu
@gpu
@needs_triton
def test_gpu_weights_z_and_draw_at_a_real_vocabulary(monkeypatch):
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    for rows in (1, 64):
        e = _weights(rows, 128256, seed=rows)
        assert torch.equal(_kernel().lane_sum(e, Z), inverse_cdf.lane_sum(e))
        x = (torch.randn(rows, 128256, device=DEV) * 4).to(torch.bfloat16)
        it, floor = torch.full((rows,), 1 / 0.8, device=DEV), torch.full((rows,), -9.0, device=DEV)
        got, want = _kernel().weights(x, it, floor), inverse_cdf._torch_weights(x, it, floor)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        z, u = _kernel().lane_sum(e, Z), torch.rand(rows, dtype=torch.float64, device=DEV)
        drawn = _kernel().draw(e, u, z)
        chain = (e.double().cumsum(dim=-1) <= (u * z).unsqueeze(1)).sum(dim=-1)
        assert torch.equal(drawn, chain)  # no boundary rounding on these rows
        assert int(drawn[0]) == _kernel().blocked_draw_reference(e[0].double().cpu().tolist(), float(u[0] * z[0]))
        ranked, top_p = e.sort(dim=-1, descending=True).values, torch.full((rows,), 0.9, dtype=torch.float64, device=DEV)
        reached = _kernel().first_reaching(ranked, top_p, z)
        assert torch.equal(reached, (ranked.double().cumsum(dim=-1) < (top_p * z).unsqueeze(1)).sum(dim=-1))
        x[:, 5] = x.max()  # a tie with an earlier place
        assert torch.equal(_kernel().first_max(x), x.argmax(dim=-1))
