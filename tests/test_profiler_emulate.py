"""pat-profile measures what the engine runs (issue 30, item 5), on the CPU: the emulated path builds its
shard as a worker does (decode graphs from the config: none by default on the CPU, the stand-in when
asked, replayed for every decode step of the window) and keeps each point's MEDIAN step; the real
profile keeps the median of its driver-side steps too."""

from __future__ import annotations

import contextlib
import statistics
from types import SimpleNamespace

import pytest

from pat_engine.model.arch import load_model_arch
from pat_engine.predictor.table import ProfileTable
from pat_profiler import cli
from pat_profiler.emulate import CollectiveModel, ShardRunner, decode_step_seconds, emulate_profile
from pat_profiler.grid import GridPoint, build_grid
from pat_profiler.profile import measure_point

WINDOW = 3
SCRIPTED = [0.010, 0.500, 0.012]  # one stray slow step: its mean would be 0.174 s


def test_a_points_decode_step_is_the_median_plus_the_collectives():
    assert decode_step_seconds(SCRIPTED, 0.001) == (pytest.approx(0.013), pytest.approx(statistics.pstdev(SCRIPTED)))
    assert decode_step_seconds([0.02], 0.0) == (0.02, 0.0)


def test_the_emulated_path_replays_standin_graphs_and_keeps_medians(model_dir, tmp_path, monkeypatch):
    model = model_dir("llama")
    real = ShardRunner.point

    def scripted(self, prompts, window, draw="greedy"):  # the real point, its decode times replaced by a known window
        prefill_s, decode_s, totals = real(self, prompts, window, draw)
        return prefill_s, SCRIPTED[: len(decode_s)] if len(decode_s) == WINDOW else decode_s, totals

    monkeypatch.setattr(ShardRunner, "point", scripted)
    out = tmp_path / "emulated.json"
    cli.main(["--model", model, "--emulate-world", "2", "--tp", "1", "2", "--dtype", "float32", "--batch-sizes", "1",
              "2", "--context-lens", "16", "--decode-window", str(WINDOW), "--graph-backend", "standin",
              "--output", str(out)])
    table = ProfileTable.load(out)
    graphs = table.meta["graphs"]
    assert graphs["backend"] == "standin"
    for tp in ("1", "2"):  # captured once after the load (sizes 1 and 2), then every decode step replayed
        g = graphs["per_tp"][tp]
        assert g["captures"] == 2 and g["lazy_captures"] == 0 and g["eager_decodes"] == 0
        assert g["replays"] == 4 + 2 * WINDOW  # the warm-up point's 4 steps, then 2 points x the window
    arch = load_model_arch(model)
    ring = CollectiveModel(150e9, 8e-6)
    for p in table.points:
        comm = ring.forward_s(arch, p.tp, p.batch_size, p.batch_size, 4)
        assert p.decode_step_s == pytest.approx(statistics.median(SCRIPTED) + comm)
        assert p.steps == WINDOW
    assert all(c.graphs_s_per_size > 0 for c in table.switch_costs)  # the target shard's measured capture


def test_the_emulated_path_follows_the_engines_default_on_the_cpu(model_dir):
    model = model_dir("llama")
    arch = load_model_arch(model)
    grid = build_grid([1], [1], [8], 2, 4096, arch.max_position, max_num_seqs=1)
    table = emulate_profile(model, 1, [1], "float32", "cpu", grid, 2, CollectiveModel(150e9, 8e-6))
    assert table.meta["graphs"]["backend"] == "off (eager)"  # EngineConfig.graphs(): none on the CPU
    assert table.meta["graphs"]["per_tp"]["1"]["replays"] == 0
    assert table.points[0].steps == 2 and table.points[0].decode_step_s > 0
    assert [c.graphs_s_per_size for c in table.switch_costs] == []


def test_the_cli_passes_the_decode_choices_through():
    args = cli.parse_args(["--model", "m", "--world", "2"])
    assert cli.decode_kwargs(args) == {}  # the engine's default
    args = cli.parse_args(["--model", "m", "--world", "2", "--graph-backend", "standin", "--enforce-eager",
                           "--async-scheduling"])
    assert cli.decode_kwargs(args) == {"graph_backend": "standin", "enforce_eager": True, "async_scheduling": True}
    args = cli.parse_args(["--model", "m", "--world", "2", "--no-async-scheduling"])  # off where the engine's is on
    assert cli.decode_kwargs(args) == {"async_scheduling": False}
    with pytest.raises(SystemExit):  # an emulated profile has no driver to overlap with
        cli.parse_args(["--model", "m", "--emulate-world", "2", "--async-scheduling"])


class _FakeEngine:
    """What ``measure_point`` reads of an engine: its layout, vocab, and the steps a generate call records."""

    def __init__(self, decode_s: list[float]):
        self.layout = SimpleNamespace(tp=1, dp=1)
        self.arch = SimpleNamespace(vocab_size=100)
        self._decode_s = decode_s
        self._log: list = []

    @contextlib.contextmanager
    def record_steps(self):
        self._log = []
        yield self._log

    def generate(self, prompts, params, use_tqdm=False):
        step = SimpleNamespace
        self._log.append(step(is_prefill=True, group=0, seconds=0.3, context_tokens=16))
        self._log += [step(is_prefill=False, group=0, seconds=s, context_tokens=17 + i)
                      for i, s in enumerate(self._decode_s)]


def test_the_draw_option_reaches_both_paths(model_dir):
    """``--draw rl``: the real path's requests sample at temperature 1 with log-probs, the emulated path's
    steps likewise (its table says so); greedy stays the default."""
    import random

    assert cli.parse_args(["--model", "m", "--world", "2"]).draw == "greedy"
    assert cli.parse_args(["--model", "m", "--world", "2", "--draw", "rl"]).draw == "rl"
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "m", "--world", "2", "--draw", "nucleus"])
    engine = _FakeEngine([0.9] + SCRIPTED)
    seen = []
    engine.generate = lambda prompts, params, use_tqdm=False: seen.append(params) or _FakeEngine.generate(
        engine, prompts, params)
    measure_point(engine, GridPoint(1, 1, 16), WINDOW, random.Random(0), "rl")
    assert seen[0].temperature == 1.0 and seen[0].logprobs
    model = model_dir("llama")
    arch = load_model_arch(model)
    grid = build_grid([1], [1], [8], 2, 4096, arch.max_position, max_num_seqs=1)
    specs = []
    from pat_profiler import emulate

    real = emulate.SamplingSpec
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emulate, "SamplingSpec", lambda **kw: specs.append(kw) or real(**kw))
        table = emulate_profile(model, 1, [1], "float32", "cpu", grid, 2, CollectiveModel(150e9, 8e-6), draw="rl")
    assert table.meta["draw"] == "rl" and specs and all(s["temperature"] == 1.0 and s["logprobs"] for s in specs)


def test_a_real_profile_point_keeps_the_median_driver_step():
    import random

    engine = _FakeEngine([0.9] + SCRIPTED)  # the first decode step is a warm-up and is dropped
    p = measure_point(engine, GridPoint(1, 1, 16), WINDOW, random.Random(0))
    assert p.decode_step_s == pytest.approx(statistics.median(SCRIPTED)) and p.steps == WINDOW
    assert p.prefill_s == pytest.approx(0.3)
