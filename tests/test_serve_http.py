"""The OpenAI-compatible server over real HTTP on a free loopback port: outputs, streaming, errors, metrics, aborts.

One engine (TP1xDP2, float64) serves the whole module; outputs through the
server are compared with ``Engine.generate`` on the same engine and requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from pat_engine import SamplingParams
from pat_engine.core.chat import ChatOptions, apply_chat_template
from pat_engine.predictor.policy import ScheduledSwitches
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app
from pat_engine.version import __version__

from http_fixtures import MAX_LEN, MODEL, client, engine, server  # noqa: F401 (fixtures, used by name)

pytestmark = pytest.mark.slow  # starts worker processes

PROMPTS = ["the answer is", [5, 6, 7, 8, 9], "prove that the sum"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the sum of two odd numbers"}]


def reference(engine, prompts, max_new: int, logprobs: bool = False) -> list:
    return engine.generate(prompts, SamplingParams(max_new_tokens=max_new, logprobs=logprobs), use_tqdm=False)


def sse_events(response: httpx.Response) -> list:
    """Parsed ``data:`` payloads of an SSE response; the literal ``[DONE]`` stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(r: httpx.Response, status: int, match: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert match in err["message"], err["message"]


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_LEN
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["layout"] == "TP1xDP2"


def test_completions_equal_engine_generate(client, engine):
    ref = reference(engine, PROMPTS, 12)
    for prompt, want in zip(PROMPTS, ref):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
        assert choice["prompt_token_ids"] == want.prompt_token_ids
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 12,
                                 "total_tokens": len(want.prompt_token_ids) + 12, "prompt_tokens_details": None}
    # a list of prompts gives one choice per prompt, in order
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0::2], "max_tokens": 12, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == [ref[0].text, ref[2].text]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_streaming_completion_equals_non_streaming(client, engine):
    want = reference(engine, [PROMPTS[0]], 20)[0]
    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "stream": True, "return_token_ids": True,
            "logprobs": 1, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    logprobs = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(logprobs) == 20 and all(lp <= 0 for lp in logprobs)


def test_chat_equals_engine_generate(client, engine):
    ids = apply_chat_template(engine.tokenizer, CHAT)
    want = reference(engine, [ids], 16, logprobs=True)[0]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 16,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 16
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(want.logprobs)
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)

    with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 16, "temperature": 0,
                                                             "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, content_type, status, match", [
    ('{"prompt": "hi", "max_tokens": 4', "application/json", 400, "not valid JSON"),
    ('["a list"]', "application/json", 400, "must be a JSON object"),
    ("[" * 5000, "application/json", 400, "nests 5000 levels deep"),  # was a RecursionError: a 500
    ('{"prompt": ' + "[" * 3000 + "]" * 3000 + ', "max_tokens": 4}', "application/json", 400, "nests 3001 levels"),
    ('{"prompt": "hi", "max_tokens": 4, "functions": []}', "application/json", 400, "unknown or unsupported field 'functions'"),
    ('{"prompt": "hi", "max_tokens": -3}', "application/json", 400, "max_tokens: Input should be greater than or equal to 1"),
    ('{"prompt": "hi", "max_tokens": 1000000}', "application/json", 400, "exceeds the context length 512"),
    (json.dumps({"prompt": [7] * 600, "max_tokens": 4}), "application/json", 400, "context holds 512"),
    ('{"prompt": "hi", "max_tokens": 4, "n": 0}', "application/json", 400, "n: Input should be greater than or equal to 1"),
    ('{"prompt": "hi", "max_tokens": 4, "model": "gpt-9"}', "application/json", 404, "does not exist"),
    ('{"prompt": "hi", "max_tokens": 4}', "text/plain", 415, "Content-Type must be application/json"),
    ('prompt=hi', "application/x-www-form-urlencoded", 415, "Content-Type must be application/json"),
])
def test_bad_completion_requests(client, body, content_type, status, match):
    r = client.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert_error(r, status, match)
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, "the server must keep serving after a bad request"


