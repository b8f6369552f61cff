"""bench/gpu_check.py and its parts (bench/gpucheck/), on the CPU: the arithmetic behind every target (the
roofline and floors, prefill FLOPs, the split sweep), the kernel classifier and per-step / per-layer
counting, the report and where a smoke run may write, the registry and ``--quick``'s selection, a part
cut off by its timeout, and the timing functions at toy shapes under Triton's interpreter. The ``slow``
tests run each part's smoke in process; the ``gpu`` tests repeat the timing compiled on a device."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import gpu_check as gc  # noqa: E402  (bench/ is on the test path: pyproject's pythonpath)
from gpucheck import (attention, decode, emulated_profile, gpu_tests, kernels, prefill, registry, report,  # noqa: E402
                      step_phases)
from gpucheck.checkpoint import checkpoint_tensors, load_tensors, write_checkpoint  # noqa: E402
from gpucheck.shared import (LLAMA3_8B, datasheet_bandwidth, kv_bytes_per_token, median, roofline_ms,  # noqa: E402
                             time_interleaved, weight_bytes)
from pat_engine.model.layers.triton_attention import DecodeSplit, decode_split  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
TOY = TinyModelSpec(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_position=64, seed=5)


# ---- sizes, rooflines, floors, FLOPs ----------------------------------------------------------------------


def test_llama3_8b_weight_bytes_and_the_issues_roofline():
    params = 8_030_261_248  # Llama-3-8B's parameter count (untied head)
    assert weight_bytes(LLAMA3_8B, 2) == 2 * params
    assert kv_bytes_per_token(LLAMA3_8B, 2) == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads
    ms = roofline_ms(2 * params, 3.35e12)
    assert ms == pytest.approx(4.794, abs=1e-3)
    assert 5.99 < 1.25 * ms <= decode.BATCH1_MS_GOAL  # issue 30's 6.0 ms / token is 1.25x this roofline
    with pytest.raises(ValueError, match="llama"):
        weight_bytes(TinyModelSpec(arch="qwen2"), 2)
    tied = TinyModelSpec(hidden_size=32, vocab_size=100, tie_word_embeddings=True)
    assert weight_bytes(TinyModelSpec(hidden_size=32, vocab_size=100), 4) - weight_bytes(tied, 4) == 100 * 32 * 4


def test_datasheet_bandwidth_by_device_name():
    assert datasheet_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12  # SXM
    assert datasheet_bandwidth("NVIDIA H100 NVL")[0] == 3.9e12
    assert datasheet_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert datasheet_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert datasheet_bandwidth("Tesla T4") is None and datasheet_bandwidth(None) is None


def test_decode_floor_counts_streamed_weights_and_the_batchs_kv(tmp_path):
    ctx = _ctx(tmp_path, [])
    ctx.args.smoke = False  # the 8B shape
    s = decode.Shape(64, 2048, 64, eager=False)
    streamed = 2 * 8_030_261_248 - 128256 * 4096 * 2  # the embedding table is gathered by row
    kv = 64 * (2048 + 32) * 131072
    assert decode.floor_ms(ctx, s, 3.0e12) == pytest.approx((streamed + kv) / 3.0e12 * 1e3)
    ctx.args.quick = True
    quick = decode.shapes(ctx)
    assert not any(r.eager for r in quick)  # one engine in --quick
    assert {(r.batch, r.prompt) for r in quick} >= {(1, 64), (64, 512), (64, 2048)}
    assert [(r.batch, r.prompt) for r in quick if r.sampled] == [(64, 512)]  # the RL draw beside its greedy row
    ctx.args.quick = False
    assert {(r.batch, r.prompt) for r in decode.shapes(ctx) if r.eager} == {(1, 64), (16, 64), (64, 64)}


def test_prefill_flops_count_the_products_the_head_and_causal_attention():
    f = prefill.prefill_flops(LLAMA3_8B, [4096] * 8)
    non_embedding = 8_030_261_248 - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096  # less embedding, head and norms
    assert f.matmul == 2 * non_embedding * 8 * 4096 + 2 * 128256 * 4096 * 8  # + the head on 8 sampled rows
    # causal attention brute force on a toy: every (query, key <= query) pair, QK^T and PV, 2 FLOPs per MAC
    spec = TinyModelSpec(arch="llama", hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=3)
    pairs = sum(1 for n in (5, 3) for q in range(n) for k in range(n) if k <= q)
    assert prefill.prefill_flops(spec, [5, 3]).attention == 2 * 2 * 8 * 4 * 3 * pairs  # head_dim 8, 4 heads, 3 layers
    assert 0.06 < f.attention / f.total < 0.09  # at 4K: ~4 hd H L n/2 = 1.1 GFLOP a token beside 14 GFLOP of products


def test_split_sweep_keeps_whole_chunks_and_the_rules_count():
    assert attention.sweep(512, 64, attention.SPLITS, 4) == [1, 2, 4, 8]  # 8 chunks of 64 tokens: at most 8 splits
    assert attention.sweep(32768, 64, (1, 2, 4), 33) == [1, 2, 4, 33]
    assert attention.kv_bytes(64, 512, attention.Geometry()) == 64 * 512 * 8 * 128 * 2 * 2


def test_the_rule_splits_the_tail_shapes_on_an_h100():
    """What the attention part times on an H100 SXM (132 SMs, 8 KV heads): the rule's split counts at 3
    programs per SM (the measured sweep: the batch shapes keep one split, the tail ones fill the device)."""
    assert decode_split(2, 8, 16384, 132, "fast") == DecodeSplit(None, 25)  # 16 programs -> 400 >= 396
    assert decode_split(8, 8, 4096, 132, "fast") == DecodeSplit(None, 7)
    assert decode_split(64, 8, 512, 132, "fast") == DecodeSplit(None, 1)
    assert decode_split(64, 8, 2048, 132, "fast") == DecodeSplit(None, 1)
    assert decode_split(256, 8, 1024, 132, "fast") == DecodeSplit(None, 1)


# ---- the kernel table -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, piece", [
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMM"),
    ("_decode_partial_kernel", "attention"), ("_decode_reduce_kernel", "attention"),
    ("_varlen_prefill_kernel", "attention"), ("_rms_norm_kernel", "norm"), ("_rotary_kv_kernel", "rotary/KV write"),
    ("_silu_mul_kernel", "activation"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda>", "norm"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<>>", "rotary/KV write"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"), ("mkldnn::_linear_pointwise", "GEMM"),
    ("pat_kernels::paged_decode_attention_cpu", "attention"), ("_skinny_matmul_kernel", "GEMM"),
    ("_skinny_reduce_kernel", "GEMM"), ("_matmul_kernel", "GEMM"),
])
def test_kernels_are_classified_by_name(name, piece):
    assert kernels.classify(name) == piece


def test_kernel_table_counts_per_step_and_per_layer():
    R = kernels.KernelRecord
    step = [R("nvjet_a", 10.0, True, True), R("nvjet_a", 10.0, True, True),
            R("_decode_partial_kernel", 5.0, True, True), R("_rms_norm_kernel", 1.0, True, True),
            R("_rms_norm_kernel", 1.0, True, False), R("Memcpy HtoD", 2.0, True, False)]  # the final norm, the inputs
    outside = [R("nvjet_a", 99.0, False, False)]  # the prefill, before the profiled steps
    t = kernels.kernel_table(step * 2 + outside, steps=2, layers=4)  # 2 steps of a 2-layer model
    assert t.per_step == 6 and t.per_layer == 2.0 and t.ms_per_step == pytest.approx(0.029)
    assert t.by_piece["GEMM"] == (2, 0.02, 1.0)
    assert t.by_piece["norm"] == (2, 0.002, 0.5) and t.by_piece["other"][0] == 1
    assert t.top[0] == ("nvjet_a", "GEMM", pytest.approx(0.02), 2)
    with pytest.raises(ValueError):
        kernels.kernel_table(step, steps=0, layers=0)


def test_a_cpu_profile_charges_ops_to_steps_and_layers():
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.relu(x)  # outside every step
        for _ in range(2):
            with record_function(kernels.STEP):
                torch.sigmoid(x)
                for _ in range(3):
                    with record_function(kernels.LAYER):
                        torch.mm(x, x)
                        torch.nn.functional.silu(x)
    records, steps, layers, unlinked = kernels.profiled_records(prof.events(), cuda=False)
    t = kernels.kernel_table(records, steps, layers)
    assert (steps, layers, unlinked) == (2, 6, 0)
    assert t.per_step == 7 and t.per_layer == 2  # sigmoid + 3 x (mm, silu); aten::mm's inner ops are not counted
    assert t.by_piece["GEMM"][2] == 1 and t.by_piece["activation"][2] == 1


def test_a_cuda_profile_charges_each_kernel_to_the_range_it_ran_in():
    """The GPU branch on stand-ins for torch.profiler's events: a device event counts for the step and the
    layer whose CPU range holds its start (the profiled steps synchronise at each range's end); a Triton
    kernel, which torch links to no op, counts like any other."""
    from types import SimpleNamespace

    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def span(a, b):
        return SimpleNamespace(start=a, end=b, elapsed_us=lambda: b - a)

    def cpu(name, a, b, annotation=False):
        return SimpleNamespace(name=name, cpu_parent=None, is_user_annotation=annotation, device_type=CPU,
                               time_range=span(a, b))

    def gpu(name, a, b):
        return SimpleNamespace(name=name, cpu_parent=None, is_user_annotation=False, device_type=CUDA,
                               time_range=span(a, b))

    events = [cpu(kernels.STEP, 0, 100, True), cpu(kernels.LAYER, 10, 50, True), cpu("aten::mm", 12, 14),
              gpu("nvjet_x", 15, 25), gpu("_rotary_kv_kernel", 30, 32),  # in the layer
              gpu("_rms_norm_kernel", 60, 61), gpu("Memcpy HtoD", 90, 91),  # in the step, after the layer
              gpu(kernels.LAYER, 15, 45),  # a range's GPU shadow: not a kernel
              gpu("nvjet_prefill", 120, 220)]  # before or after the profiled steps
    records, steps, layers, outside = kernels.profiled_records(events, cuda=True)
    assert (steps, layers, outside) == (1, 1, 1)
    assert [(r.name, r.in_step, r.in_layer) for r in records] == [
        ("nvjet_x", True, True), ("_rotary_kv_kernel", True, True), ("_rms_norm_kernel", True, False),
        ("Memcpy HtoD", True, False), ("nvjet_prefill", False, False)]
    t = kernels.kernel_table(records, steps, layers)
    assert t.per_step == 4 and t.per_layer == 2 and t.ms_per_step == pytest.approx(0.014)


# ---- report, registry, driver -------------------------------------------------------------------------


def _section(part: str, command: str, date: str, status: str = "ok", headlines=()) -> report.Section:
    return report.Section(part, registry.part(part).title, f"body of {part}", status, 1.5, command, date, "box",
                          list(headlines))


def test_report_keeps_the_registry_order_headlines_and_earlier_runs():
    sections = {"tests": _section("tests", "now", "d1", "failed", ["FAILED: x"]),
                "decode": _section("decode", "earlier", "d0", headlines=["**batch 1: 9 ms: NOT met**"]),
                "attention": _section("attention", "now", "d1")}
    text = report.render_report(sections, "now", "box", "d1", smoke=True, quick=True, environment="torch x")
    assert text.index("## 1. Decode attention") < text.index("## 2. TP1 decode") < text.index("## 3. gpu-marked")
    assert "SMOKE RUN" in text and "- environment: torch x" in text and "- command: `now`" in text
    assert "_From `earlier` at d0 on box._" in text and text.count("_From") == 1
    assert "| 3. gpu-marked tests | failed | 2 | ~170 | this command |" in text  # its --quick selections
    assert "- decode: **batch 1: 9 ms: NOT met**" in text and "- tests: FAILED: x" in text
    assert "SMOKE" not in report.render_report(sections, "now", "box", "d1", smoke=False)


def test_sections_survive_the_sidecar(tmp_path):
    out = tmp_path / "r.md"
    sections = {"decode": _section("decode", "c", "d", headlines=["h"])}
    sections["decode"].data = {"rows": [{"batch": 1, "step_ms": 9.2}]}
    report.save_sections(out, sections)
    assert report.load_sections(out) == sections
    assert report.load_sections(tmp_path / "none.md") == {}
    old = {"part": "decode", "title": "t", "body": "b", "status": "ok", "seconds": 1.0, "command": "c", "date": "d",
           "machine": "m"}  # a sidecar from before headlines and data
    assert report.Section.from_dict(old).headlines == []


def test_a_smoke_run_never_writes_the_results_file(tmp_path):
    real = report.RESULTS / "gpu_check.md"
    args = gc.parse_args([])
    assert report.results_path(args.output, args.smoke, args.workdir) == real
    smoke = report.results_path(None, True, str(tmp_path))
    assert smoke.parent == tmp_path and smoke.resolve() != real.resolve()
    with pytest.raises(SystemExit, match="never writes"):
        report.results_path(str(real), True, str(tmp_path))


def test_the_registry_and_quicks_selection():
    assert len(set(registry.NAMES)) == len(registry.PARTS)
    for p in registry.PARTS:
        assert callable(p.runner()) and p.quick_timeout_s > 0 and p.full_timeout_s > 0
    quick = [p.name for p in gc.selected(gc.parse_args(["--quick"]))]
    # the headlines and the tests part (gpu_tests.QUICK); not graphs, weightsync, invariant
    assert quick == ["attention", "gemm", "sampler", "kernels", "prefill", "decode", "profile", "switch", "tests"]
    planned = sum(registry.part(n).quick_s for n in quick) + registry.CHECKPOINT_S
    assert planned <= gc.QUICK_BUDGET_S - 40  # ~8 min planned, inside the budget the device tool allows
    assert registry.part("controller").quick_s is None  # its own part, run by the second command
    assert [p.name for p in gc.selected(gc.parse_args(["--only", "tests", "attention"]))] == ["attention", "tests"]
    assert len(gc.selected(gc.parse_args([]))) == len(registry.PARTS)
    with pytest.raises(KeyError):
        registry.part("splitkv")


def test_a_part_expected_to_outlast_the_budget_is_skipped(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(gc, "execute", lambda name, args: ran.append(name) or
                        {"status": "ok", "body": "b", "headlines": [], "data": {}})
    monkeypatch.setattr(gc, "describe_machine", lambda smoke: {"machine": "m", "environment": "e", "gpu": "g"})
    out = tmp_path / "r.md"
    # attention is expected to take 30 s (full), gemm 90: a budget of 60 s starts the first, skips the second
    assert gc.main(["--in-process", "--only", "attention", "gemm", "--budget-s", "60", "--output", str(out),
                    "--workdir", str(tmp_path)]) == 0
    assert ran == ["attention"]
    assert re.search(r"skipped: \d+ s of the run's time budget \(--budget-s 60\) were left, the part is expected to "
                     r"take 90 s", out.read_text())


@pytest.mark.slow  # processes
def test_ending_a_part_ends_every_process_of_its_group():
    """A part's engine workers outlive its process and hold device memory: the whole group is ended, a member
    that ignores SIGTERM included, though the leader has already exited."""
    import subprocess

    proc = subprocess.Popen(["sh", "-c", "(trap '' TERM; exec sleep 60) & exit 0"], start_new_session=True)
    proc.wait(timeout=10)
    os.killpg(proc.pid, 0)  # the sleep is still in the group
    gc._end_group(proc, term_wait=0.5, kill_wait=5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_a_part_cut_off_by_its_timeout_is_recorded_as_failed(tmp_path):
    args = gc.parse_args(["--smoke", "--workdir", str(tmp_path)])
    res = gc.in_child("tests", ["--smoke", "--workdir", str(tmp_path)], args, timeout=0.5)
    assert res["status"] == "failed" and "timed out after 0 s" in res["body"]
    assert (tmp_path / "logs" / "tests.log").is_file() and not (tmp_path / "logs" / "tests.json").exists()


def test_pytest_summary_line_and_the_gpu_test_files():
    out = "....s\n=========== 4 passed, 1 skipped, 20 deselected in 3.10s ===========\n"
    assert gpu_tests.pytest_summary(out) == "4 passed, 1 skipped, 20 deselected in 3.10s"
    assert gpu_tests.pytest_summary("x\n1 failed, 2 passed in 1.0s\n") == "1 failed, 2 passed in 1.0s"
    assert gpu_tests.pytest_summary("collected 0 items\n\nno tests ran in 0.01s\n") == "no tests ran in 0.01s"
    assert gpu_tests.pytest_summary("") == "(no output)"
    stopped = ("tests/a.py::test_x PASSED [ 10%]\ntests/a.py::test_y[f32] FAILED [ 20%]\n"
               "tests/a.py::test_z[bf16] PASSED [ 30%]\ntests/b.py::test_slow ")
    assert gpu_tests.outcomes_so_far(stopped) == "2 passed, 1 failed; last started: tests/b.py::test_slow"
    assert gpu_tests.outcomes_so_far("") == "none finished"
    files = [p.name for p in gpu_tests.gpu_test_files(Path(gc.__file__).resolve().parent.parent / "tests")]
    assert "test_triton_kernel.py" in files and "test_gpu_check.py" in files and "test_sampler.py" not in files


@pytest.mark.slow  # processes
def test_a_gpu_test_files_failures_are_printed_as_they_happen(tmp_path):
    """The second H100 run lost two failures' messages: pytest prints them in its final summary, which a
    run stopped at its limit never reaches. They are printed when they happen now, before the summary."""
    (tmp_path / "test_two.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_fails():\n    assert 1 + 1 == 3, 'the message kept'\n\n"
        "@pytest.mark.gpu\ndef test_passes():\n    pass\n")
    code, out, _ = gpu_tests.run_file(str(tmp_path / "test_two.py"), 120.0, tmp_path / "log.txt")
    assert code == 1 and "the message kept" in out.split("= FAILURES =")[0]
    assert gpu_tests.pytest_summary(out).startswith("1 failed, 1 passed")


def test_the_emulated_profile_grids_hold_every_batch_and_context_they_name():
    """pat-profile's default KV budget dropped 64 x 2048 from the quick grid (the decode part's row), so the
    third H100 run's predictor had no knot there and erred by -40%."""
    from pat_profiler.cli import parse_args
    from pat_profiler.grid import build_grid
    from gpucheck.shared import Ctx

    for quick in (True, False):
        args = parse_args(["--model", "m", "--output", "t.json",
                           *emulated_profile.grid(Ctx(gc.parse_args(["--quick"] if quick else []), {}))])
        points = {(p.batch, p.context) for p in build_grid(args.tp, args.batch_sizes, args.context_lens,
                                                              args.decode_window, args.kv_budget_tokens, 131072, 256)}
        assert points == {(b, c) for b in args.batch_sizes for c in args.context_lens}, quick


