"""The GPU check's ``switch`` part (bench/gpucheck/switch.py, switch_controller.py) and bench/multi_gpu_check.py on
the CPU: the workload and its schedule, a switch's phases and graphs share, the controller's agreement with its
table, the world a multi-GPU machine runs and the message on a machine without one. The part's smoke run is
test_gpu_check.py's ``test_each_part_runs_its_smoke``; the multi-GPU script's is below (slow)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import multi_gpu_check  # noqa: E402  (bench/ is on the test path)
from gpucheck import switch, switch_controller  # noqa: E402
from gpucheck.shared import LLAMA32_1B, weight_bytes  # noqa: E402


def test_the_part_model_is_a_1b_shape():
    assert 2.4e9 < weight_bytes(LLAMA32_1B, 2) < 2.6e9  # Llama-3.2-1B: 1.24 B parameters, tied head


def test_the_workload_merges_while_all_run_and_splits_once_only_the_tail_is_left():
    for smoke in (True, False):
        w = switch.workload(smoke)
        assert w.merge_at < w.short < w.split_at < w.long
        assert w.schedule(4) == [(w.merge_at, 4), (w.split_at, 1)]
        prompts, params = w.batch(vocab=512)
        assert len(prompts) == len(params) == w.requests and all(len(p) == w.prompt for p in prompts)
        assert all(16 <= t < 511 for p in prompts for t in p)
        assert [p.max_new_tokens for p in params].count(w.long) == w.tail


def _event(seconds: float, **costs) -> SimpleNamespace:
    base = dict(drain_s=0.0, groups_s=0.0, weights_s=0.0, kv_s=0.0, graphs_s=0.0, graphs_captured=0, requests=8,
                weight_bytes_sent=0, kv_bytes_sent=0, peak_extra_bytes=0)
    return SimpleNamespace(from_layout="TP2xDP1", to_layout="TP1xDP2", kv_path="migrate", seconds=seconds,
                           costs=base | costs)


def test_a_switch_row_splits_its_seconds_into_phases_and_the_rest():
    ev = _event(2.0, drain_s=0.1, groups_s=0.05, weights_s=1.0, kv_s=0.4, graphs_s=0.15, graphs_captured=3,
                weight_bytes_sent=3 << 20)
    row = dict(zip(switch.PHASE_HEADERS, switch.phase_row("x", ev)))
    assert row["rest s"] == pytest.approx(0.3) and row["graphs share"] == "7.5%"
    assert row["weights MiB sent"] == 3 and switch.graphs_share(ev) == pytest.approx(0.075)
    assert switch.graphs_share(_event(0.0)) == 0.0


def test_memory_growth_is_reported_per_rank():
    def stats(allocated, reserved):
        return {"device_memory": {"allocated": allocated, "reserved": reserved}}

    line = switch.memory_delta([stats(1 << 20, 4 << 20)], [stats(1 << 20, 6 << 20)])
    assert line == "rank 0: allocated +0.0 MiB, reserved +2.0 MiB"
    assert switch.memory_delta([stats(None, None)], [stats(None, None)]) == "n/a (CPU)"


def _evaluation(current: int, chosen: int, stay: float, plans: dict, margin: float, **extra) -> SimpleNamespace:
    details = {"plan_s": {str(tp): t for tp, t in plans.items()}, "stay_s": stay, "margin_s": margin, **extra}
    return SimpleNamespace(stage_step=8, active=4, current_tp=current, chosen_tp=chosen, details=details)


def test_the_controller_agrees_with_its_table_when_it_switches_exactly_on_a_gain_past_the_margin():
    history = [
        _evaluation(1, 1, 1.0, {1: 1.0, 2: 1.5}, 0.02),  # staying is cheaper: stays
        _evaluation(1, 2, 1.0, {1: 1.0, 2: 0.5}, 0.02),  # switching wins by 0.5: switches
        _evaluation(1, 1, 1.0, {1: 1.0, 2: 0.99}, 0.02),  # a gain inside the margin: stays
        _evaluation(1, 1, 1.0, {1: 1.0, 2: 0.5}, 0.02, best_deferred={"plan": "x"}),  # the lookahead waits
        _evaluation(1, 1, 1.0, {1: 1.0, 2: 0.5}, 0.02),  # should have switched
    ]
    agree, rows = switch_controller.table_agreement(history)
    assert agree == 4 and [r[-1] for r in rows] == ["yes", "yes", "yes", "deferred", "NO"]


def _step(group: int, end: float, seconds: float, batch: int = 1) -> SimpleNamespace:
    return SimpleNamespace(group=group, t=end, seconds=seconds, batch_size=batch, context_tokens=100)


def test_a_step_is_alone_on_the_device_when_no_other_group_ran_for_half_of_it():
    run = [_step(0, 1.0, 1.0), _step(1, 1.2, 1.0),  # overlap 0.8 of each
           _step(0, 2.0, 1.0), _step(1, 1.5, 0.2),  # group 0's second step: 0.2 + 0.2 of it another's
           _step(0, 3.0, 1.0)]  # nothing else runs
    assert [round(f, 3) for f in switch_controller.overlapped(run)] == [0.8, 1.0, 0.4, 1.0, 0.0]

    class Table:  # predicts 10 ms at batch 1
        def step_seconds(self, tp, batch, context):
            return 0.01 * batch

    steps = [_step(0, 0.01, 0.01), _step(1, 0.0105, 0.01), _step(0, 0.03, 0.008)]  # the last one alone, 25% off
    calibrated = np.array([0.01, 0.01, 0.008])  # the calibrated predictor learned the last step's speed
    layout = switch_controller.LayoutSteps.of(Table(), 1, [steps], [calibrated], [np.full(3, 0.012)])
    e = switch_controller.step_errors(layout)
    assert e["shared"] == pytest.approx(0.0) and e["alone"] == pytest.approx(25.0) and e["alone_steps"] == 1
    assert e["mape"] == pytest.approx(25 / 3) and e["calibrated_mape"] == pytest.approx(0.0)
    assert e["drain"] == pytest.approx(0.2 / 2.8 * 100) and e["calibrated_drain"] == pytest.approx(0.8 / 2.8 * 100)


def test_the_controller_table_is_measured_on_the_co_located_deployment(tmp_path):
    ctx = SimpleNamespace(smoke=False)
    argv = switch_controller.profile_argv(ctx, tmp_path / "m", tmp_path / "t.json")
    assert argv[argv.index("--world") + 1] == "2" and argv[argv.index("--device") + 1] == "cuda"
    assert "--emulate-world" not in argv  # measured with the ranks sharing the GPU, not emulated
    prompts, lengths = switch_controller.long_tail(ctx, 128256)
    assert len(prompts) == len(lengths) and lengths.count(max(lengths)) == 3 and max(lengths) > 10 * min(lengths)


def test_a_failing_piece_of_the_part_is_reported_in_its_place():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    assert switch.apart("four ranks", broken) == ["", "**four ranks: FAILED** (RuntimeError: CUDA error: an illegal "
                                                     "memory access)"]
    assert switch.apart("fine", lambda: ["a"]) == ["a"]


def test_the_multi_gpu_world_is_a_power_of_two_up_to_eight():
    assert multi_gpu_check.world_for(0, None) is None and multi_gpu_check.world_for(1, None) is None
    assert [multi_gpu_check.world_for(n, None) for n in (2, 3, 4, 6, 8, 16)] == [2, 2, 4, 4, 8, 8]
    assert multi_gpu_check.world_for(8, 4) == 4
    for bad in (3, 16, 1):
        with pytest.raises(SystemExit, match="--world must be a power of two"):
            multi_gpu_check.world_for(8, bad)
    assert multi_gpu_check.targets(2) == [2] and multi_gpu_check.targets(8) == [2, 8]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has several GPUs")
def test_without_several_gpus_the_multi_gpu_check_says_so_and_runs_nothing(capsys):
    assert multi_gpu_check.main([]) == 2
    assert "the multi-GPU check needs 2 to 8, so nothing was run" in capsys.readouterr().err


@pytest.mark.slow
def test_the_multi_gpu_check_runs_its_smoke(tmp_path, capsys):
    assert multi_gpu_check.main(["--smoke", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SMOKE RUN" in out and "TP1xDP2 -> TP2xDP1 -> TP1xDP2" in out and "recompute" in out
