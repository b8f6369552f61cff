"""Several ranks on one GPU (parallel/devices.py), on the CPU: where each rank runs, its memory share and
KV budget, the collective backend, the eager decision for TP groups whose collectives go through the host,
the allocator counters the ``Stats`` call carries for leak checks, and the drain a switch records.
The same switch on a real GPU is in test_colocated_gpu.py (``gpu``)."""

from __future__ import annotations

import math

import pytest
import torch

from driver_fixtures import make_driver
from pat_engine.config import EngineConfig, graph_ladder
from pat_engine.errors import InvalidRequestError
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.devices import DevicePlacement, check_share, graphs_capturable, rank_kv_budget
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.deployment import device_name
from pat_engine.predictor.policy import SwitchDecision
from pat_engine.worker.device_memory import allocator_stats
from pat_engine.worker.graph_backends import StandInGraphBackend
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.infer_executor import InferExecutor
from pat_profiler.emulate import EmulatedTPGroup
from test_graph_capture import BLOCK, NEW, NUM_BLOCKS, _generate

GiB = 1 << 30


# ---- placement and backend ---------------------------------------------------------------------------------


def test_one_gpu_holds_every_rank_of_the_world():
    p = DevicePlacement(world=4, devices=1)
    assert [p.device_index(r) for r in range(4)] == [0, 0, 0, 0]
    assert [p.sharing(r) for r in range(4)] == [4] * 4 and p.most_sharing == 4
    assert p.colocated and p.device_backend == "gloo" and p.host_staged
    assert "co-located test/dev mode" in p.describe() and "not NVLink" in p.describe()