def test_emulated_profile_helpers():
    assert emulated_profile.falls_with_tp({1: 9.0, 2: 6.0, 4: 4.5, 8: 4.0})
    assert not emulated_profile.falls_with_tp({1: 9.0, 2: 6.0, 4: 6.5, 8: 4.0})
    assert not emulated_profile.falls_with_tp({1: 9.0})
    line = emulated_profile.graphs_line({"backend": "cuda", "per_tp": {"8": {"captures": 2, "capture_s_per_size": 0.05,
                                                                             "replays": 10, "eager_decodes": 0},
                                                                       "2": {"captures": 2, "capture_s_per_size": 0.06,
                                                                             "replays": 10, "eager_decodes": 0}}})
    assert line.startswith("cuda; TP2: 2 captured (60 ms each)") and "TP8" in line
    assert "not recorded" in emulated_profile.graphs_line(None)


def test_the_emulated_table_splits_into_measured_steps_and_modelled_collectives():
    from types import SimpleNamespace

    from pat_engine.predictor.table import ProfilePoint
    from pat_profiler.emulate import CollectiveModel

    arch = SimpleNamespace(num_layers=32, hidden_size=4096, vocab_size=128256)
    ring = CollectiveModel(150e9, 8e-6)
    measured = {1: 0.009, 8: 0.002}
    table = SimpleNamespace(
        deployment=SimpleNamespace(collective_model={"kind": "ring", "link_bandwidth": 150e9, "latency_s": 8e-6}),
        model=SimpleNamespace(elt_bytes=2), tps=lambda: [1, 8],
        points=[ProfilePoint(tp, 1, 512, 520.0, 0.1, s + ring.forward_s(arch, tp, 1, 1, 2))
                for tp, s in measured.items()])
    split = emulated_profile.per_rank_ms(table, arch)
    assert split[(1, 512)][1] == (pytest.approx(9.0), 0.0)
    assert split[(1, 512)][8] == (pytest.approx(2.0), pytest.approx(ring.forward_s(arch, 8, 1, 1, 2) * 1e3))
    assert "at TP8 the hops alone charge 7.3 ms a step" in emulated_profile.collective_line(table, 32)  # 65 x 14 x 8 us


