"""SGLang's native API on pat-serve over real HTTP (loopback, free port): /generate shapes and outputs,
streaming, aborts with partial output, pause modes, weight sync, memory, info, and bad input on every route.

One engine (TP1xDP2, float64) serves the module; outputs through the server are
compared with ``Engine.generate`` on the same engine. The call sequences of
slime (``slime/rollout/sglang_rollout.py``, ``slime/backends/sglang_utils/sglang_engine.py``)
and AReaL (``areal/engine/sglang_remote.py``) are replayed as they make them.
"""

from __future__ import annotations

import ast
import base64
import io
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from pat_engine import SamplingParams
from pat_engine.parallel.update_group import join_update_group
from pat_engine.serve.sglang.protocol import ROUTER_FIELDS, GenerateRequest

from http_fixtures import MAX_LEN, client, engine, server  # noqa: F401 (fixtures, used by name)
from waiting import wait_tokens

pytestmark = pytest.mark.slow  # starts worker processes

SGLANG_VERSION = "0.5.23"  # pip install --no-deps sglang==0.5.23: the request class these tests are checked against


@pytest.fixture(autouse=True)
def _clean_state(engine):
    yield
    engine.resume()
    engine.abort_all()


def greedy(engine, prompts, max_new: int, **kw) -> list:
    return engine.generate(prompts, SamplingParams(max_new_tokens=max_new, **kw), use_tqdm=False)


def sglang_normalised(body: dict) -> dict:
    """The body after SGLang's own ``GenerateReqInput`` normalises it (skipped where it cannot import on CPU)."""
    try:
        from sglang.srt.managers.io_struct import GenerateReqInput
    except Exception as exc:  # its import chain needs triton / torchvision (the CUDA stack)
        pytest.skip(f"sglang {SGLANG_VERSION} io_struct does not import on this CPU machine: {exc!r}")
    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    return body