def test_ranks_spread_over_the_devices_before_any_takes_a_second():
    p = DevicePlacement(world=4, devices=2)
    assert [p.device_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert [p.sharing(r) for r in range(4)] == [2, 2, 2, 2] and p.colocated
    odd = DevicePlacement(world=3, devices=2)
    assert [odd.device_index(r) for r in range(3)] == [0, 1, 0]
    assert [odd.sharing(r) for r in range(3)] == [2, 1, 2] and odd.most_sharing == 2


def test_one_rank_per_gpu_keeps_nccl_and_the_cpu_keeps_gloo_without_staging():
    own = DevicePlacement(world=4, devices=8)  # more devices than ranks: ranks 0-3 on devices 0-3
    assert [own.device_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert not own.colocated and own.device_backend == "nccl" and not own.host_staged
    cpu = DevicePlacement(world=4, devices=0)
    assert cpu.device_backend == "gloo" and not cpu.host_staged and not cpu.colocated
    assert [cpu.sharing(r) for r in range(4)] == [1] * 4
    with pytest.raises(ValueError, match="outside a world of 4"):
        own.device_index(4)


def test_graphs_are_capturable_without_collectives_or_with_device_collectives_only():
    assert graphs_capturable(1, host_staged=True)  # TP1: no collective in the forward
    assert not graphs_capturable(2, host_staged=True)
    assert graphs_capturable(4, host_staged=False)  # NCCL
    assert not TPGroup(0, 2, (0, 1), host_staged=True).graphs_capturable
    assert TPGroup(0, 1, (0,), host_staged=True).graphs_capturable
    assert EmulatedTPGroup(8).graphs_capturable  # pat-profile's emulated shards keep their graphs


# ---- memory shares and the KV budget -----------------------------------------------------------------------


def test_each_rank_gets_an_equal_share_unless_one_is_given():
    p = DevicePlacement(world=2, devices=1)
    assert p.memory_fraction(0.9, None) == pytest.approx(0.45)
    assert p.memory_fraction(0.9, 0.3) == 0.3
    assert DevicePlacement(world=2, devices=2).memory_fraction(0.9, None) == 0.9  # alone on its device
    with pytest.raises(InvalidRequestError, match=r"rank_memory_fraction=0.3 x 4 ranks on one device asks for 1.20"):
        DevicePlacement(world=4, devices=1).memory_fraction(0.9, 0.3)


def test_alone_on_a_gpu_the_budget_is_the_one_gpu_rule():
    total, reserve = 80 * GiB, 2 * GiB
    for free in (10 * GiB, 50 * GiB, 79 * GiB):
        for util in (0.5, 0.85, 0.95):
            want = max(0, int(free - total * (1 - util) - reserve))
            assert rank_kv_budget(total, free, util, 1, reserve) == pytest.approx(want, abs=1)


def test_ranks_sharing_a_gpu_stay_inside_its_utilisation_together():
    """Two and four ranks, each with 3 GiB of weights loaded (and a 0.5 GiB context): their pools, weights and
    reserves add up to the utilisation, not to the device twice over (the start-up OOM of issue 32)."""
    total, util, reserve = 80 * GiB, 0.85, 1 * GiB
    for n in (2, 4):
        used = n * (3 * GiB + GiB // 2)
        budget = rank_kv_budget(total, total - used, util / n, n, reserve)
        assert budget > 0
        assert used + n * (budget + reserve) == pytest.approx(util * total, rel=1e-9)
    assert rank_kv_budget(total, 1 * GiB, 0.4, 2, reserve) == 0  # nothing left: no negative pool
    with pytest.raises(ValueError, match="sharing"):
        rank_kv_budget(total, total, 0.5, 0, 0)


def test_a_share_that_cannot_hold_the_weights_is_refused_by_name():
    check_share(0.45, 80 * GiB, 16 * GiB)  # fits
    with pytest.raises(InvalidRequestError, match=r"share \(0.100 of 80.0 GiB = 8.00 GiB\) cannot hold its weights "
                                                  r"\(16.00 GiB\)"):
        check_share(0.1, 80 * GiB, 16 * GiB)
    with pytest.raises(InvalidRequestError, match=r"its weights \(16.00 GiB\) and its KV \(30.00 GiB\)"):
        check_share(0.45, 80 * GiB, 16 * GiB, kv_bytes=30 * GiB)


def test_config_checks_the_memory_fractions():
    assert EngineConfig(model="m", device="cuda", rank_memory_fraction=0.25).rank_memory_fraction == 0.25
    for bad in (0.0, 1.5, math.nan, -0.1):
        with pytest.raises(InvalidRequestError, match="rank_memory_fraction must be a fraction in"):
            EngineConfig(model="m", device="cuda", rank_memory_fraction=bad)
        with pytest.raises(InvalidRequestError, match="gpu_memory_utilization must be a fraction in"):
            EngineConfig(model="m", device="cuda", gpu_memory_utilization=bad)
    with pytest.raises(InvalidRequestError, match="rank_memory_fraction is a share of a GPU's memory"):
        EngineConfig(model="m", device="cpu", rank_memory_fraction=0.5)


def test_a_colocated_table_is_not_a_one_per_gpu_table(monkeypatch):
    monkeypatch.delenv("PAT_COLOCATED_COLLECTIVES", raising=False)
    assert device_name("cuda", 2).endswith(", 2 ranks per device, collectives ipc")
    assert "ranks per device" not in device_name("cuda", 1)
    monkeypatch.setenv("PAT_COLOCATED_COLLECTIVES", "host")  # a table measured on the other path is another's
    assert device_name("cuda", 2).endswith(", 2 ranks per device, collectives host-staged")
    assert "collectives" not in device_name("cuda", 1)  # one rank per GPU: NCCL, whatever the switch says


# ---- the eager decision: no capture is tried for host-staged groups -----------------------------------------


class _CountingBackend(StandInGraphBackend):
    def __init__(self) -> None:
        self.captures = 0

    def capture(self, forward, warmups):
        self.captures += 1
        return super().capture(forward, warmups)


def _tp2_shard(path: str, host_staged: bool) -> tuple[InferExecutor, _CountingBackend]:
    """TP rank 0 of a TP2 group (emulated: collectives return local data), stand-in graphs on."""
    group = EmulatedTPGroup(2)
    group.host_staged = host_staged
    ex = InferExecutor(load_model_arch(path), Layout(2, 1), group, torch.float64, torch.device("cpu"), block_size=BLOCK,
                       num_blocks=NUM_BLOCKS, graphs=GraphSettings("standin", graph_ladder(8), 512))
    backend = ex.graphs.backend = _CountingBackend()
    ex.load_weights(path)
    return ex, backend


def test_a_host_staged_tp_group_decodes_eagerly_without_trying_a_capture(model_dir):
    path = model_dir("llama")
    staged, staged_backend = _tp2_shard(path, host_staged=True)
    nccl_like, backend = _tp2_shard(path, host_staged=False)
    assert staged.capture_graphs() == (0, 0.0) and staged.graphs.captured == ()
    assert nccl_like.capture_graphs()[0] == 4 and backend.captures == 4
    assert _generate(staged) == _generate(nccl_like)
    assert staged_backend.captures == 0  # neither at start-up nor lazily by a step
    stats = staged.graphs.stats
    assert stats.replays == 0 and stats.uncapturable_decodes == stats.eager_decodes == max(NEW) - 1
    assert nccl_like.graphs.stats.uncapturable_decodes == 0 and nccl_like.graphs.stats.replays == max(NEW) - 1


# ---- leak-check plumbing and the drain -------------------------------------------------------------------


def test_allocator_counters_are_none_on_the_cpu():
    assert allocator_stats(torch.device("cpu")) == {"allocated": None, "reserved": None, "peak_allocated": None}


@pytest.mark.slow
def test_the_stats_call_reports_device_memory_and_the_collectives_of_every_rank(model_dir):
    from pat_engine import Engine

    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float32") as engine:
        stats = engine.worker_stats(release_cached=True)
    assert len(stats) == 2
    for s in stats:
        assert s["device"] == "cpu" and s["host_staged"] is False and s["graphs"]["capturable"] is True
        assert s["device_memory"] == allocator_stats(torch.device("cpu"))


def test_a_switch_records_its_drain():
    d = make_driver(tp=1, dp=2)
    for i in range(4):
        d.add([10 + i, 11, 12], 12)
    d.ticks(3)  # steps in flight
    event = d.coord.switching.switch(SwitchDecision(2, "test"))
    assert 0.0 <= event.costs["drain_s"] <= event.seconds