# ---- checkpoint and timers ----------------------------------------------------------------------------


def test_checkpoint_holds_the_bytes_the_roofline_counts(tmp_path):
    from safetensors import safe_open

    from pat_engine.model.arch import load_model_arch

    path = write_checkpoint(tmp_path / "m", TOY, torch.bfloat16, "cpu")
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == TOY.num_layers + 2  # embedding, one per layer, norm + head
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                x = h.get_tensor(name)
                assert x.dtype == torch.bfloat16 and torch.isfinite(x.float()).all()
                total += x.numel() * x.element_size()
    assert total == weight_bytes(TOY, 2)
    arch = load_model_arch(str(path))
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (2, 32, 96)
    stamp = [f.stat().st_mtime_ns for f in files]
    assert write_checkpoint(path, TOY, torch.bfloat16, "cpu") == path  # same spec: reused, not rewritten
    assert [f.stat().st_mtime_ns for f in files] == stamp
    first = checkpoint_tensors(path, limit_bytes=1)  # the budget is reached after the first tensor
    assert [n for _, n in first] == ["model.embed_tokens.weight"]
    (name, x), = load_tensors(first)
    assert x.shape == (96, 32)


def test_time_interleaved_rotates_the_order_and_counts_each_call():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = time_interleaved(fns, repeats=3, warmup=1, device="cpu")
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")  # warm-up, then each order in turn
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    assert median([3.0, 1.0, 2.0]) == 2.0


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case; the gpu test below runs compiled")
def test_decode_attention_timing_at_a_toy_shape_under_the_interpreter():
    g = attention.Geometry(heads=2, kv_heads=1, head_dim=16, page=16, block_n=16)
    r = attention.decode_case(2, 48, g, (1, 2), sm_count=132, device="cpu", repeats=1, warmup=0)
    assert r["rule"] == 1 and r["splits"] == [1, 2]  # the rule splits nothing this short; the sweep adds 2
    assert r["max_abs_diff"] < 2e-2  # every split computes SDPA's attention (bf16)
    assert r["kv_bytes"] == 2 * 48 * 1 * 16 * 2 * 2  # seqs x tokens x KV heads x dim x (K, V) x bf16
    assert r["gbps"][r["best"]] == max(r["gbps"].values())
    assert r["sdpa_gbps"] == pytest.approx(r["kv_bytes"] / r["sdpa_s"] / 1e9)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case")