def sglang_source_fields(cls_name: str) -> set[str] | None:
    """Field names of a class in the installed SGLang's io_struct.py, read from its source (no import)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return None


# ---- the contract: request fields -------------------------------------------------------------


def test_request_fields_are_sglangs():
    """Every /generate field pat-serve accepts is a GenerateReqInput field of SGLang (read from its source)."""
    fields = sglang_source_fields("GenerateReqInput")
    if fields is None:
        pytest.skip(f"sglang not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
    ours = set(GenerateRequest.model_fields) - ROUTER_FIELDS  # the router adds a few of its own
    assert ours <= fields, ours - fields
    for name, cls in [("AbortReq", "AbortRequest"), ("PauseGenerationReqInput", "PauseRequest"),
                      ("UpdateWeightFromDiskReqInput", "UpdateFromDiskRequest"),
                      ("UpdateWeightsFromDistributedReqInput", "UpdateFromDistributedRequest"),
                      ("InitWeightsUpdateGroupReqInput", "InitUpdateGroupRequest")]:
        import pat_engine.serve.sglang.protocol as proto

        theirs = sglang_source_fields(name) | {"rid"}  # BaseReq's rid
        ours = set(getattr(proto, cls).model_fields)
        assert ours <= theirs, (name, ours - theirs)


# ---- /generate -----------------------------------------------------------------------------------


def test_generate_equals_engine_generate(client, engine):
    body = {"input_ids": [[5, 6, 7], [100, 20, 30, 40]], "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "rid": ["a", "b"]}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    want = greedy(engine, body["input_ids"], 12)
    assert [o["output_ids"] for o in outs] == [w.token_ids for w in want]
    for o, w, rid in zip(outs, want, ["a", "b"]):
        m = o["meta_info"]
        assert m["id"] == rid and m["prompt_tokens"] == len(w.prompt_token_ids)
        assert m["completion_tokens"] == 12 and m["cached_tokens"] == 0
        assert m["finish_reason"] == {"type": "length", "length": 12}
        assert m["weight_version"] == engine.weight_version and m["e2e_latency"] > 0
        assert m["weight_versions"] == [{"version": engine.weight_version, "start": 0, "end": 12}]
        assert o["text"] == engine.tokenizer.decode(w.token_ids, skip_special_tokens=True)
    single = client.post("/generate", json={"text": "the answer is", "sampling_params": {"max_new_tokens": 8,
                                                                                       "temperature": 0}}).json()
    assert single["output_ids"] == greedy(engine, ["the answer is"], 8)[0].token_ids


def test_generate_logprobs_and_stop_token(client, engine):
    want = greedy(engine, [[9, 8, 7]], 10, temperature=0.7, seed=5, logprobs=True, logprobs_mode="processed")[0]
    stop = want.token_ids[4]
    body = {"input_ids": [9, 8, 7], "return_logprob": True, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.7, "sampling_seed": 5}}
    out = client.post("/generate", json=body).json()
    assert out["output_ids"] == want.token_ids
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == want.token_ids and [lp for lp, _, _ in lps] == pytest.approx(want.logprobs)
    assert lps[0][2] == engine.tokenizer.decode([want.token_ids[0]])
    body["sampling_params"]["stop_token_ids"] = [stop]
    out = client.post("/generate", json=body).json()
    first = want.token_ids.index(stop)
    assert out["output_ids"] == want.token_ids[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == engine.tokenizer.decode(want.token_ids[:first], skip_special_tokens=True)  # stop trimmed


def test_streaming_is_sglangs_cumulative_form(client, engine):
    body = {"input_ids": [11, 12, 13], "stream": True, "sampling_params": {"max_new_tokens": 9, "temperature": 0}}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    import json

    chunks = [json.loads(x) for x in lines[:-1]]
    ids = [c["output_ids"] for c in chunks]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:]))  # cumulative, growing
    assert ids[-1] == greedy(engine, [[11, 12, 13]], 9)[0].token_ids
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_request_checked_by_sglangs_class(client):
    body = {"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    sglang_normalised(dict(body))
    assert len(client.post("/generate", json=body).json()) == 2


def test_n_samples_come_back_as_a_list_equal_to_engine_generate(client, engine):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0.9, "n": 3,
                                                        "sampling_seed": 4}}
    outs = client.post("/generate", json=body).json()
    ref = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=0.9, n=3, seed=4),
                          use_tqdm=False)[0]
    assert [o["output_ids"] for o in outs] == [s.token_ids for s in ref.samples]


def test_penalties_stop_strings_and_prompt_logprobs_equal_engine_generate(client, engine):
    prompt = [5, 6, 7, 8, 9, 10]
    sp = {"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.3, "min_p": 0.05}
    out = client.post("/generate", json={"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                                         "logprob_start_len": 0, "top_logprobs_num": 2}).json()
    ref = engine.generate([prompt], SamplingParams(max_new_tokens=10, repetition_penalty=1.3, min_p=0.05,
                                                   logprobs=True, logprobs_mode="processed", top_logprobs=2,
                                                   prompt_logprobs=2), use_tqdm=False)[0]
    assert out["output_ids"] == ref.token_ids
    meta = out["meta_info"]
    assert [row[0] for row in meta["output_token_logprobs"]] == pytest.approx(ref.logprobs, abs=1e-9)
    assert [row[1] for row in meta["input_token_logprobs"]] == prompt and meta["input_token_logprobs"][0][0] is None
    assert [row[0] for row in meta["input_token_logprobs"][1:]] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-9)
    assert all(len(alts) == 2 for alts in meta["output_top_logprobs"])
    text = engine.tokenizer.decode(ref.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        cut = client.post("/generate", json={"input_ids": prompt, "sampling_params": {**sp, "stop": [stop]}}).json()
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in cut["text"] and text.startswith(cut["text"])


@pytest.mark.parametrize("body, match", [
    ({"input_ids": [1, 2], "bogus": 1}, "unknown or unsupported field 'bogus'"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}}, "unknown field 'sampling_params.max_new_token'"),
    ({"input_ids": "12"}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"min_p": 1.5}}, "min_p must be in [0, 1]"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "n must be an integer"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in"),
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"x": 1.0}}}, "logit_bias: key 'x' is not a token id"),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 99}, "top_logprobs must be an integer"),
    ({"input_ids": [1, 2], "text": "x"}, "exactly one of text or input_ids"),
    ({"input_ids": [[1, 2], [3]], "rid": "one"}, "rid as a list"),
    ({"input_ids": [[1, 2], [3]], "rid": ["x", "x"]}, "unique"),
    ({"input_ids": [1, 10 ** 7]}, "outside the vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10 ** 6}}, "exceeds the context length"),
])
def test_bad_generate_requests(client, body, match):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"], r.json()


# ---- control: abort, pause modes ------------------------------------------------------------------


def _post_async(pool: ThreadPoolExecutor, url: str, body: dict):
    return pool.submit(lambda: httpx.post(url + "/generate", json=body, timeout=120).json())


def test_slime_oversample_then_abort_all_keeps_partial_output(server, client, engine):
    """slime: over-sample a batch, abort_all once enough came back; aborted ones carry their tokens and
    logprobs; resubmitting prompt + partial with the same sampling_seed finishes them exactly."""
    prompts = [[5, 6, 7], [9, 9, 9, 9], [100, 101]]
    sp = {"max_new_tokens": 300, "temperature": 0.9, "sampling_seed": 77, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        futs = [_post_async(pool, server.url, {"input_ids": p, "sampling_params": sp, "return_logprob": True,
                                               "rid": f"os-{i}"}) for i, p in enumerate(prompts)]
        wait_tokens(engine, 3, 3)
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        outs = [f.result() for f in futs]
    for p, o in zip(prompts, outs):
        k = len(o["output_ids"])
        assert o["meta_info"]["finish_reason"]["type"] == "abort" and 3 <= k < 300
        assert len(o["meta_info"]["output_token_logprobs"]) == k
        # partial-rollout resume (slime --partial-rollout): prompt + generated, max_new_tokens lowered
        rest = client.post("/generate", json={"input_ids": p + o["output_ids"],
                                              "sampling_params": dict(sp, max_new_tokens=10)}).json()
        full = client.post("/generate", json={"input_ids": p, "sampling_params": dict(sp, max_new_tokens=k + 10)}).json()
        assert o["output_ids"] + rest["output_ids"] == full["output_ids"]


def test_the_over_provision_abort_resume_recipe_of_slime_and_areal(server, client, engine):
    """docs/rollout.md's SGLang recipe: a step launches more responses than it needs, keeps the first
    ones to finish, aborts the stragglers by rid; the next step resumes each straggler from prompt +
    partial (same sampling_seed, max_new_tokens lowered by what it has) and gets exactly the tokens
    and log-probs of an uninterrupted run, whatever the layout did in between."""
    prompts = [[5, 6, 7], [9, 9, 9, 9], [100, 101], [40, 41, 42], [7, 7], [300, 3]]
    lengths = [6, 8, 7, 400, 420, 440]  # three short, three stragglers
    want = 3

    def params(i: int, max_new: int) -> dict:
        return {"max_new_tokens": max_new, "temperature": 1.0, "sampling_seed": 1000 + i, "ignore_eos": True}

    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [_post_async(pool, server.url, {"input_ids": p, "sampling_params": params(i, lengths[i]),
                                               "return_logprob": True, "rid": f"step0-{i}"})
                for i, p in enumerate(prompts)]
        kept = [f.result() for f in futs[:want]]  # the first to finish; the stragglers are still generating
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in kept)
        for i in range(want, len(prompts)):
            assert client.post("/abort_request", json={"rid": f"step0-{i}"}).status_code == 200
        partial = {i: futs[i].result() for i in range(want, len(prompts))}
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in partial.values())
    engine.reconfigure(2)  # between steps the layout may change (a switch, a weight sync, ...)
    try:
        for i, o in partial.items():  # step 1: the stragglers resume
            k = len(o["output_ids"])
            rest = client.post("/generate", json={
                "input_ids": prompts[i] + o["output_ids"], "sampling_params": params(i, lengths[i] - k),
                "return_logprob": True, "rid": f"step1-{i}"}).json()
            tokens = o["output_ids"] + rest["output_ids"]
            logprobs = o["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
            whole = client.post("/generate", json={"input_ids": prompts[i], "sampling_params": params(i, lengths[i]),
                                                   "return_logprob": True}).json()
            assert tokens == whole["output_ids"] and len(tokens) == lengths[i]
            assert [lp for lp, _, _ in logprobs] == pytest.approx(
                [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]], abs=1e-9)
    finally:
        engine.reconfigure(1)


def test_abort_by_rid_and_unknown_rid(server, client, engine):
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        fut = _post_async(pool, server.url, {"input_ids": [3, 4], "rid": "mine", "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0}})
        wait_tokens(engine, 1, 2)
        assert client.post("/abort_request", json={"rid": "mine"}).status_code == 200
        out = fut.result()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "mine"
    assert out["output_ids"] == greedy(engine, [[3, 4]], len(out["output_ids"]), ignore_eos=True)[0].token_ids
    assert client.post("/abort_request", json={"rid": 5}).status_code == 400
    assert client.post("/abort_request", json={"rid": "x", "everything": True}).status_code == 400


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_modes_keep_outputs(server, client, engine, mode):
    """in_place keeps KV, retract frees it (recompute): either way the tokens equal an unpaused run."""
    body = {"input_ids": [21, 22, 23], "sampling_params": {"max_new_tokens": 60, "temperature": 0.8,
                                                          "sampling_seed": 3, "ignore_eos": True}}
    want = client.post("/generate", json=body).json()["output_ids"]
    with ThreadPoolExecutor(1) as pool:
        fut = _post_async(pool, server.url, body)
        wait_tokens(engine, 1, 5)
        r = client.post("/pause_generation", json={"mode": mode})
        assert r.status_code == 200 and r.json()["status"] == "ok"
        reqs = engine.cluster_status().requests
        assert len(reqs) == 1 and reqs[0].cached == (mode == "in_place")  # retract: no KV left
        n = reqs[0].generated
        time.sleep(0.3)
        assert engine.cluster_status().requests[0].generated == n  # frozen
        assert client.post("/pause_generation", json={"mode": mode}).status_code == 200  # twice: fine
        assert client.post("/continue_generation", json={}).status_code == 200
        out = fut.result()
    assert out["output_ids"] == want
    assert (out["meta_info"]["num_retractions"] > 0) == (mode == "retract")


def test_pause_abort_mode_and_bad_pause_bodies(server, client, engine):
    with ThreadPoolExecutor(1) as pool:
        fut = _post_async(pool, server.url, {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 400,
                                                                                      "ignore_eos": True}})
        wait_tokens(engine, 1, 2)
        assert client.post("/pause_generation", json={"mode": "abort"}).json()["num_requests"] == 1
        assert fut.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.post("/continue_generation").status_code == 200
    r = client.post("/continue_generation")  # continue without pause: fine, says so
    assert r.status_code == 200 and "not paused" in r.json()["message"]
    for bad in [{"mode": "freeze"}, {"mode": 1}, {"mode": "abort", "x": 1}]:
        r = client.post("/pause_generation", json=bad)
        assert r.status_code == 400, r.text


# ---- weights ----------------------------------------------------------------------------------------


def _serialize(named: list) -> str:
    buf = io.BytesIO()
    torch.save(named, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _hf_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_slime_pause_flush_update_continue(server, client, engine, model_dir):
    """slime's weight sync: pause -> flush_cache -> update (tensor) -> continue; a request that spans the
    update reports both versions, by token."""
    weights = _hf_tensors(model_dir("llama"))
    name = "model.layers.0.mlp.down_proj.weight"
    body = {"input_ids": [8, 9, 10], "sampling_params": {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}}
    before = client.post("/generate", json=body).json()["output_ids"]
    v0 = client.get("/get_weight_version").json()["weight_version"]
    with ThreadPoolExecutor(1) as pool:
        fut = _post_async(pool, server.url, body)
        wait_tokens(engine, 1, 5)
        assert client.post("/pause_generation", json={}).status_code == 200  # SGLang's default mode is abort...
        out_aborted = fut.result()
    assert out_aborted["meta_info"]["finish_reason"]["type"] == "abort"
    with ThreadPoolExecutor(1) as pool:
        client.post("/continue_generation", json={})
        fut = _post_async(pool, server.url, body)
        wait_tokens(engine, 1, 5)
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert client.get("/flush_cache").status_code == 200
        k = engine.cluster_status().requests[0].generated
        changed = [(name, weights[name] * 1.5)]
        r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize(changed)],
                                                              "weight_version": "step-1", "flush_cache": False})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert client.get("/get_weight_version").json() == {"weight_version": "step-1"}
        assert client.post("/continue_generation", json={}).status_code == 200
        out = fut.result()
    spans = out["meta_info"]["weight_versions"]
    assert spans == [{"version": v0, "start": 0, "end": k}, {"version": "step-1", "start": k, "end": 80}]
    assert out["meta_info"]["weight_version"] == "step-1"
    assert out["output_ids"][:k] == before[:k]
    # restore the original weights (unnamed: the version is the update count)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [_serialize([(name, weights[name])])]})
    assert r.json()["success"] and client.get("/get_weight_version").json()["weight_version"] == str(engine.weights.updates)
    assert client.post("/generate", json=body).json()["output_ids"] == before


def _sglang_handles(named: list, ranks: int) -> list[str]:
    """What SGLang's ``weight_sync.utils.update_weights`` posts for a TP``ranks`` trainer mesh: per rank,
    a pickle of ``[(name, LocalSerializedTensor(values=[handle from trainer rank i, ...]))]``. SGLang does
    not import on CPU, so its dataclass is stood in for under its own module path (the pickle is the same)."""
    import dataclasses
    import sys
    import types

    from pat_engine.model.weight_handles import serialize

    module = "sglang.srt.model_executor.model_runner_components.weight_updater"
    cls = dataclasses.make_dataclass("LocalSerializedTensor", [("values", list)])
    cls.__module__ = module
    parts = module.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({n: types.ModuleType(n) for n in names})  # pickle imports the path to check the class
    sys.modules[module].LocalSerializedTensor = cls
    try:
        # each "trainer rank" shares its own copy (on GPUs: the copy on the GPU that rank shares with a worker)
        entry = serialize([(n, cls([serialize(t.clone()) for _ in range(ranks)])) for n, t in named])
    finally:
        for n, old in saved.items():
            if old is None:
                del sys.modules[n]
            else:
                sys.modules[n] = old
    return [base64.b64encode(entry).decode()] * ranks


def test_update_from_tensor_by_handle_in_sglang_s_form(client, engine, model_dir):
    weights = _hf_tensors(model_dir("llama"))
    name = "model.layers.0.mlp.down_proj.weight"
    body = {"input_ids": [8, 9, 10], "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}
    before = client.post("/generate", json=body).json()["output_ids"]
    changed = [(name, weights[name] * 1.5)]
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": _sglang_handles(changed, 2),
                                                          "weight_version": "by-handle", "load_format": "direct"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert client.get("/get_weight_version").json() == {"weight_version": "by-handle"}
    moved = client.post("/generate", json=body).json()["output_ids"]
    assert moved != before
    r = client.post("/update_weights_from_tensor",
                    json={"serialized_named_tensors": [_serialize(changed)]})  # the same weights by value
    assert r.json()["success"] and client.post("/generate", json=body).json()["output_ids"] == moved
    bad = _sglang_handles([(name, torch.zeros(3, 3, dtype=torch.float64))], 2)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": bad})
    assert r.status_code == 400 and "shape" in r.json()["message"], r.text
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": _sglang_handles([(name, weights[name])], 2)})
    assert r.json()["success"] and client.post("/generate", json=body).json()["output_ids"] == before


@pytest.mark.parametrize("named, match", [
    ([("model.layers.0.mlp.nonexistent.weight", torch.zeros(2))], "unknown weight"),
    ([("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))], "shape"),
    ([("model.layers.0.mlp.down_proj.weight", None)], "pairs"),
])
def test_bad_tensor_update_is_400_and_changes_nothing(client, engine, named, match):
    body = {"input_ids": [8, 9, 10], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    before = client.post("/generate", json=body).json()["output_ids"]
    version = engine.weight_version
    if named[0][1] is None:
        payload = [base64.b64encode(b"not a torch file").decode()]
    else:
        payload = [_serialize(named)]
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": payload})
    assert r.status_code == 400 and not r.json()["success"] and match in r.json()["message"], r.text
    assert engine.weight_version == version
    assert client.post("/generate", json=body).json()["output_ids"] == before


def test_bad_dtype_and_distributed_refusals(client, engine):
    bad = {"names": ["model.layers.0.mlp.down_proj.weight"], "dtypes": ["int8"], "shapes": [[64, 128]]}
    r = client.post("/update_weights_from_distributed", json=bad)
    assert r.status_code == 400 and "floating-point" in r.json()["message"]
    r = client.post("/update_weights_from_distributed", json=dict(bad, dtypes=["float32", "float32"]))
    assert r.status_code == 400 and "differ in length" in r.json()["message"]
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 0, "world_size": 3})
    assert r.status_code == 400 and "do not fit" in r.json()["message"]
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 1, "world_size": 3, "backend": "nccl"})
    assert r.status_code == 400 and "needs an engine on CUDA devices" in r.json()["message"], r.text
    r = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent/ckpt"})
    assert r.status_code == 400 and not r.json()["success"]
    assert client.post("/update_weights_from_disk", json={"path": "x"}).status_code == 400  # unknown field
    r = client.post("/destroy_weights_update_group", json={"group_name": "none"})
    assert r.status_code == 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_weights_from_distributed(server, client, engine, model_dir):
    """A trainer joins a gloo group with the two workers (own TCPStore on loopback) and broadcasts full
    tensors; each worker slices its shard under the current layout (also after a switch)."""
    weights = _hf_tensors(model_dir("llama"))
    names = ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    port = _free_port()
    box: dict = {}

    def trainer() -> None:
        box["pg"] = join_update_group("127.0.0.1", port, 0, 3, "pat-test", "gloo", 60)

    t = threading.Thread(target=trainer)
    t.start()
    r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                        "rank_offset": 1, "world_size": 3, "group_name": "pat-test",
                                                        "backend": "gloo"})
    t.join(60)
    assert r.status_code == 200 and r.json()["success"], r.text
    body = {"input_ids": [8, 9, 10], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    before = client.post("/generate", json=body).json()["output_ids"]

    def push(tensors: list, version: str | None) -> httpx.Response:
        meta = {"names": names, "dtypes": [str(x.dtype).removeprefix("torch.") for x in tensors],
                "shapes": [list(x.shape) for x in tensors], "group_name": "pat-test", "weight_version": version}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: httpx.post(server.url + "/update_weights_from_distributed", json=meta, timeout=120))
            for x in tensors:
                torch.distributed.broadcast(x.contiguous(), src=0, group=box["pg"])
            return fut.result()

    engine.reconfigure(2)  # the shards are cut under TP2xDP1 now
    try:
        r = push([weights[n] * 2.0 for n in names], "dist-1")
        assert r.status_code == 200 and r.json()["success"], r.text
        assert client.get("/get_weight_version").json()["weight_version"] == "dist-1"
        assert client.post("/generate", json=body).json()["output_ids"] != before
        assert push([weights[n] for n in names], "dist-2").json()["success"]
        assert client.post("/generate", json=body).json()["output_ids"] == before
    finally:
        engine.reconfigure(1)
        client.post("/destroy_weights_update_group", json={"group_name": "pat-test"})
        torch.distributed.destroy_process_group(box["pg"])
    assert client.post("/generate", json=body).json()["output_ids"] == before


# ---- memory, info ------------------------------------------------------------------------------------


def test_release_and_resume_memory(client, engine):
    body = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    # weights from disk, so that a level-2 release can reload them (after in-memory pushes the trainer must push)
    assert client.post("/update_weights_from_disk", json={"model_path": engine.config.model}).json()["success"]
    before = client.post("/generate", json=body).json()["output_ids"]
    assert client.post("/release_memory_occupation", json={}).json()["success"]
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "asleep" in r.text
    assert client.get("/health_generate").status_code == 200  # the process is fine; it sleeps
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
    assert client.post("/generate", json=body).json()["output_ids"] == before
    assert client.post("/resume_memory_occupation", json={"tags": ["gpu"]}).status_code == 400


def test_the_rl_step_boundary_under_load_changes_no_token(client, engine):
    """slime/veRL's step boundary (pause abort -> release -> resume -> continue) with a request arriving
    while paused, a retried resume on an awake engine, then repeated prompts served from the prefix cache:
    every response equals the one before any memory was released."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 5
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    want = client.post("/generate", json=body).json()["output_ids"]
    assert client.post("/generate", json=body).json()["output_ids"] == want  # from the prefix cache
    for _ in range(2):
        assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.post, "/generate", json=body)  # waits through the release
            while engine.num_unfinished_requests() == 0:
                time.sleep(0.01)
            assert client.post("/release_memory_occupation", json={}).json()["success"]
            for tags in ({"tags": ["weights"]}, {"tags": ["kv_cache"]}, {}):  # the last one: a retry, a no-op
                r = client.post("/resume_memory_occupation", json=tags).json()
                assert r["success"], r
            assert "nothing to do" in r["message"]
            assert client.post("/continue_generation", json={}).status_code == 200
            assert queued.result(120).json()["output_ids"] == want
        assert client.post("/resume_memory_occupation", json={}).json()["success"]  # awake: changes nothing
        assert [client.post("/generate", json=body).json()["output_ids"] for _ in range(2)] == [want, want]
    assert client.get("/pat/kv").json()["invariants"] == "ok"


