"""bench/gpu_check.py's own arithmetic and helpers, fast, on the CPU: the roofline and the weight bytes
it divides (checked against a checkpoint the script writes), the datasheet lookup, the interleaved
timer, the report assembly, where a smoke run may write, and the split-KV timing function at a toy
shape under Triton's interpreter. The ``gpu`` tests repeat the timing on a real device."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import gpu_check as gc  # noqa: E402  (bench/ is on the test path: pyproject's pythonpath)
from pat_engine.model.layers.triton_attention import DecodeSplit, decode_split  # noqa: E402
from pat_engine.tiny_model import TinyModelSpec  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
TOY = TinyModelSpec(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_position=64, seed=5)


def test_llama3_8b_weight_bytes_and_the_issues_roofline():
    params = 8_030_261_248  # Llama-3-8B's parameter count (untied head)
    assert gc.weight_bytes(gc.LLAMA3_8B, 2) == 2 * params
    assert gc.kv_bytes_per_token(gc.LLAMA3_8B, 2) == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads
    ms = gc.roofline_ms(2 * params, 3.35e12)
    assert ms == pytest.approx(2 * params / 3.35e12 * 1e3) and ms == pytest.approx(4.794, abs=1e-3)
    assert 5.99 < gc.ROOFLINE_GOAL * ms <= 6.0  # issue 23's "at most 6.0 ms per token on an H100"
    assert gc.roofline_ms(2 * params, 4.8e12) == pytest.approx(3.346, abs=1e-3)  # H200
    with pytest.raises(ValueError, match="llama"):
        gc.weight_bytes(TinyModelSpec(arch="qwen2"), 2)
    tied = TinyModelSpec(hidden_size=32, vocab_size=100, tie_word_embeddings=True)
    assert gc.weight_bytes(TinyModelSpec(hidden_size=32, vocab_size=100), 4) - gc.weight_bytes(tied, 4) == 100 * 32 * 4


def test_datasheet_bandwidth_by_device_name():
    assert gc.datasheet_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12  # SXM
    assert gc.datasheet_bandwidth("NVIDIA H100 NVL")[0] == 3.9e12
    assert gc.datasheet_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert gc.datasheet_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert gc.datasheet_bandwidth("Tesla T4") is None and gc.datasheet_bandwidth(None) is None


def test_checkpoint_holds_the_bytes_the_roofline_counts(tmp_path):
    from safetensors import safe_open

    from pat_engine.model.arch import load_model_arch

    path = gc.write_checkpoint(tmp_path / "m", TOY, torch.bfloat16, "cpu")
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == TOY.num_layers + 2  # embedding, one per layer, norm + head
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                x = h.get_tensor(name)
                assert x.dtype == torch.bfloat16 and torch.isfinite(x.float()).all()
                total += x.numel() * x.element_size()
    assert total == gc.weight_bytes(TOY, 2)
    arch = load_model_arch(str(path))
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (2, 32, 96)
    stamp = [f.stat().st_mtime_ns for f in files]
    assert gc.write_checkpoint(path, TOY, torch.bfloat16, "cpu") == path  # same spec: reused, not rewritten
    assert [f.stat().st_mtime_ns for f in files] == stamp
    first = gc.checkpoint_tensors(path, limit_bytes=1)  # the budget is reached after the first tensor
    assert [n for _, n in first] == ["model.embed_tokens.weight"]
    (name, x), = gc.load_tensors(first)
    assert x.shape == (96, 32)


def test_time_interleaved_rotates_the_order_and_counts_each_call():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = gc.time_interleaved(fns, repeats=3, warmup=1, device="cpu")
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")  # warm-up, then each order in turn
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    assert gc.median([3.0, 1.0, 2.0]) == 2.0


def test_pytest_summary_line():
    out = "....s\n=========== 4 passed, 1 skipped, 20 deselected in 3.10s ===========\n"
    assert gc.pytest_summary(out) == "4 passed, 1 skipped, 20 deselected in 3.10s"
    assert gc.pytest_summary("x\n1 failed, 2 passed in 1.0s\n") == "1 failed, 2 passed in 1.0s"
    assert gc.pytest_summary("collected 0 items\n\nno tests ran in 0.01s\n") == "no tests ran in 0.01s"
    assert gc.pytest_summary("") == "(no output)"
    root = Path(gc.__file__).resolve().parent.parent / "tests"
    files = [p.name for p in gc.gpu_test_files(root)]
    assert "test_triton_kernel.py" in files and "test_gpu_check.py" in files and "test_sampler.py" not in files


def test_report_puts_parts_in_the_issues_order_and_names_earlier_runs():
    def sec(part: str, command: str, date: str, status: str = "ok") -> gc.Section:
        return gc.Section(part, gc.TITLES[part], f"body of {part}", status, 1.5, command, date, "box")

    sections = {"tests": sec("tests", "now", "d1", "failed"), "decode": sec("decode", "earlier", "d0")}
    text = gc.render_report(sections, "now", "box", "d1", smoke=True, environment="torch x")
    assert text.index("## 1. TP1 decode") < text.index("## 6. gpu-marked tests")
    assert "SMOKE RUN" in text and "- environment: torch x" in text and "- command: `now`" in text
    assert "_From `earlier` at d0 on box._" in text and text.count("_From") == 1  # the part this run did not redo
    assert "| 6. gpu-marked tests | failed | 2 | this command |" in text
    assert "SMOKE" not in gc.render_report(sections, "now", "box", "d1", smoke=False)


def test_a_smoke_run_never_writes_the_results_file(tmp_path):
    real = gc.RESULTS / "gpu_check.md"
    assert gc.results_path(gc.parse_args([])) == real
    smoke = gc.results_path(gc.parse_args(["--smoke", "--workdir", str(tmp_path)]))
    assert smoke.parent == tmp_path and smoke.resolve() != real.resolve()
    with pytest.raises(SystemExit, match="never writes"):
        gc.results_path(gc.parse_args(["--smoke", "--output", str(real)]))
    args = gc.parse_args(["--only", "splitkv", "tests", "--smoke"])
    assert args.only == ["splitkv", "tests"] and args.smoke


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case; the gpu test below runs compiled")
def test_split_kv_timing_at_a_toy_shape_under_the_interpreter():
    r = gc.split_kv_case(2, 32, heads=2, kv_heads=1, head_dim=16, device="cpu", repeats=1, warmup=0,
                         num_splits=2, block_n=16)
    assert r["rule_splits"] == 1  # decode_split splits nothing this short: the case forces 2
    assert r["splits"] == 2
    assert r["max_abs_diff"] < 2e-2  # both kernels compute the same attention (bf16)
    assert r["kv_bytes"] == 2 * 32 * 1 * 16 * 2 * 2  # seqs x tokens x KV heads x dim x (K, V) x bf16
    assert r["speedup"] == pytest.approx(r["one_s"] / r["split_s"])
    assert r["split_gbps"] == pytest.approx(r["kv_bytes"] / r["split_s"] / 1e9)
    with pytest.raises(ValueError, match="one program"):
        gc.split_kv_case(2, 32, heads=2, kv_heads=1, head_dim=16, device="cpu", repeats=1, warmup=0)


def test_the_tail_shapes_split_on_an_h100():
    """What part 3 times on an H100 SXM (132 SMs): the rule splits both tail shapes (8 KV heads)."""
    assert decode_split(2, 8, 16384, 132, "fast") == DecodeSplit(None, 33)  # 16 programs -> 528
    assert decode_split(8, 8, 4096, 132, "fast") == DecodeSplit(None, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_kv_timing_and_copy_bandwidth_on_the_gpu():
    r = gc.split_kv_case(2, 4096, device="cuda", repeats=5, warmup=1)
    assert r["splits"] == r["rule_splits"] and r["splits"] >= 2
    assert r["max_abs_diff"] < 2e-2 and r["one_s"] > 0 and r["split_s"] > 0
    bw = gc.measure_copy_bandwidth("cuda", 256 << 20, repeats=5)
    assert 1e11 < bw < 2e13  # between 100 GB/s and 20 TB/s: a copy was timed, in bytes per second