def test_fused_layer_kernels_equal_the_torch_path_under_the_interpreter():
    rows = attention.layer_kernel_cases(2, 32, 48, attention.SMOKE_GEOMETRY, "cpu", repeats=1, warmup=0)
    assert [r[0] for r in rows] == ["add + RMSNorm", "SiLU-mul", "rotary + KV write"]
    assert all(r[-1] is True for r in rows)  # equal bits


# ---- each part's smoke, in process (slow: engines, the profiler subprocess, the interpreter) -------------


def _ctx(tmp_path, only: list[str]):
    from gpucheck.shared import Ctx

    return Ctx(gc.parse_args(["--smoke", "--workdir", str(tmp_path), *(["--only", *only] if only else [])]), {})


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in registry.PARTS if p.name != "tests"])
def test_each_part_runs_its_smoke(name, tmp_path):
    res = gc.execute(name, gc.parse_args(["--smoke", "--workdir", str(tmp_path)]))
    assert res["status"] == "ok", res["body"]
    assert res["body"].strip() and isinstance(res["headlines"], list)


@needs_triton
def test_the_gemm_sweep_drops_the_configs_the_device_refuses():
    from triton.runtime.errors import OutOfResources

    from gpucheck import skinny_gemm

    def refused():
        raise OutOfResources(262144, 232448, "shared memory")

    fns = {"cublas": lambda: 0, "rule": refused, "32x256/1": lambda: 0, "64x256/1": refused}
    assert skinny_gemm.drop_unlaunchable(fns) == ["64x256/1"]
    assert list(fns) == ["cublas", "rule", "32x256/1"]  # the engine's own config stays: its failure is the part's