def test_bad_chat_requests(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400, "role")
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 0}), 400,
                 "max_completion_tokens")
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, "tools": []}), 400, "tools")
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, "functions": []}), 400, "'functions'")
    assert_error(client.get("/v1/chat/completions"), 405, "Method Not Allowed")
    assert_error(client.get("/v1/nothing-here"), 404, "Not Found")


def _metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_log_prob_entries_name_their_tokens_by_id_when_asked(client):
    """vLLM's return_tokens_as_token_ids: RL trainers read the exact ids from the log-prob entries."""
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 2, **body})
    choice = chat.json()["choices"][0]
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(a["token"].startswith("token_id:") for c in choice["logprobs"]["content"] for a in c["top_logprobs"])
    done = client.post("/v1/completions", json={"prompt": "the answer is", "logprobs": 1, **body}).json()
    assert done["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in done["choices"][0]["token_ids"]]
    with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "stream": True,
                                                             **body}) as r:
        chunks = [e for e in sse_events(r)[:-1] if e["choices"] and e["choices"][0].get("logprobs")]
    streamed = [c["token"] for e in chunks for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed == [f"token_id:{t}" for t in choice["token_ids"]]


def test_a_chat_s_prompt_log_probs_come_in_vllms_shape(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 2,
                                                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    want = engine.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    entries = body["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, lp in zip(ids[1:], entries[1:], want.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=1e-9) and 2 <= len(entry) <= 3
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs is supported without stream only" in r.text


def test_tokenize_gives_the_ids_the_generation_routes_run_and_detokenize_inverts_it(client, engine):
    """vLLM's /tokenize and /detokenize: the count is the prompt_tokens the generation routes report."""
    text = "the answer is"
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ran = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert body["tokens"] == engine.tokenizer(text)["input_ids"] and body["count"] == ran == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN and body["token_strs"] == engine.tokenizer.convert_ids_to_tokens(
        body["tokens"])
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # the tiny tokenizer adds no BOS:
    # that the flag reaches the tokenizer is test_request_limits' test_a_text_prompt_takes_the_special_tokens_asked
    assert client.post("/detokenize", json={"tokens": bare}).json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}

    chat = CHAT + [{"role": "assistant", "content": "it is"}]
    for fields in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        r = client.post("/tokenize", json={"messages": chat, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == apply_chat_template(engine.tokenizer, chat, ChatOptions(**{
            k: v for k, v in fields.items()}))
    ran = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert client.post("/tokenize", json={"messages": CHAT}).json()["count"] == ran["prompt_tokens"]
    assert client.get("/version").json() == {"version": __version__}


@pytest.mark.parametrize("route, body, match", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "give exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs: only with messages"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "may not set 'tokenize'"),
    ("/tokenize", {"prompt": "x" * (32 * MAX_LEN + 1)}, "more than the"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist"),
    ("/detokenize", {"tokens": [10 ** 9]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": [1] * MAX_LEN}, "the context holds"),
    ("/detokenize", {"tokens": [-1]}, "greater than or equal to 0"),
])
def test_bad_tokenizer_requests_are_refused_by_name(client, route, body, match):
    r = client.post(route, json=body)
    assert r.status_code in (400, 404) and match in r.text, r.text


def test_metrics(client):
    before = client.get("/metrics").text
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    text = client.get("/metrics").text
    assert _metric(text, "pat:generation_tokens_total") - _metric(before, "pat:generation_tokens_total") == 7
    assert _metric(text, "pat:prompt_tokens_total") - _metric(before, "pat:prompt_tokens_total") == 3
    assert _metric(text, "pat:request_success_total", finished_reason="length") >= 1
    assert _metric(text, "pat:requests_rejected_total", reason="invalid") >= 1
    assert _metric(text, "pat:num_requests_running") == 0
    assert _metric(text, "pat:e2e_request_latency_seconds_count") >= 1
    assert _metric(text, "pat:inter_token_latency_seconds_count") >= 6
    assert _metric(text, "pat:layout_tp") == 1 and _metric(text, "pat:layout_dp") == 2
    assert _metric(text, "pat:layout_switches_total", ok="true") == 0
    assert 'pat:layout_switch_seconds_total{component="kv"' in text
    assert 0 <= _metric(text, "pat:prefix_cache_hit_rate") <= 1 and _metric(text, "pat:prefix_cache_cached_blocks") >= 0


def _wait_idle(engine, timeout: float = 10.0) -> None:
    start = time.monotonic()
    while engine.num_unfinished_requests():
        assert time.monotonic() - start < timeout, "the request was not aborted"
        time.sleep(0.05)


def _aborted(url: str) -> float:
    return _metric(httpx.get(url + "/metrics").text, "pat:request_success_total", 0, finished_reason="abort")


@contextlib.contextmanager
def paused(engine):
    """Hold the engine between steps, so a request stays in flight however fast the machine is."""
    engine.pause()
    try:
        yield
    finally:
        engine.resume()


def test_stream_disconnect_aborts_the_request(server, engine):
    before = _aborted(server.url)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 500, "ignore_eos": True,
                                                       "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
            assert next(lines).startswith("data: ")  # generating: its KV is allocated
            with paused(engine):
                assert engine.num_unfinished_requests() == 1
                r.close()  # the client goes away mid-stream
                _wait_idle(engine)  # aborted and removed (its KV blocks freed) while the engine is held
    assert _aborted(server.url) == before + 1
    assert _metric(httpx.get(server.url + "/metrics").text, "pat:num_requests_running") == 0


def test_non_streaming_disconnect_aborts_the_request(server, engine):
    before = _aborted(server.url)
    with paused(engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=0.5, json={"prompt": [9, 8, 7], "max_tokens": 50})
        _wait_idle(engine)
    assert _aborted(server.url) == before + 1


def test_live_switch_while_serving_keeps_outputs(client, engine):
    """A layout switch in the middle of a streamed request changes neither its tokens nor the server's answers."""
    want = reference(engine, [[11, 12, 13]], 200)[0]
    engine.set_policy(ScheduledSwitches([(0, 2)]))  # TP1xDP2 -> TP2xDP1 at the first decode step with work
    try:
        with client.stream("POST", "/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 200,
                                                            "temperature": 0, "stream": True, "return_token_ids": True}) as r:
            tokens = [t for e in sse_events(r) if e != "[DONE]" for t in e["choices"][0]["token_ids"]]
    finally:
        engine.set_policy(None)
    assert tokens == want.token_ids
    text = httpx.get(str(client.base_url) + "/metrics").text
    assert _metric(text, "pat:layout_tp") == 2 and _metric(text, "pat:layout_switches_total", ok="true") == 1
    assert _metric(text, "pat:layout_switch_seconds_total", component="total") > 0
    switch = client.get("/pat/timeline").json()["switches"][-1]
    assert (switch["from_layout"], switch["to_layout"]) == ("TP1xDP2", "TP2xDP1")
    assert client.get("/health").json()["layout"] == "TP2xDP1"
    engine.reconfigure(1)


def test_overload_and_shutdown_answer_503(engine):
    """A second server on the same engine, queue limit 1: a second request is refused, then shutdown refuses all."""
    app = build_app(engine, ServerConfig(MODEL, max_queued_requests=1))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c, paused(engine):
        with c.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 50,
                                                            "stream": True}) as first:
            lines = first.iter_lines()
            assert "assistant" in next(lines)  # the role chunk: the request is in flight
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert_error(r, 503, "overloaded")
            assert r.headers["retry-after"] == "1"
            asyncio.run(app.state.pat.aengine.shutdown())  # what the server's lifespan does on SIGTERM
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["error"]["code"] == 503 and "shut down" in rest[-1]["error"]["message"]  # in-band
        assert_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503, "shutting down")
        assert_error(c.get("/health"), 503, "shutting down")
        assert engine.num_unfinished_requests() == 0
