"""OpenRLHF's hybrid engine (``--train.colocate_all``) with pat engines, on CPU with Ray.

The cluster declares 4 logical GPUs (``ray.init(num_gpus=4)``): Ray assigns GPU ids and sets
``CUDA_VISIBLE_DEVICES`` exactly as on a GPU node, while everything computes on the CPU. The
placement group is OpenRLHF's (``train_ppo_ray.py``: a ``{"GPU": 1, "CPU": 1}`` bundle per trainer
GPU, ``PACK``); trainer rank ``r`` would sit on bundle ``r`` with 0.2 GPU (``RayActorGroup``), which a
probe task on each bundle stands in for. Two engines of 2 ranks (TP1xDP2 at every stage start,
TP2xDP1 after 4 decode steps), float64. The calls follow OpenRLHF 0.11.2's hybrid loop: engines start
asleep (``vllm_enable_sleep``), ``wake_up(tags=["weights"])``, ``reset_prefix_cache`` beside the
per-parameter ``update_weight_cuda_ipc`` (CPU shared-memory handles keyed "cpu"), ``wake_up()``,
generation, ``sleep()``. The CUDA form (one handle per trainer GPU, keyed by its UUID) is the ``gpu``
test at the end; it has not run here (no GPU).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from ray.util.placement_group import placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from conftest import MAX_NEW, PROMPTS, _hf_model, hf_greedy_batch  # noqa: E402
from pat_integrations.openrlhf.colocate import SHARE, engine_bundles, node_ordered, seat_options  # noqa: E402
from pat_integrations.openrlhf.factory import create_pat_engines  # noqa: E402
from rl_helpers import VllmLikeSamplingParams, export_code_paths, perturbed_checkpoint, restore_env  # noqa: E402
from rl_helpers import sync_by_handles  # noqa: E402

TP, ENGINES = 2, 2


# ---- the placement rule, without Ray processes ----------------------------------------------------

def test_engines_take_bundles_node_by_node_and_stay_inside_a_node():
    two_nodes = {0: "a", 1: "b", 2: "a", 3: "b"}  # Ray may interleave nodes in the bundle order
    assert node_ordered(two_nodes) == [0, 2, 1, 3]
    assert [engine_bundles(two_nodes, i, 2) for i in range(2)] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"bundles \[0, 2, 1, 3\] span 2 nodes.*TP inside a node"):
        engine_bundles(two_nodes, 0, 4)
    with pytest.raises(ValueError, match=r"engine 2 needs bundles 4..5 .* which has 4"):
        engine_bundles(two_nodes, 2, 2)


def test_a_rank_takes_openrlhfs_share_of_its_bundle():
    assert seat_options({"GPU": 1, "CPU": 1}) == {"num_cpus": 0, "num_gpus": SHARE}
    assert seat_options({"CPU": 1}) == {"num_cpus": SHARE}  # CPU-only bundles


# ---- the hybrid loop ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid(model_dir):
    old = export_code_paths()
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1, "CPU": 1} for _ in range(ENGINES * TP)], strategy="PACK")
        ray.get(pg.ready())
        engines = create_pat_engines(
            num_engines=ENGINES, tensor_parallel_size=TP, pretrain=model_dir("llama"), seed=0, full_determinism=False,
            enable_prefix_caching=True, enforce_eager=True, max_model_len=512, shared_pg=pg,
            gpu_memory_utilization=0.5, vllm_enable_sleep=True, pat_base_tp=1, pat_switch_schedule=[(4, 2)],
            pat_engine_kwargs={"dtype": "float64"})
        yield pg, engines
        ray.get([e.shutdown.remote() for e in engines])
    finally:
        ray.shutdown()
        restore_env(old)


@ray.remote(num_cpus=0, num_gpus=SHARE)
def trainer_gpu() -> str:
    """What a trainer rank on this bundle is given (OpenRLHF: 0.2 GPU of bundle ``rank``)."""
    return str(ray.get_gpu_ids()[0])


def _visible_devices(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    value = env.get(b"CUDA_VISIBLE_DEVICES")
    return value.decode() if value is not None else None


@pytest.mark.slow  # a Ray cluster with worker processes
def test_each_rank_runs_on_the_gpu_of_its_bundle(hybrid):
    pg, engines = hybrid
    # each engine's seats hold OpenRLHF's share of every one of its bundles (read before the probes run)
    free = ray.available_resources()
    assert [free[f"GPU_group_{b}_{pg.id.hex()}"] for b in range(ENGINES * TP)] == pytest.approx([1 - SHARE] * 4)
    on_bundle = ray.get([trainer_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=b)).remote() for b in range(ENGINES * TP)])
    assert len(set(on_bundle)) == ENGINES * TP
    for i, engine in enumerate(engines):
        where = ray.get(engine.placement.remote())
        assert where["bundles"] == [i * TP + r for r in range(TP)]  # one node: OpenRLHF's order
        assert where["gpu_ids"] == [on_bundle[b] for b in where["bundles"]]
        # worker rank r uses the r-th visible device: the GPU its trainer rank shares
        assert [_visible_devices(pid) for pid in where["worker_pids"]] == [",".join(where["gpu_ids"])] * TP


@pytest.mark.slow  # a Ray cluster with worker processes
def test_hybrid_step_syncs_by_handle_and_generates_token_exact(hybrid, model_dir, tmp_path):
    _, engines = hybrid
    assert all(ray.get([e.is_sleeping.remote() for e in engines]))  # vllm_enable_sleep: created asleep
    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=31)
    # PPOTrainer.broadcast_to_vllm: weights only, then the actor's per-parameter sync by handle
    ray.get([e.wake_up.remote(tags=["weights"]) for e in engines])
    resets = [e.reset_prefix_cache.remote() for e in engines]
    sync_by_handles(engines, _hf_model(step))
    ray.get(resets)
    assert all(ray.get([e.is_sleeping.remote() for e in engines]))  # the KV cache is still released
    # SamplesGenerator: wake everything, generate, sleep
    ray.get([e.wake_up.remote() for e in engines])
    greedy = [VllmLikeSamplingParams(temperature=0.0, max_tokens=m) for m in MAX_NEW]
    for engine in engines:
        outs = ray.get([engine.generate.remote(p, g) for p, g in zip(PROMPTS, greedy)])
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy_batch(step)
    assert all(n > 0 for n in ray.get([e.num_switches.remote() for e in engines]))
    ray.get([e.sleep.remote() for e in engines])
    assert all(ray.get([e.is_sleeping.remote() for e in engines]))