def test_a_sequence_refuses_a_decode_past_its_blocks():
    from gpucheck.executor import Sequences

    seqs = Sequences(None, [[1] * 16], room=2)  # 18 tokens: two blocks of 16
    assert seqs.capacity == 32
    seqs.lengths = [32]
    with pytest.raises(RuntimeError, match="past the 32 tokens"):
        seqs.decode()


@pytest.mark.slow
@needs_triton
def test_the_kernels_part_plans_room_for_every_decode_it_runs(tmp_path, monkeypatch):
    """Graphs, eager and the variants' graphs (the interpreter serves the skinny GEMM here), each with its
    warm-ups, and both profiles: the plan counts them all (one that forgot the skinny mode ran past its
    blocks on the GPU)."""
    from gpucheck import executor

    ctx = _ctx(tmp_path, ["kernels"])
    p = kernels.plan(ctx)
    ex = kernels.build_executor(ctx, p)
    decodes = []
    inner = executor.Sequences.decode
    monkeypatch.setattr(executor.Sequences, "decode", lambda self: decodes.append(1) or inner(self))
    r = kernels.measure_batch(ctx, ex, 1, p)
    ran = {name for name, v in kernels.VARIANTS.items() if kernels.runs(v, ex, 1)}
    assert set(r["variants"]) == ran >= {"cuBLAS GEMMs", "skinny GEMMs"}
    skipped = len(kernels.VARIANTS) - len(ran)  # here: the fused reduce (the CPU's attention is torch's)
    assert len(decodes) == p.steps - skipped * (2 + p.rounds * p.block)
    assert r["phases"].wall_ms > 0 and set(r["phases"].phase_ms) == set(step_phases.PHASES)
    assert "PDL" not in ran  # the CPU never launches with it; on an sm_90 GPU the variant asks the executor:
    with executor.step_variant(ex, ex.graphs, pdl=True):
        assert ex.pdl
    assert not ex.pdl


