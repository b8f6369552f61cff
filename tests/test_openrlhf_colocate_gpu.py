"""OpenRLHF's hybrid engine on a GPU: ``update_weight_cuda_ipc`` with real CUDA IPC handles. Never run yet.

The CPU test (test_openrlhf_colocate.py) covers the placement and the call sequence with
shared-memory handles. Here one bundle ``{"GPU": 1, "CPU": 1}`` holds both a trainer rank (0.2 GPU,
float32 weights on its GPU, OpenRLHF's ``_handle_cuda_ipc``: a clone per parameter, ``reduce_tensor``,
keyed by ``get_physical_gpu_id``) and a one-rank pat engine seated on the same bundle; after the sync
its greedy tokens equal a fresh engine's on the updated checkpoint.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from conftest import MAX_NEW, PROMPTS  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_integrations.openrlhf.colocate import SHARE  # noqa: E402
from rl_helpers import VllmLikeSamplingParams, export_code_paths, perturbed_checkpoint, restore_env  # noqa: E402


class TrainerRank:
    """Trainer rank 0 on bundle 0, as OpenRLHF's ``PolicyModelActor`` with ``colocate_all``."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()

    def broadcast_to_vllm(self, engines: list) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)  # get_physical_gpu_id
        params = list(self.model.named_parameters())
        for count, (name, param) in enumerate(params, start=1):
            weight = param.data.clone()
            ray.get([e.update_weight_cuda_ipc.remote(name, dtype=param.dtype, shape=param.shape,
                                                     ipc_handles={gpu: reduce_tensor(weight)},
                                                     empty_cache=count == len(params)) for e in engines])
            torch.cuda.synchronize()


def test_colocated_cuda_ipc_sync_equals_a_fresh_engine(model_dir, tmp_path):
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pat_integrations.openrlhf.factory import create_pat_engines

    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=41)
    with Engine(step, dtype="float32", device="cuda") as fresh:
        want = [o.token_ids for o in fresh.generate(PROMPTS, [SamplingParams(max_new_tokens=m) for m in MAX_NEW],
                                                    use_tqdm=False)]
    old = export_code_paths()
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(pg.ready())
        engines = create_pat_engines(1, 1, model_dir("llama"), 0, False, True, True, 512, shared_pg=pg,
                                     gpu_memory_utilization=0.3, vllm_enable_sleep=True,
                                     pat_engine_kwargs={"dtype": "float32"})
        trainer = ray.remote(TrainerRank).options(num_cpus=0, num_gpus=SHARE, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))).remote(step)
        ray.get(engines[0].wake_up.remote(tags=["weights"]))
        ray.get(trainer.broadcast_to_vllm.remote(engines))
        ray.get(engines[0].wake_up.remote())
        outs = ray.get([engines[0].generate.remote(p, VllmLikeSamplingParams(temperature=0.0, max_tokens=m))
                        for p, m in zip(PROMPTS, MAX_NEW)])
        assert [o.outputs[0].token_ids for o in outs] == want
        ray.get(engines[0].shutdown.remote())
    finally:
        ray.shutdown()
        restore_env(old)
