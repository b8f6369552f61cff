"""Decode graphs (worker/graph_capture.py) through the stand-in backend: the same bookkeeping as CUDA
graphs (ladder, persistent buffers, padding, copies in and out), replayed eagerly on the CPU.

In process, one rank, float64: a graph-backed executor gives the tokens and log-probs of an eager
one, padding rows write only the scratch block, and every event that invalidates graphs drops
them. The live switch with worker processes is in test_graph_capture_e2e.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import MAX_NEW, PROMPTS
from driver_fixtures import ARCH
from pat_engine import env
from pat_engine.config import EngineConfig, graph_ladder, graph_sizes_upto
from pat_engine.model.arch import MoESpec, load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ProfileTable
from pat_engine.protocol import SeqStep, StepCommand, SwitchPlan, SwitchReport
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.graph_backends import GraphBackend, StandInGraphBackend
from pat_engine.worker.graph_capture import DecodeGraphs, GraphSettings
from pat_engine.worker.infer_executor import InferExecutor
from rl_helpers import fresh_tensors

BLOCK, BLOCKS_PER_SEQ, NUM_BLOCKS = 4, 24, 160
GREEDY = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=True)
NEW = [m // 4 for m in MAX_NEW]  # 12, 5, 14, 7, 3, 10: the batch shrinks 6 -> 1 across ladder sizes


def _executor(path: str, graphs: bool, max_graph_batch: int = 8, device: str = "cpu",
              dtype: torch.dtype = torch.float64) -> InferExecutor:
    """One rank; its graphs stand-in on the CPU, CUDA graphs on a GPU (test_graph_capture_e2e.py)."""
    arch = load_model_arch(path)
    backend = "cuda" if device == "cuda" else "standin"
    settings = GraphSettings(backend, graph_ladder(max_graph_batch), 512) if graphs else None
    ex = InferExecutor(arch, Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), dtype, torch.device(device),
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, graphs=settings)
    ex.load_weights(path)
    return ex


def _generate(ex: InferExecutor, prompts=PROMPTS, max_new=NEW, first_id: int = 0) -> list[list[tuple[int, float]]]:
    """Prefill every prompt, then decode them together until each has its tokens (the batch shrinks)."""
    ids = range(first_id, first_id + len(prompts))
    table = {i: list(range(k * BLOCKS_PER_SEQ, (k + 1) * BLOCKS_PER_SEQ)) for k, i in enumerate(ids)}
    cmd = StepCommand(0, True, [SeqStep(i, list(p), 0, table[i], sampling=GREEDY) for i, p in zip(ids, prompts)])
    res = ex.execute(cmd)
    out = {i: [(t, lp)] for i, t, lp in zip(ids, res.tokens, res.logprobs)}
    pos = {i: len(p) for i, p in zip(ids, prompts)}
    want = dict(zip(ids, max_new))
    step, released = 1, []
    while live := [i for i in ids if len(out[i]) < want[i]]:
        cmd = StepCommand(step, False, [SeqStep(i, [out[i][-1][0]], pos[i]) for i in live], released)
        res = ex.execute(cmd)
        for i, t, lp in zip(live, res.tokens, res.logprobs):
            out[i].append((t, lp))
            pos[i] += 1
        released = [i for i in live if len(out[i]) == want[i]]
        step += 1
    ex.seqs.clear()
    return [out[i] for i in ids]


def test_ladder() -> None:
    assert graph_ladder(256)[:6] == (1, 2, 4, 8, 16, 24) and graph_ladder(256)[-1] == 256
    assert graph_ladder(300)[-3:] == (272, 288, 300)  # steps of 16 past 256, and the max itself
    assert graph_ladder(6) == (1, 2, 4, 6)
    assert graph_sizes_upto(graph_ladder(64), 9) == (1, 2, 4, 8, 16)  # 9 rows run as 16
    assert graph_sizes_upto(graph_ladder(8), 100) == (1, 2, 4, 8) and graph_sizes_upto(graph_ladder(8), 0) == ()


def test_config_decides_the_backend() -> None:
    def settings(arch=replace(ARCH, max_position=1024), **kw) -> GraphSettings | None:
        return GraphSettings.from_config(EngineConfig(model="m", **kw), arch)

    assert settings() is None  # the CPU captures nothing by default
    assert settings(graph_backend="standin", max_num_seqs=16) == GraphSettings("standin", (1, 2, 4, 8, 16), 1024)
    assert settings(graph_backend="standin", enforce_eager=True) is None
    assert settings(device="cuda", max_model_len=300).backend == "cuda"
    assert settings(device="cuda", enforce_eager=True) is None
    routed = replace(ARCH, max_position=1024, moe=MoESpec(num_experts=4, experts_per_token=2, intermediate_size=32,
                                                          norm_topk_prob=True))
    # invariant: its layers read their routing on the host; fast: the fused experts route on the device
    assert settings(routed, device="cuda", numerics="invariant") is None
    assert (settings(routed, device="cuda") is not None) == env.triton_runs_on("cuda")
    cuda = EngineConfig(model="m", device="cuda", numerics="invariant")
    assert cuda.decode_graph_ladder(routed) == () and cuda.decode_graph_ladder(ARCH)  # what the predictor pads to
    assert settings(routed, graph_backend="standin").backend == "standin"  # eager replays: any forward
    assert EngineConfig(model="m", device="cuda", max_num_seqs=100, max_graph_batch=64).decode_graph_ladder()[-1] == 64
    assert isinstance(StandInGraphBackend(), GraphBackend)
    with pytest.raises(Exception, match="graph_backend"):
        EngineConfig(model="m", graph_backend="cudagraph")


def test_openrlhf_enforce_eager_reaches_the_engine_config() -> None:
    from pat_integrations.openrlhf.settings import PatActorSettings

    for flag in (True, False):
        kwargs = PatActorSettings.from_vllm_kwargs({"model": "m", "enforce_eager": flag}).engine_kwargs
        assert kwargs["enforce_eager"] is flag and EngineConfig(model="m", **kwargs).enforce_eager is flag


def test_graphs_give_the_eager_tokens(model_dir) -> None:
    path = model_dir("llama")
    eager, graphed = _executor(path, graphs=False), _executor(path, graphs=True)
    assert eager.kv.scratch_block is None and eager.kv.layers[0].shape[1] == NUM_BLOCKS
    assert graphed.kv.scratch_block == NUM_BLOCKS and graphed.kv.layers[0].shape[1] == NUM_BLOCKS + 1
    assert graphed.capture_graphs() == (4, pytest.approx(graphed.graphs.stats.capture_s, abs=0.05))
    assert graphed.graphs.captured == (1, 2, 4, 8)
    want = _generate(eager)
    assert _generate(graphed) == want  # tokens and float64 log-probs, bit for bit
    stats = graphed.graphs.stats
    assert stats.replays == max(NEW) - 1 and stats.lazy_captures == 0 and stats.eager_decodes == 0
    assert eager.graphs.stats.replays == 0


def test_batches_past_the_ladder_and_lazy_capture(model_dir) -> None:
    ex = _executor(model_dir("llama"), graphs=True, max_graph_batch=4)
    want = _generate(_executor(model_dir("llama"), graphs=False))
    assert ex.graphs.captured == ()  # nothing before a capture is asked for
    assert _generate(ex) == want
    assert ex.graphs.captured == (1, 2, 4)  # each captured by the first step that needed it
    stats = ex.graphs.stats
    assert stats.lazy_captures == 3 and stats.eager_decodes > 0  # 5 and 6 rows run eagerly


def test_padding_rows_write_only_the_scratch_block(model_dir) -> None:
    """Three sequences replay the size-4 graph: the one padding row may write only the scratch block,
    and garbage there (NaN) changes nothing a real row computes."""
    ex = _executor(model_dir("llama"), graphs=True)
    ex.capture_graphs()
    want = _generate(_executor(model_dir("llama"), graphs=False), PROMPTS[:3], NEW[:3])
    for layer in ex.kv.layers:
        layer[:, NUM_BLOCKS].fill_(float("nan"))
    before = [layer.clone() for layer in ex.kv.layers]
    got = _generate(ex, PROMPTS[:3], NEW[:3])
    assert got == want
    owned = torch.zeros(NUM_BLOCKS + 1, BLOCK, dtype=torch.bool)  # (blocks, bs): slots real rows write
    owned[NUM_BLOCKS] = True  # and the scratch block
    for k, (p, n) in enumerate(zip(PROMPTS[:3], NEW[:3])):
        owned.view(-1)[k * BLOCKS_PER_SEQ * BLOCK : k * BLOCKS_PER_SEQ * BLOCK + len(p) + n - 1] = True
    for old, new in zip(before, ex.kv.layers):
        changed = ~((old == new) | (old.isnan() & new.isnan())).flatten(3).all(-1)  # (2, blocks, bs)
        assert not (changed & ~owned).any(), "a padding row wrote outside the scratch block"
        assert not new[:, :NUM_BLOCKS].isnan().any()


def test_releasing_the_kv_drops_the_graphs(model_dir) -> None:
    ex = _executor(model_dir("llama"), graphs=True)
    ex.capture_graphs()
    want = _generate(ex)
    ex.release_memory(kv=True, weights=None)
    assert ex.graphs.captured == ()
    ex.restore_memory(kv_blocks=NUM_BLOCKS, weights=False)
    assert ex.kv.scratch_block == NUM_BLOCKS
    assert _generate(ex) == want  # recaptured lazily, over the new pool
    assert ex.graphs.captured == (1, 2, 4, 8) and ex.graphs.stats.lazy_captures == 4


def test_weight_writes(model_dir) -> None:
    """An in-place update keeps the graphs (they read the same tensors); a write that moves the
    weights (release and restore) drops them."""
    path = model_dir("llama")
    ex = _executor(path, graphs=True)
    ex.capture_graphs()
    ex.load_tensors(list(fresh_tensors(path)))
    assert ex.graphs.captured == (1, 2, 4, 8)
    ex.release_memory(kv=False, weights="offloaded")
    assert ex.graphs.captured == ()
    ex.restore_memory(kv_blocks=None, weights=True)
    assert _generate(ex) == _generate(_executor(path, graphs=False))


def test_a_new_pool_is_never_replayed_stale(model_dir) -> None:
    """The replay guard: a pool installed behind the manager's back drops the graphs captured over
    the old one (on a GPU they would write into freed memory)."""
    path = model_dir("llama")
    ex = _executor(path, graphs=True)
    ex.capture_graphs()
    old = ex.graphs.graphs[8]
    ex.allocate_kv(NUM_BLOCKS)
    assert ex.graphs.captured == ()
    ex.kv = ex.new_pool(ex.layout, NUM_BLOCKS)  # not through install / allocate_kv
    ex.graphs.capture(ex.model, ex.tp, ex.kv, upto=8)
    assert ex.graphs.graphs[8] is not old
    ex.kv = ex.new_pool(ex.layout, NUM_BLOCKS)  # the graphs still point into the previous one
    assert _generate(ex) == _generate(_executor(path, graphs=False))
    assert ex.graphs.stats.lazy_captures == 4  # every size captured again, over this pool


class _WarmupLog(StandInGraphBackend):
    """The stand-in, recording how many warm-ups each capture was asked for; ``refuse_cold`` makes a capture
    without any fail, as a lazy initialisation inside a CUDA capture would."""

    def __init__(self, refuse_cold: bool = False) -> None:
        self.asked: list[int] = []
        self.refuse_cold = refuse_cold

    def capture(self, forward, warmups):
        self.asked.append(warmups)
        if self.refuse_cold and warmups == 0:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(forward, warmups)


def test_shapes_captured_before_are_captured_without_warm_ups(model_dir) -> None:
    """An epoch's first capture of new shapes warms up twice, its other sizes once; the same shapes captured
    again over a new pool of the same geometry (a switch back, a wake-up) take none; another geometry is new."""
    path = model_dir("llama")
    ex = _executor(path, graphs=True)
    log = ex.graphs.backend = _WarmupLog()
    ex.capture_graphs()
    assert log.asked == [2, 1, 1, 1]  # 8, 4, 2, 1: largest first
    ex.allocate_kv(NUM_BLOCKS)  # a new pool, the same geometry: every graph dropped
    assert ex.graphs.captured == ()
    ex.capture_graphs(upto=4)
    assert log.asked[4:] == [0, 0, 0] and ex.graphs.stats.warmup_forwards == 5
    ex.allocate_kv(NUM_BLOCKS + 8)  # another block count: the kernels may specialise on it
    ex.capture_graphs(upto=1)
    assert log.asked[7:] == [2]
    assert _generate(ex) == _generate(_executor(path, graphs=False))  # sizes 2-8 lazily: 2 is new here, 4, 8 too
    assert log.asked[8:] == [1, 1, 1]
    ex.graphs.forget_warm_shapes()  # benchmarks: everything new again
    ex.allocate_kv(NUM_BLOCKS)
    ex.capture_graphs(upto=2)
    assert log.asked[11:] == [2, 1]


def test_the_ranks_of_a_larger_group_warm_up_every_capture(model_dir) -> None:
    """A TP2 shard (emulated group): its warm-up forwards hold collectives that pair up only if every rank of
    the group runs as many, so shapes captured before are warmed up again."""
    from pat_profiler.emulate import EmulatedTPGroup

    path = model_dir("llama")
    ex = InferExecutor(load_model_arch(path), Layout(2, 1), EmulatedTPGroup(2), torch.float64, torch.device("cpu"),
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, graphs=GraphSettings("standin", graph_ladder(8), 512))
    ex.load_weights(path)
    log = ex.graphs.backend = _WarmupLog()
    ex.capture_graphs(upto=2)
    ex.allocate_kv(NUM_BLOCKS)
    ex.capture_graphs(upto=2)
    assert log.asked == [2, 1, 2, 1]


def test_a_capture_without_warm_ups_that_fails_is_taken_again_after_them(model_dir, caplog) -> None:
    path = model_dir("llama")
    ex = _executor(path, graphs=True)
    log = ex.graphs.backend = _WarmupLog(refuse_cold=True)
    ex.capture_graphs(upto=2)
    ex.allocate_kv(NUM_BLOCKS)
    with caplog.at_level("WARNING"):
        ex.capture_graphs(upto=2)
    assert log.asked == [2, 1, 0, 2, 0, 2] and ex.graphs.captured == (1, 2)
    assert "capture without warm-up failed" in caplog.text
    assert _generate(ex, max_new=[2] * len(PROMPTS)) == _generate(_executor(path, graphs=False), max_new=[2] * len(PROMPTS))


def test_disabled_manager_is_inert() -> None:
    graphs = DecodeGraphs(None, torch.device("cpu"), BLOCK)
    assert not graphs.enabled and graphs.reserve_bytes(64, 128, 4) == 0
    assert graphs.capture(None, None, None) == (0, 0.0)  # type: ignore[arg-type]


# ---- the switch's graphs phase: report and price -----------------------------------------------------


def _report(rank: int, graphs_s: float, graphs: int) -> SwitchReport:
    return SwitchReport.for_rank(rank, group_cache_hit=True, groups_s=0.0, weights_s=0.1, kv_s=0.1, rebuild_s=0.0,
                                 graphs_s=graphs_s, graphs_captured=graphs, total_s=0.3, weight_bytes_sent=0,
                                 weight_bytes_local=0, weight_bytes_allgather=0, kv_bytes_sent=0,
                                 peak_extra_bytes=0, kv_pool_bytes_before=0, kv_pool_bytes_after=0)


def test_switch_report_carries_the_graphs_phase() -> None:
    merged = SwitchReport.merge([_report(0, 0.02, 3), _report(1, 0.05, 5)])
    assert merged.graphs_s == 0.05 and merged.graphs_captured == 5
    assert merged.to_dict()["graphs_s"] == 0.05
    old_style = SwitchReport.for_rank(0, group_cache_hit=True, groups_s=0, weights_s=0, kv_s=0, rebuild_s=0,
                                      total_s=0, weight_bytes_sent=0, weight_bytes_local=0, weight_bytes_allgather=0,
                                      kv_bytes_sent=0, peak_extra_bytes=0, kv_pool_bytes_before=0,
                                      kv_pool_bytes_after=0)
    assert old_style.graphs_s == 0.0 and old_style.graphs_captured == 0


def test_switch_plan_says_how_many_requests_each_group_keeps() -> None:
    plan = SwitchPlan(Layout(1, 2), Layout(2, 1), 10, "recompute", group_requests=(6,))
    assert plan.requests_in(0) == 6
    assert SwitchPlan(Layout(1, 2), Layout(2, 1), 10, "recompute").requests_in(0) is None  # unknown: every size
    with pytest.raises(ValueError, match="group_requests"):
        SwitchPlan(Layout(2, 1), Layout(1, 2), 10, "recompute", group_requests=(6,))


def test_predictor_prices_the_recapture(tmp_path) -> None:
    from test_controller import make_table  # world 4, switch costs between TP1, TP2 and TP4

    data = make_table().to_dict()
    for cost in data["switch_costs"]:
        cost.pop("graphs_s_per_size")  # a table written before the field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert all(c.graphs_s_per_size == 0.0 for c in ProfileTable.load(path).switch_costs)

    for cost in data["switch_costs"]:
        cost["graphs_s_per_size"] = 0.01
    table = ProfileTable.from_dict(data)
    pred = LatencyPredictor(table, max_num_seqs=64, graph_ladder_sizes=graph_ladder(64))
    assert pred.graph_seconds(1, 2, 0) == 0.0
    assert pred.graph_seconds(1, 2, 6) == pytest.approx(0.04)  # 6 -> 8: sizes 1, 2, 4, 8
    assert pred.graph_seconds(1, 2, 1000) == pytest.approx(0.01 * len(graph_ladder(64)))
    assert list(pred.graph_seconds(1, 2, np.array([0, 3, 9]))) == pytest.approx([0.0, 0.03, 0.05])
    assert LatencyPredictor(table, graph_ladder_sizes=()).graph_seconds(1, 2, 6) == 0.0  # graphs off

    reqs = [RequestSnapshot(20, 5, 50, True) for _ in range(12)]
    old, new = Layout.for_world(4, 1), Layout.for_world(4, 2)
    est = pred.switch_cost(old, new, reqs, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]],
                           [list(range(6)), list(range(6, 12))])
    assert est.graphs_s == pytest.approx(0.04)  # the busiest new group holds 6
    assert est.total_s == pytest.approx(est.weights_s + min(est.migrate_s, est.recompute_s) + est.fixed_s + 0.04)
    assert est.to_dict()["graphs_s"] == pytest.approx(0.04)

    # TP2's layout left sizes 1, 2 and 8 set aside (a merge, then a split back): a return of 6 captures 4 only
    pred.record_graphs(1, (1, 2, 4, 8), 2)  # TP1 -> TP2: TP1 left its four smallest sizes
    pred.record_graphs(2, (1, 2, 8), 1)  # TP2 -> TP1: TP2 left three, TP1's are restored
    assert pred.graph_seconds(1, 2, 6) == pytest.approx(0.01) and pred.graph_seconds(1, 2, 2) == 0.0
    assert list(pred.graph_seconds(1, 2, np.array([0, 3, 9]))) == pytest.approx([0.0, 0.01, 0.02])  # 4; 4, 16
    assert pred.graph_seconds(2, 1, 6) == pytest.approx(0.04)  # TP1's own are in use again: none left aside
    pred.forget_graphs()  # a sleep dropped them all
    assert pred.graph_seconds(1, 2, 6) == pytest.approx(0.04)


def test_graphs_set_aside_run_again_only_where_everything_they_read_stayed(model_dir) -> None:
    """A switch sets a layout's graphs aside; a return restores them without a capture when the group, every
    weight and every KV layer are where they were (a switch keeps them there), and drops them otherwise."""
    path = model_dir("llama")
    ex = _executor(path, graphs=True)
    ex.capture_graphs()
    sizes, stats = ex.graphs.captured, ex.graphs.stats
    assert ex.graphs.set_aside() == sizes  # every ladder size
    assert ex.graphs.captured == ()
    ex.capture_graphs()  # the same group, weights and pool: back
    assert ex.graphs.captured == sizes and stats.restored == len(sizes) and stats.captures == len(sizes)
    want = _generate(_executor(path, graphs=False))
    assert _generate(ex) == want and stats.replays > 0 and stats.captures == len(sizes)

    ex.graphs.set_aside()
    ex.kv = ex.new_pool(ex.layout, NUM_BLOCKS)  # the same geometry in other memory: the graphs would write the old
    ex.capture_graphs(upto=2)
    assert stats.restored == len(sizes) and ex.graphs.captured == (1, 2) and not ex.graphs._left

    assert ex.graphs.set_aside() == (1, 2)  # over the same pool now
    with ex.writing_weights():  # a weight moved (a reload into fresh tensors)
        ex.model.norm.weight.data = ex.model.norm.weight.data.clone()
    ex.capture_graphs(upto=1)
    assert stats.restored == len(sizes) and ex.graphs.captured == (1,)
    assert _generate(ex) == want

    ex.graphs.set_aside()
    ex.allocate_kv(NUM_BLOCKS)  # a release of the KV forgets what every layout left
    assert not ex.graphs._left
