"""What RL and evaluation clients send, over real HTTP: n samples, stop strings, explicit defaults.

Outputs are compared with ``Engine.generate`` on the same engine (float64); streamed text must
equal non-streamed text, also when a stop string holds text back.
"""

from __future__ import annotations

import httpx
import pytest

from pat_engine import Engine, SamplingParams
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app
from test_serve_http import assert_error, sse_events

pytestmark = pytest.mark.slow  # starts worker processes

PROMPT = "the answer is"


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=256) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with BackgroundServer(build_app(engine, ServerConfig("tiny", max_queued_requests=64))) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


def test_n_samples_are_choices_and_equal_engine_generate(client, engine):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 3, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ref = engine.generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, n=3, logprobs=True),
                          use_tqdm=False)[0]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [s.text for s in ref.samples]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ref.prompt_token_ids)  # the shared prompt counts once
    assert usage["completion_tokens"] == sum(len(s.token_ids) for s in ref.samples)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 6, "n": 2, "seed": 1})
    assert chat.status_code == 200, chat.text
    assert [c["index"] for c in chat.json()["choices"]] == [0, 1]


def _stop_inside(engine, max_new: int) -> tuple[str, str]:
    """A stop string taken from the middle of the greedy response, and the text before it."""
    text = engine.generate([PROMPT], SamplingParams(max_new_tokens=max_new), use_tqdm=False)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"the response has no usable middle: {text!r}"
    return stop, text[: text.find(stop)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_text_and_the_stream_agrees(client, engine, include):
    stop, before = _stop_inside(engine, 40)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop, "never-there"],
            "include_stop_str_in_output": include}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == before + (stop if include else "")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = sse_events(s)
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert streamed == choice["text"]
    assert events[-2]["choices"][0]["stop_reason"] == stop


def test_streamed_logprob_offsets_equal_the_whole_response(client):
    body = {"prompt": [200, 201, 202], "max_tokens": 24, "temperature": 0, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["text_offset"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = sse_events(s)
    streamed = [o for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole


def test_metrics_show_prefix_cache_hits(client):
    prompt = list(range(40, 80))  # 40 tokens: two full blocks of 16 reusable
    for _ in range(2):
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    text = client.get("/metrics").text
    rate = float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("pat:prefix_cache_hit_rate")))
    assert rate > 0


def test_explicit_openai_defaults_are_accepted(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {},
            "best_of": 1, "n": 1, "response_format": {"type": "text"}, "tool_choice": "none", "stop": None,
            "echo": False}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "none"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize("extra,field", [
    ({"n": 100000}, "n"),
    ({"stop": ["s"] * 100}, "stop"),
    ({"stop": ["x" * 5000]}, "stop"),
    ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_bad_values_are_400s_naming_the_field_and_the_server_keeps_serving(client, extra, field):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra})
    assert_error(r, 400, field)
    assert field in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_echo_with_logprobs_returns_the_prompt_and_its_logprobs(client, engine):
    prompt = [11, 12, 13, 14, 15]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                                             "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ref = engine.generate([prompt], SamplingParams(max_new_tokens=3, logprobs=True, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:5] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-9)
    assert lp["token_logprobs"][5:] == pytest.approx(ref.logprobs, abs=1e-9)
    assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])
    text = r.json()["choices"][0]["text"]
    assert text == engine.tokenizer.decode(prompt) + ref.text
    assert lp["text_offset"][0] == 0 and len(lp["tokens"]) == 8


def test_top_logprobs_up_to_twenty_in_chat(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                                  "logprobs": True, "top_logprobs": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 20 for c in content)
    tops = [t["logprob"] for t in content[0]["top_logprobs"]]
    assert tops == sorted(tops, reverse=True) and content[0]["logprob"] == pytest.approx(tops[0])
