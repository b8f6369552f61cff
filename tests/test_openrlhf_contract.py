"""pat-engine behind OpenRLHF's engine-actor contract (OpenRLHF 0.11.2), on CPU with Ray.

OpenRLHF pins CUDA-only packages, so this test plays its driver: the calls,
argument names and order are those of ``create_vllm_engines``,
``PolicyModelActor._init_vllm_sync_group``, ``broadcast_to_vllm`` (metadata
RPC on every engine, then a broadcast from trainer rank 0) and
``SamplesGenerator`` (wake_up, load balance on unfinished counts,
``generate_responses``, sleep). Two engines of 2 devices each (TP1xDP2 at
the start of every stage, switching to TP2xDP1 on a schedule), float64. The colocated path
(``update_weight_cuda_ipc``) runs with CPU shared-memory handles in place of CUDA IPC handles.
Tail batching (``pat_rollout``) runs through the actor's ``rollout_step``, with the weight sync
above making deferred partials stale.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from conftest import MAX_NEW, PROMPTS, _hf_model, hf_greedy_batch  # noqa: E402
from pat_integrations.openrlhf.factory import create_pat_engines  # noqa: E402
from pat_integrations.openrlhf.weight_sync import stateless_gloo_group  # noqa: E402
from rl_helpers import (CODE_PATHS, VllmLikeSamplingParams, export_code_paths, perturbed_checkpoint,  # noqa: E402
                        restore_env, sync_by_handles)

pytestmark = pytest.mark.slow  # starts worker processes

TP = 2
AGENT = '''
class AgentExecutor:
    """A single-turn agent in OpenRLHF's shape (its SingleTurnAgentExecutor, minus the reward service)."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        ids = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        out = await llm_engine.generate(ids, sampling_params, multi_modal_data=None)
        action = out.outputs[0].token_ids
        logprobs = [0.0] * len(ids) + [d[t].logprob for t, d in zip(action, out.outputs[0].logprobs)]
        return {"prompt": prompt, "label": label, "observation_tokens": ids + action,
                "action_ranges": [(len(ids), len(ids) + len(action))], "rollout_log_probs": logprobs,
                "truncated": out.outputs[0].finish_reason == "length", "reward": None}
