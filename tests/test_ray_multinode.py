"""pat-engine across nodes with Ray: a two-node local cluster (``ray.cluster_utils.Cluster``).

One engine of 2 worker processes per node. Requests spread over both nodes,
each node switches its own layout (or not), every stage starts from the base
layout, and every output is token-exact against transformers or a single
local engine.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from ray.cluster_utils import Cluster  # noqa: E402

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_integrations.ray_cluster import RayClusterEngine, alive_node_ids  # noqa: E402
from pat_integrations.stage import StagePlan  # noqa: E402
from rl_helpers import export_code_paths, fresh_tensors, perturbed_checkpoint, restore_env  # noqa: E402

pytestmark = pytest.mark.slow  # starts worker processes

GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
SAMPLED = [SamplingParams(max_new_tokens=m, temperature=0.8, top_p=0.95, seed=40 + i, logprobs=True)
           for i, m in enumerate(MAX_NEW)]


@pytest.fixture(scope="module")
def two_nodes():
    old = export_code_paths()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        restore_env(old)


@pytest.fixture(scope="module")
def engines(two_nodes, model_dir):
    with RayClusterEngine(model_dir("llama"), tp=1, dp=2, dtype="float64") as cluster:
        yield cluster


def test_one_engine_per_node(engines):
    assert len(set(engines.node_ids)) == 2 and engines.node_ids == alive_node_ids()
    assert engines.layouts() == ["TP1xDP2", "TP1xDP2"]


def test_requests_spread_and_only_one_node_switches(engines, model_dir):
    outs = engines.generate(PROMPTS, GREEDY, plans={1: StagePlan.from_options([(4, 2)])})
    assert [o.token_ids for o in outs] == hf_greedy_batch(model_dir("llama"))
    assert all(c > 0 for c in engines.last_assignment.counts(2)), engines.last_assignment
    first, second = engines.switches()
    assert first == [] and [s["to_layout"] for s in second] == ["TP2xDP1"] and second[0]["ok"]
    assert engines.layouts() == ["TP1xDP2", "TP2xDP1"]

    # the next batch: node 1 starts again from its base layout, node 0 switches this time
    outs = engines.generate(PROMPTS, SAMPLED, plans={0: StagePlan.from_options([(3, 2)]), 1: StagePlan()})
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as single:
        want = single.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        assert o.logprobs == pytest.approx(w.logprobs, abs=1e-9)
    assert all(c > 0 for c in engines.last_assignment.counts(2))
    assert engines.stage_layouts() == [["TP1xDP2", "TP1xDP2"], ["TP1xDP2", "TP1xDP2"]]
    assert [s["to_layout"] for s in engines.switches()[0]] == ["TP2xDP1"]
    assert engines.layouts() == ["TP2xDP1", "TP1xDP2"]


def test_weights_reach_every_node(engines, model_dir, tmp_path):
    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=3)
    assert engines.update_weights(fresh_tensors(step), bucket_bytes=256 << 10) > 0
    outs = engines.generate(PROMPTS, GREEDY)
    assert set(engines.last_assignment.nodes) == {0, 1}
    assert [o.token_ids for o in outs] == hf_greedy_batch(step)