@pytest.mark.slow
@needs_triton
def test_a_variant_that_fails_its_warm_up_is_left_out_and_named_not_the_part(tmp_path, monkeypatch):
    """A launch the device's software refuses (a PDL launch on a Triton without it, say) costs its variant
    only: the others are timed and the section names the one left out."""
    from gpucheck import executor

    ctx = _ctx(tmp_path, ["kernels"])
    p = kernels.plan(ctx)
    ex = kernels.build_executor(ctx, p)
    monkeypatch.setattr(kernels, "VARIANTS", {"cuBLAS GEMMs": kernels.VARIANTS["cuBLAS GEMMs"],
                                              "refused": kernels.Variant("PAT_SKINNY_GEMM=1", skinny_rows=1)})
    variant = executor.step_variant

    def refusing(ex, graphs, **settings):
        if settings["skinny_rows"] == 1:
            raise RuntimeError("launch option refused")
        return variant(ex, graphs, **settings)

    monkeypatch.setattr(executor, "step_variant", refusing)
    r = kernels.measure_batch(ctx, ex, 1, p)
    assert set(r["variants"]) == {"cuBLAS GEMMs"} and "launch option refused" in r["refused"]["refused"]
    assert "refused: `RuntimeError: launch option refused`" in kernels.render(r, cuda=False)
    assert "refused FAILED in its warm-up" in kernels.headline(r, cuda=False)