'''


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    old = export_code_paths()
    ray.init(num_cpus=2, include_dashboard=False)
    agent = tmp_path_factory.mktemp("agent") / "agent.py"
    agent.write_text(AGENT)
    try:
        handles = create_pat_engines(
            num_engines=2, tensor_parallel_size=TP, pretrain=model_dir("llama"), seed=0, full_determinism=False,
            enable_prefix_caching=False, enforce_eager=True, max_model_len=512, vllm_enable_sleep=True,
            agent_func_path=str(agent), pat_base_tp=1, pat_switch_schedule=[(4, 2)],
            pat_engine_kwargs={"dtype": "float64"},
            pat_rollout={"responses_per_step": 4, "group_size": 2, "tail_batching": {"eta": 0.5}})
        yield handles
        ray.get([e.shutdown.remote() for e in handles])
    finally:
        ray.shutdown()
        restore_env(old)


def init_update_group(engines) -> object:
    """``PolicyModelActor._init_vllm_sync_group``, with the CPU group in place of PyNccl."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world_size = len(engines) * TP + 1
    refs = [e.init_process_group.remote("127.0.0.1", port, i * TP + 1, world_size, "openrlhf", backend="gloo",
                                        use_ray=False) for i, e in enumerate(engines)]
    group = stateless_gloo_group("127.0.0.1", port, 0, world_size)
    ray.get(refs)
    return group


def broadcast_to_engines(engines, group, model) -> None:
    """``broadcast_to_vllm``: per parameter, metadata to every engine, then a broadcast from rank 0."""
    ray.get([e.wake_up.remote(tags=["weights"]) for e in engines])
    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):
        refs = [e.update_weight.remote(name, dtype=param.dtype, shape=param.shape, empty_cache=count == len(params))
                for e in engines]
        group.broadcast(param.data, src=0, stream=None)
        ray.get(refs)


def test_weight_sync_then_generation_is_token_exact(engines, model_dir, tmp_path):
    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=21)
    group = init_update_group(engines)
    broadcast_to_engines(engines, group, _hf_model(step))

    ray.get([e.wake_up.remote() for e in engines])
    pending = ray.get([e.get_num_unfinished_requests.remote() for e in engines])
    assert pending == [0, 0]
    refs = [engines[i % 2].generate.remote(p, VllmLikeSamplingParams(temperature=0.0, max_tokens=m, logprobs=1,
                                                                     skip_special_tokens=False))
            for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    outs = ray.get(refs)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_batch(step)
    for o, p, m in zip(outs, PROMPTS, MAX_NEW):
        c = o.outputs[0]
        assert o.prompt_token_ids == p and c.finish_reason in ("stop", "length")
        assert len(c.logprobs) == len(c.token_ids) and all(d[t].logprob <= 0 for t, d in zip(c.token_ids, c.logprobs))
        assert isinstance(c.text, str)
    assert all(n > 0 for n in ray.get([e.num_switches.remote() for e in engines]))
    ray.get([e.sleep.remote() for e in engines])


def test_driver_rollout_with_generate_responses(engines, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    ray.get([e.wake_up.remote() for e in engines])
    params = VllmLikeSamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, min_tokens=1, logprobs=1)
    prompts = ["the sum of two prime numbers", "compute the remainder", "a theorem and its proof"]
    refs = [engines[i % 2].generate_responses.remote(prompt=p, label="x", sampling_params=params, max_length=64,
                                                     hf_tokenizer=tokenizer, num_samples=2)
            for i, p in enumerate(prompts)]
    results = ray.get(refs)
    ray.get([e.sleep.remote() for e in engines])
    for prompt, samples in zip(prompts, results):
        assert len(samples) == 2
        for r in samples:
            (start, end), = r["action_ranges"]
            assert start == len(tokenizer(text=prompt, add_special_tokens=False)["input_ids"])
            assert end == len(r["observation_tokens"]) == len(r["rollout_log_probs"]) and 0 < end - start <= 12
        assert samples[0]["observation_tokens"] != samples[1]["observation_tokens"]


def test_pause_resume_and_unfinished_count(engines):
    engine = engines[0]
    ray.get(engine.wake_up.remote())
    ray.get(engine.pause_generation.remote())
    ref = engine.generate.remote(PROMPTS[0], VllmLikeSamplingParams(temperature=0.0, max_tokens=20))
    ready, _ = ray.wait([ref], timeout=1.5)
    assert not ready and ray.get(engine.get_num_unfinished_requests.remote()) == 1
    ray.get(engine.resume_generation.remote())
    assert len(ray.get(ref).outputs[0].token_ids) == 20
    assert ray.get(engine.get_num_unfinished_requests.remote()) == 0
    ray.get(engine.reset_prefix_cache.remote())


def test_colocated_sync_by_handles_then_generation_is_token_exact(engines, model_dir, tmp_path):
    """``update_weight_cuda_ipc`` with CPU handles: the actor shares each parameter with its workers by
    shared memory (Ray brings the handle's CPU storage to the actor by value; CUDA IPC handles are bytes)."""
    greedy = [VllmLikeSamplingParams(temperature=0.0, max_tokens=m) for m in MAX_NEW]
    ray.get([e.wake_up.remote() for e in engines])
    before = [o.outputs[0].token_ids for o in ray.get([engines[0].generate.remote(p, g) for p, g in zip(PROMPTS, greedy)])]
    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=22)
    sync_by_handles(engines, _hf_model(step))
    for engine in engines:
        got = [o.outputs[0].token_ids for o in ray.get([engine.generate.remote(p, g) for p, g in zip(PROMPTS, greedy)])]
        assert got == hf_greedy_batch(step) and got != before
    ray.get([e.sleep.remote() for e in engines])


def test_unsupported_paths_fail_clearly(engines):
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    with pytest.raises(ray.exceptions.RayTaskError, match="no handle for this worker's device 'cpu'"):
        ray.get(engines[0].update_weight_cuda_ipc.remote("model.norm.weight", dtype=None, shape=(1,),
                                                         ipc_handles={"GPU-0": reduce_tensor(torch.ones(1))}))
    with pytest.raises(ray.exceptions.RayTaskError, match="needs a pat engine on CUDA devices.*backend='gloo'"):
        ray.get(engines[0].init_process_group.remote("127.0.0.1", 1, 1, 3, "g", backend="nccl", use_ray=False))
    # the sampling options pat-engine lacks are refused by name (penalties, min_p, n, stop, logit_bias and
    # prompt_logprobs, refused here before, are accepted now: test_sampling_options_take_effect)
    for name, value in (("bad_words", ["x"]), ("best_of", 3),
                        ("structured_outputs", {"json": {}, "disable_fallback": True})):
        with pytest.raises(ray.exceptions.RayTaskError, match=name):
            ray.get(engines[0].generate.remote(PROMPTS[0], VllmLikeSamplingParams(max_tokens=4, **{name: value})))


def test_sampling_options_take_effect(engines, model_dir):
    """What the RL integrations refused before sharing pat-engine's translator, through the actor."""
    engine = engines[0]
    ray.get(engine.wake_up.remote())

    def run(prompt=PROMPTS[1], **kw):
        params = VllmLikeSamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kw})
        return ray.get(engine.generate.remote(prompt, params))

    plain = run().outputs[0]
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert run(**{name: 1.5}).outputs[0].token_ids != plain.token_ids, name
    assert run(logit_bias={7: 100.0}).outputs[0].token_ids == [7] * 40
    assert run(temperature=1.0, seed=3).outputs[0].token_ids != plain.token_ids
    assert run(temperature=1.0, seed=3, min_p=1.0).outputs[0].token_ids == plain.token_ids

    many = run(temperature=1.0, seed=5, n=3, logprobs=1).outputs
    assert [c.index for c in many] == [0, 1, 2] and len({tuple(c.token_ids) for c in many}) == 3
    assert all(len(c.logprobs) == len(c.token_ids) == 40 for c in many)

    stop = next(plain.text[i:i + 2] for i in range(len(plain.text) // 3, len(plain.text) - 1)
                if plain.text[i:i + 2].isascii() and plain.text[i:i + 2].isprintable() and plain.text[i:i + 2].strip())
    cut = run(stop=[stop]).outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop) and plain.text.startswith(cut.text)
    assert stop not in cut.text and len(cut.token_ids) < 40
    kept = run(stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids

    prompt = PROMPTS[3]
    scored = run(prompt, max_tokens=1, prompt_logprobs=2)
    rows = scored.prompt_logprobs
    assert rows[0] is None and len(rows) == len(prompt)
    for tok, row in zip(prompt[1:], rows[1:]):  # the prompt token and the 2 most likely, as vLLM
        ranked = {lp.rank: lp.logprob for lp in row.values() if lp.rank is not None}
        assert tok in row and sorted(ranked) == [1, 2] and 0 >= ranked[1] >= ranked[2]
        assert row[tok].logprob <= (ranked[1] if row[tok].rank else ranked[2]) + 1e-12


def test_prefix_caching_off_is_honoured(engines):
    """create_pat_engines(enable_prefix_caching=False) (as the fixture asks): no prompt block is ever reused."""
    engine = engines[1]
    ray.get(engine.wake_up.remote())
    prompt = list(range(10, 60))  # three full blocks of 16 tokens
    for _ in range(2):
        ray.get(engine.generate.remote(prompt, VllmLikeSamplingParams(temperature=0.0, max_tokens=2)))
    stats = ray.get(engine.prefix_cache_stats.remote())
    assert stats["hit_tokens"] == 0 and stats["cached_blocks"] == 0


def test_integrations_import_without_frameworks():
    """``import pat_integrations`` (and its framework-free helpers) must work with no RL framework installed."""
    blocked = ("ray", "verl", "openrlhf", "vllm", "sglang")
    code = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            "import pat_integrations, pat_integrations.stage, pat_integrations.sampling, pat_integrations.frontend\n"
            "try:\n    import pat_integrations.ray_cluster\nexcept ImportError as e:\n    print('needs', e.name)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(CODE_PATHS)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "needs ray"


def test_logprobs_mode_maps_onto_sampling_params():
    from pat_integrations.openrlhf.settings import PatActorSettings
    from pat_integrations.sampling import from_vllm_like

    settings = PatActorSettings.from_vllm_kwargs({"model": "m", "logprobs_mode": "processed_logprobs"})
    assert settings.logprobs_mode == "processed"
    params = from_vllm_like(types.SimpleNamespace(max_tokens=4, logprobs=0), logprobs_mode=settings.logprobs_mode)
    assert params.logprobs and params.logprobs_mode == "processed"
    with pytest.raises(ValueError, match="raw_logits"):
        PatActorSettings.from_vllm_kwargs({"model": "m", "logprobs_mode": "raw_logits"})


def test_tail_batched_steps_through_the_actor(engines, model_dir):
    """Short, short, long (the deferred prompts resumed exactly), then short, short, a weight sync and
    the long round regenerating the now stale partials: every returned response equals the same
    request run alone through ``generate``, with the seed the round gave it."""
    from pat_engine.rollout.runner import derived_seed

    engine = engines[0]
    ray.get(engine.wake_up.remote())
    stop = list(range(0, 390, 5))  # a fifth of the vocabulary ends a response: lengths vary per seed

    def params(seed=None):
        return VllmLikeSamplingParams(temperature=1.0, max_tokens=40, logprobs=1, seed=seed, stop_token_ids=stop)

    def check(result, prompts):
        for uid, outs in result.groups:
            assert len(outs) == 2
            for o in outs:
                c = o.outputs[0]  # c.index: the response's index within its prompt (its seed)
                ref = ray.get(engine.generate.remote(prompts[uid], params(derived_seed(9, uid, c.index)))).outputs[0]
                assert c.token_ids == ref.token_ids and c.finish_reason in ("stop", "length")
                assert [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] == pytest.approx(
                    [d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-9)

    for tag, sync in (("a", False), ("b", True)):
        prompts = {f"{tag}{i}": p for i, p in enumerate(PROMPTS)}
        uids = list(prompts)
        s0 = ray.get(engine.rollout_step.remote([(u, prompts[u]) for u in uids[:3]], params(9)))
        check(s0, prompts)  # before any weight sync: the references run under the same weights
        s1 = ray.get(engine.rollout_step.remote([(u, prompts[u]) for u in uids[3:]], params(9)))
        assert (s0.kind, s1.kind, s0.prompts_deferred, s1.queued) == ("short", "short", 1, 2)
        if sync:  # OpenRLHF's broadcast of the base weights (earlier tests synced others): a new version
            broadcast_to_engines(engines, init_update_group(engines), _hf_model(model_dir("llama")))
        s2 = ray.get(engine.rollout_step.remote([], params(9)))
        assert s2.kind == "long" and len(s2.groups) == 2
        assert (s2.resumed >= 1, s2.stale_regenerated >= 1) == (not sync, sync)
        check(s2, prompts)
    ray.get(engine.sleep.remote())


def test_rollout_options_are_checked_by_the_actor_settings():
    from pat_integrations.openrlhf.settings import PatActorSettings

    base = {"model": "m", "tensor_parallel_size": 2}
    s = PatActorSettings.from_vllm_kwargs({**base, "pat_rollout": {"responses_per_step": 8, "group_size": 4,
                                                                   "group_sizing": {"sizes": [2, 4, 8]}}})
    assert s.rollout.group_sizing.sizes == (2, 4, 8) and s.rollout.tail_batching is None
    for bad, match in [({"responses_per_step": 8, "tail_batching": True}, "group_size is required"),
                       ({"group_size": 2, "tail_batching": {"eta": 0.2}}, "responses_per_step is required"),
                       ({"responses_per_step": 8, "group_size": 2, "tail_batching": {"eta": -1}}, "eta must be"),
                       ({"responses_per_step": 0, "group_size": 2, "tail_batching": True}, "positive integer"),
                       ({"tailbatching": True}, "keys among")]:
        with pytest.raises(ValueError, match=match):
            PatActorSettings.from_vllm_kwargs({**base, "pat_rollout": bad})
