"""Live layout switches mid-batch change where tensors live, never what is computed.

4 worker processes, float64: switched runs equal unswitched runs and transformers,
for KV migration and recompute, merges and splits, several switches per batch.
"""

from __future__ import annotations

import random

import pytest

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams

pytestmark = pytest.mark.slow  # starts worker processes

GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
SCHEDULES = {
    "1x4->4x1": (1, [(4, 4)]),
    "2x2->4x1": (2, [(6, 4)]),
    "1x4->2x2->4x1": (1, [(3, 2), (9, 4)]),
    "4x1->1x4": (4, [(5, 1)]),
}


def run(engine, start_tp, schedule, kv=None, params=GREEDY, prompts=PROMPTS):
    engine.reconfigure(tp=start_tp)  # idle switch to the batch's starting layout
    before = len(engine.switches)
    outs = engine.generate(prompts, params, switch_schedule=schedule, kv_transfer=kv, use_tqdm=False)
    events = engine.switches[before:]
    return [o.token_ids for o in outs], events


@pytest.fixture(scope="module")
def engines(model_dir):
    made: dict[str, Engine] = {}

    def get(arch: str) -> Engine:  # one engine per architecture for the module (built on first use only)
        if arch not in made:
            made[arch] = Engine(model_dir(arch), tp=1, dp=4, dtype="float64")
        return made[arch]

    yield get
    for e in made.values():
        e.shutdown()


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_llama_schedules_match_transformers(engines, model_dir, name, kv):
    start, schedule = SCHEDULES[name]
    tokens, events = run(engines("llama"), start, schedule, kv)
    assert tokens == hf_greedy_batch(model_dir("llama"))
    assert [e.to_layout for e in events] == [f"TP{tp}xDP{4 // tp}" for _, tp in schedule]
    assert all(e.ok and e.kv_path == kv for e in events)


@pytest.mark.parametrize("arch,name,kv", [
    ("qwen2", "1x4->2x2->4x1", "migrate"), ("qwen2", "4x1->1x4", "recompute"),
    ("qwen3", "2x2->4x1", "recompute"), ("qwen3", "4x1->1x4", "migrate"),
])
def test_qwen_schedules_match_transformers(engines, model_dir, arch, name, kv):
    start, schedule = SCHEDULES[name]
    tokens, events = run(engines(arch), start, schedule, kv)
    assert tokens == hf_greedy_batch(model_dir(arch))
    assert len(events) == len(schedule) and all(e.ok for e in events)


def test_seeded_sampling_survives_switches(engines):
    engine = engines("qwen3")
    params = [SamplingParams(max_new_tokens=m, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i)
              for i, m in enumerate(MAX_NEW)]
    static, _ = run(engine, 1, None, params=params)
    migrated, _ = run(engine, 1, [(3, 4), (12, 2)], "migrate", params=params)
    recomputed, _ = run(engine, 4, [(5, 1)], "recompute", params=params)
    assert static == migrated == recomputed


@pytest.mark.parametrize("seed", [0, 1])
def test_randomised_schedules(engines, model_dir, seed):
    rng = random.Random(seed)
    expected = hf_greedy_batch(model_dir("llama"))
    for _ in range(2):
        steps = sorted(rng.sample(range(1, 40), 3))
        schedule = [(s, rng.choice([1, 2, 4])) for s in steps]
        tokens, _ = run(engines("llama"), rng.choice([1, 2, 4]), schedule, rng.choice(["migrate", "recompute"]))
        assert tokens == expected, f"schedule {schedule}"


def test_group_pool_creates_each_layout_once(engines):
    engine = engines("llama")  # shared with the module: count this test's hits, whatever ran before
    hits_before = [s["group_hits"] for s in engine.worker_stats()]
    for tp in (1, 2, 4, 1, 4, 2, 1):
        engine.reconfigure(tp=tp)
    stats = engine.worker_stats()
    for s, before in zip(stats, hits_before):
        assert sorted(s["layouts"]) == ["TP1xDP4", "TP2xDP2", "TP4xDP1"]
        assert s["group_misses"] == 3 and s["group_hits"] - before >= 4  # 1, 4, 2, 1 return to built layouts
    assert engine.switches[-1].costs["group_cache_hit"]


def test_switch_reads_no_weights_from_disk(engines, model_dir, tmp_path):
    """The checkpoint is moved away before switching: any reload would fail."""
    import shutil
    from pathlib import Path

    engine = engines("llama")
    weights = Path(model_dir("llama")) / "model.safetensors"
    hidden = tmp_path / "moved.safetensors"
    shutil.move(weights, hidden)
    try:
        tokens, events = run(engine, 1, [(3, 4), (10, 2), (20, 1)], "migrate")
    finally:
        shutil.move(hidden, weights)
    assert tokens == hf_greedy_batch(model_dir("llama"))
    assert len(events) == 3 and all(e.ok for e in events)


def test_switch_cost_report(engines):
    engine = engines("llama")
    _, events = run(engine, 2, [(4, 1)], "migrate")
    costs = events[0].costs
    for key in ("groups_s", "weights_s", "kv_s", "rebuild_s", "weight_bytes_sent", "kv_bytes_sent", "peak_extra_bytes"):
        assert key in costs
    assert costs["weight_bytes_sent"] > 0 and costs["kv_bytes_sent"] > 0  # 2x2 -> 1x4 must fetch the other half
    assert 0 < costs["peak_extra_bytes"] < costs["kv_pool_bytes_before"]
    assert engine.timeline["switches"][-1]["to_layout"] == "TP1xDP4"