@pytest.mark.slow
def test_the_driver_writes_a_report_of_isolated_parts(tmp_path):
    out = tmp_path / "r.md"
    assert gc.main(["--smoke", "--only", "prefill", "--workdir", str(tmp_path), "--output", str(out)]) == 0
    text = out.read_text()
    assert "| 1. Packed varlen prefill" in text and "| ok |" in text
    assert "- checkpoint: `" in text  # written in its own step before prefill, the first part that needs it
    assert (tmp_path / "logs" / "prefill.log").is_file() and (tmp_path / "logs" / "checkpoint.log").is_file()
    assert set(report.load_sections(out)) == {"prefill"}


# ---- on a GPU (the tests part runs these) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_timing_layer_kernels_and_bandwidth_on_the_gpu():
    from gpucheck.shared import measure_copy_bandwidth

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    r = attention.decode_case(2, 4096, attention.Geometry(), (1, 8), sm, "cuda", repeats=5, warmup=1)
    assert r["max_abs_diff"] < 2e-2 and r["sdpa_s"] > 0 and all(v > 0 for v in r["gbps"].values())
    rows = {r[0]: r for r in attention.layer_kernel_cases(4, 4096, 14336, attention.Geometry(), "cuda", 3, 1)}
    # elementwise contracts: torch's bits, compiled too (the norm's one float32 sum may differ in order: reported)
    assert rows["SiLU-mul"][-1] is True and rows["rotary + KV write"][-1] is True, rows
    assert all(r[2] > 0 and r[3] > 0 for r in rows.values())
    bw = measure_copy_bandwidth("cuda", 256 << 20, repeats=5)
    assert 1e11 < bw < 2e13  # between 100 GB/s and 20 TB/s: a copy was timed, in bytes per second


def test_a_failing_candidate_engine_costs_its_own_rows_only():
    """The decode part's candidate engine runs settings no GPU has run yet: its first failure is kept, the
    engine shut down, and every later call on it skipped, so the default rows beside it are still reported."""
    class FakeEngine:
        down = False

        def shutdown(self):
            self.down = True

    engines: dict = {}
    candidate = decode.Candidate(engines)
    before = os.environ.get("PAT_PDL")
    engine = candidate.attempt(lambda: FakeEngine() if os.environ["PAT_PDL"] == "on" else None, {"PAT_PDL": "on"})
    assert isinstance(engine, FakeEngine) and engines["candidate"] is engine and candidate.attempt(lambda: 3) == 3
    assert os.environ.get("PAT_PDL") == before  # the settings held for the start only

    def refused():
        raise RuntimeError("launch refused")

    assert candidate.attempt(refused) is None
    assert candidate.error == "RuntimeError: launch refused" and engine.down and "candidate" not in engines
    assert candidate.attempt(lambda: 3) is None  # nothing runs on it after its failure
