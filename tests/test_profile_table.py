"""The profile table: file format, the deployment check (alone and inside Engine), and short pat-profile runs."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from pat_engine import Engine, SamplingParams
from pat_engine.config import EngineConfig
from pat_engine.model.arch import load_model_arch
from longtail.analytic import analytic_table
from pat_engine.predictor.controller import SwitchController
from pat_engine.predictor.deployment import make_deployment, model_shape
from pat_engine.predictor.policy import StaticLayout
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ProfileTable, ProfileTableError, check_deployment
from pat_engine.predictor.table import ProfilePoint
from pat_profiler import cli
from pat_profiler.grid import build_grid
from pat_profiler.profile import ProfileOptions, run_profile


def table_for(model: str, world: int, dtype: str = "float32", tps=(1, 2)) -> ProfileTable:
    """A synthetic table whose deployment matches an engine on this machine."""
    cfg = EngineConfig(model=model, tp=1, dp=world, dtype=dtype)
    arch = load_model_arch(model)
    dep = make_deployment(arch, model, cfg.torch_dtype(), "cpu", world, cfg.block_size, cfg.worker_threads(), list(tps))
    return analytic_table(dep, model_shape(arch, cfg.torch_dtype()), lambda tp, b, t: 0.01 / tp + 1e-3 * b,
                          lambda tp, b, l: 1e-5 * b * l, (1, 4), (16, 64), 1e9, [], "test")


def test_round_trip_and_version_check(model_dir, tmp_path):
    table = table_for(model_dir("llama"), 2)
    path = tmp_path / "t.json"
    table.save(path)
    again = ProfileTable.load(path)
    assert again.to_dict() == table.to_dict()
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileTableError, match="version 99"):
        ProfileTable.load(path)
    path.write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(ProfileTableError, match="not a pat-profile table"):
        ProfileTable.load(path)


def test_deployment_check_names_the_differing_fields(model_dir, caplog):
    table = table_for(model_dir("llama"), 2)
    other = dataclasses.replace(table.deployment, dtype="float64", world=4, device="cuda: NVIDIA H100")
    with pytest.raises(ProfileTableError) as err:
        check_deployment(table, other, base_tp=1)
    msg = str(err.value)
    assert "dtype: table='float32' engine='float64'" in msg and "world: table=2 engine=4" in msg
    assert "device" in msg and "model_fingerprint" not in msg
    with pytest.raises(ProfileTableError, match="no points for the engine's base tp=4"):
        check_deployment(table, table.deployment, base_tp=4)
    newer = dataclasses.replace(table.deployment, libraries={**table.deployment.libraries, "torch": "9.9"})
    with caplog.at_level(logging.WARNING):
        check_deployment(table, newer, base_tp=1)  # only library versions differ: a warning
    assert "library versions differ" in caplog.text and "torch" in caplog.text
    caplog.clear()
    older = dataclasses.replace(table.deployment, libraries={**table.deployment.libraries, "transformers": "4.0"})
    with caplog.at_level(logging.WARNING):
        check_deployment(table, older, base_tp=1)  # transformers computes no step: nothing to say
    assert "library versions differ" not in caplog.text


@pytest.mark.slow
def test_engine_refuses_a_table_for_another_deployment(model_dir, tmp_path):
    path = tmp_path / "other.json"
    table_for(model_dir("qwen3"), 2).save(path)  # another model
    with pytest.raises(ProfileTableError, match="model_fingerprint"):
        Engine(model_dir("llama"), tp=1, dp=2, dtype="float32", profile_table=str(path))


@pytest.mark.slow
def test_engine_runs_static_without_its_table_and_attaches_the_controller_with_one(model_dir, tmp_path, caplog):
    model = model_dir("llama")
    with caplog.at_level(logging.WARNING, logger="pat_engine.core.controller_setup"):
        with Engine(model, tp=1, dp=2, dtype="float32", profile_table=str(tmp_path / "missing.json")) as engine:
            assert engine.policy is None
    assert caplog.text.count("runs static") == 1
    path = tmp_path / "ok.json"
    table_for(model, 2).save(path)
    with Engine(model, tp=1, dp=2, dtype="float32", profile_table=str(path)) as engine:
        assert isinstance(engine.policy, SwitchController)
        assert isinstance(engine.coordinator.switching.cost_source, LatencyPredictor)
        assert engine.policy.candidates == (1, 2)
        # the engine's decode steps reach the predictor's calibration, each once; prefills do not
        calibration = engine.policy.predictor.calibration
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 5, 8, 4)]
        with engine.record_steps() as steps:
            engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], params, policy=StaticLayout(),
                            use_tqdm=False)
        assert calibration.steps == sum(not s.is_prefill for s in steps) > 0


@pytest.mark.slow
def test_passes_measure_the_whole_grid_again_and_the_fit_averages_them(model_dir, tmp_path):
    grid = build_grid([1, 2], [1, 4], [16, 64], window=8, budget_tokens=4096, max_position=512, max_num_seqs=8,
                      passes=2)
    first, second = grid[:8], grid[8:]
    assert {p.repeat for p in first} == {0} and {p.repeat for p in second} == {1}
    assert [p.key[:3] for p in first] == [p.key[:3] for p in second]  # same points, a whole pass later
    table = table_for(model_dir("llama"), 2)
    table.points = [ProfilePoint(1, 1, 16, 20.0, 0.5, 0.010, repeat=0), ProfilePoint(1, 1, 64, 70.0, 1.0, 0.020),
                    ProfilePoint(1, 1, 16, 20.0, 0.7, 0.014, repeat=1)]
    table.add_point(ProfilePoint(1, 1, 16, 20.0, 0.5, 0.012, repeat=0))  # a re-measured point replaces its pass only
    path = tmp_path / "t.json"
    table.save(path)
    again = ProfileTable.load(path)
    assert sorted(p.run_key for p in again.points) == [(1, 1, 16, 0), (1, 1, 16, 1), (1, 1, 64, 0)]
    pred = LatencyPredictor(again)
    assert float(pred.step_seconds(1, 1, 20.0)) == pytest.approx(0.013)  # mean of 0.012 and 0.014


@pytest.mark.slow
def test_tiny_profile_run_and_resume(model_dir, tmp_path):
    out = tmp_path / "profile.json"
    opts = ProfileOptions(model=model_dir("llama"), world=2, tps=(1, 2), dtype="float32", batches=(1, 2),
                          contexts=(16, 48), budget_tokens=4096, window=4, output=str(out), switch_repeats=1)
    table = run_profile(opts)
    assert sorted(p.key for p in table.points) == [(tp, b, c) for tp in (1, 2) for b in (1, 2) for c in (16, 48)]
    for p in table.points:
        assert p.decode_step_s > 0 and p.prefill_s > 0 and p.steps >= 4
        assert p.total_tokens == pytest.approx(p.batch_size * (p.context_len + 1 + 2.5), rel=0.3)
    assert table.bandwidth_bytes_per_s > 0
    assert {(c.from_tp, c.to_tp) for c in table.switch_costs} == {(1, 2), (2, 1)}
    assert table.deployment.candidate_tps == (1, 2) and not table.deployment.emulated
    assert table.meta["async_scheduling"] is False  # how its decode steps were run (pat-profile --async-scheduling)
    # interrupt: drop two points, then resume; only those are measured again
    data = json.loads(out.read_text())
    kept = [p for p in data["points"] if p["context_len"] != 48 or p["tp"] != 2]
    data["points"] = kept
    out.write_text(json.dumps(data))
    with pytest.raises(FileExistsError, match="--resume"):
        run_profile(opts)
    assert table.meta["draw"] == "greedy"
    with pytest.raises(ValueError, match="--draw greedy"):  # one kind of step per table
        run_profile(dataclasses.replace(opts, resume=True, draw="rl"))
    resumed = run_profile(dataclasses.replace(opts, resume=True))
    assert len(resumed.points) == 8 and resumed.meta["resumed"] == 1
    old = {tuple(p[k] for k in ("tp", "batch_size", "context_len")): p["decode_step_s"] for p in kept}
    assert all(old[p.key] == p.decode_step_s for p in resumed.points if p.key in old)


@pytest.mark.slow
def test_emulated_profile_on_cpu(model_dir, tmp_path, capsys):
    out = tmp_path / "emulated.json"
    cli.main(["--model", model_dir("llama"), "--emulate-world", "4", "--tp", "1", "4", "--dtype", "float32",
              "--batch-sizes", "1", "2", "--context-lens", "16", "--decode-window", "3", "--output", str(out)])
    table = ProfileTable.load(out)
    assert table.deployment.emulated and table.deployment.world == 4
    assert table.deployment.collective_model["link_bandwidth"] == 150e9
    assert sorted(p.key for p in table.points) == [(1, 1, 16), (1, 2, 16), (4, 1, 16), (4, 2, 16)]
    assert all(p.decode_step_s > 0 for p in table.points)
    assert "EMULATED" in capsys.readouterr().out