def test_info_and_load_routes(client, engine):
    info = client.get("/get_model_info").json()
    assert info["is_generation"] and info["weight_version"] == engine.weight_version
    server = client.get("/get_server_info").json()
    assert (server["tp_size"], server["dp_size"], server["context_length"]) == (1, 2, MAX_LEN)
    assert client.get("/health_generate").status_code == 200
    loads = client.get("/v1/loads").json()
    assert loads["dp_rank_count"] == 2 and loads["aggregate"]["num_reqs"] == 0
    assert [g["dp_rank"] for g in client.get("/get_load").json()] == [0, 1]
    r = client.post("/pat/reconfigure", json={"tp": 2})
    assert r.json()["layout"] == "TP2xDP1" and client.get("/get_server_info").json()["tp_size"] == 2
    assert client.post("/pat/reconfigure", json={"tp": 3}).status_code == 400
    client.post("/pat/reconfigure", json={"tp": 1})


def test_areal_call_sequence(client, engine):
    """AReaL's remote SGLang engine: /health, then /generate with input_ids and return_logprob, reading
    output_token_logprobs and finish_reason["type"]; weights through /update_weights_from_disk with a version."""
    assert client.get("/health").status_code == 200
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0,
                                                         "top_k": -1, "stop_token_ids": [], "ignore_eos": False,
                                                         "skip_special_tokens": True, "frequency_penalty": 0.0},
            "return_logprob": True, "stream": False}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    r = client.post("/update_weights_from_disk", json={"model_path": engine.config.model, "weight_version": "areal-7",
                                                       "abort_all_requests": True})
    assert r.json()["success"] and client.get("/get_weight_version").json()["weight_version"] == "areal-7"
