"""Structured output (``sampling/structured.py``, ``core/grammar.py``): answers held to a JSON schema, any
JSON object, a regex, a choice or a grammar by every name clients use; each draw restricted to the tokens the
grammar allows, so the answers parse, and the tokens stay those of an unconstrained engine's rule under
switches, async scheduling and speculation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
import re
import signal
import time

import httpx
import numpy as np
import pytest
import torch

from pat_engine import Engine, InvalidRequestError, SamplingParams
from pat_engine.core.grammar import token_mask
from pat_engine.protocol import TokenMask
from pat_engine.sampling.options import to_sampling_params
from pat_engine.sampling.sampler import SamplingBatch, sample_batch
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.sampling.structured import StructuredOutput
from pat_engine.serve.batch.lines import LineError, SamplingDefaults, parse_line
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app
from pat_integrations.sampling import from_verl, from_vllm_like
from rl_helpers import VllmLikeSamplingParams

xgr = pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install -e '.[test]' has it)")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}
JSON = StructuredOutput.of(json=SCHEMA)
REGEX = r"[0-9]{3}-[a-z]{2}"


def test_every_client_name_gives_one_constraint():
    base = {"max_tokens": 4}
    want = StructuredOutput("json", json.dumps(SCHEMA))
    for options in ({"structured_outputs": {"json": SCHEMA}}, {"guided_decoding": {"json": SCHEMA}},
                    {"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)},
                    {"response_format": {"json": SCHEMA}},
                    {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}):
        got = to_sampling_params({**base, **options}).structured_output
        assert got.kind == "json" and json.loads(got.spec) == json.loads(want.spec), options
    assert to_sampling_params({**base, "regex": REGEX}).structured_output == StructuredOutput("regex", REGEX)
    assert to_sampling_params({**base, "ebnf": 'root ::= "x"'}).structured_output.kind == "grammar"
    assert to_sampling_params({**base, "guided_choice": ["yes", "no"]}).structured_output.choices() == ["yes", "no"]
    assert to_sampling_params({**base, "structured_outputs": {"json_object": True}}).structured_output.kind == \
        "json_object"
    assert to_sampling_params({**base, "structured_outputs": None}).structured_output is None
    compact = to_sampling_params({**base, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert not compact.structured_output.any_whitespace and want.any_whitespace
    for options, match in (({"guided_regex": "a", "guided_json": SCHEMA}, "give one constraint"),
                           ({"regex": "a", "guided_regex": "b"}, "two different regex constraints"),
                           ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
                            "structured_outputs.whitespace_pattern is not supported"),
                           ({"guided_choice": []}, "choice must be a non-empty list"),
                           ({"structured_outputs": "json"}, "must be an object of constraints"),
                           ({"guided_json": SCHEMA, "min_tokens": 2}, "cannot be combined with min_tokens"),
                           ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
                            "disable_any_whitespace applies to json")):
        with pytest.raises(InvalidRequestError, match=match):
            to_sampling_params({**base, **options})


@dataclass
class StructuredOutputsParams:  # vLLM's, by its fields (vllm.sampling_params)
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = None
    _backend_was_auto: bool = False


def test_batch_lines_take_structured_outputs():
    item = parse_line(1, {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": REGEX}}, None, 512,
                      SamplingDefaults())
    assert item.input.params.structured_output == StructuredOutput("regex", REGEX)
    with pytest.raises(LineError, match="cannot be combined with min_tokens or ignore_eos"):
        parse_line(2, {"prompt": "x", "structured_outputs": {"regex": REGEX}}, None, 512,
                   SamplingDefaults(ignore_eos=True))


def test_the_rl_adapters_take_vllms_params_object():
    given = VllmLikeSamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=REGEX))
    assert from_vllm_like(given).structured_output == StructuredOutput("regex", REGEX)
    assert from_verl({"structured_outputs": {"json": SCHEMA}}, 8).structured_output.kind == "json"
    with pytest.raises(InvalidRequestError, match="structured_outputs.disable_fallback is not supported"):
        from_vllm_like(VllmLikeSamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex=REGEX, disable_fallback=True)))


def _spec(temperature: float, seed: int) -> SamplingSpec:
    return SamplingSpec.of(SamplingParams(temperature=temperature), seed, 4)


def test_the_sampler_draws_only_what_the_mask_allows_in_each_of_its_forms():
    vocab, allowed = 70, [3, 40, 64, 69]
    words = np.zeros(3, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    logits = torch.randn(3, vocab, dtype=torch.float64)
    forms = {"only": TokenMask(only=tuple(allowed)), "words": TokenMask(words=words.tobytes()),
             "banned": TokenMask(banned=tuple(t for t in range(vocab) if t not in allowed))}
    for name, mask in forms.items():
        specs = [_spec(1.0, s) for s in range(2)] + [_spec(0.0, 0)]
        raw = SamplingBatch.build(specs, [5, 5, 5], allowed=[mask, None, mask]).suppress(logits)
        assert torch.isfinite(raw[0]).nonzero().flatten().tolist() == allowed and torch.equal(raw[1], logits[1])
        assert torch.equal(raw[0, allowed], logits[0, allowed]), name
        assert raw[2].argmax().item() == max(allowed, key=lambda t: logits[2, t].item())
        for seed in range(10):
            batch = SamplingBatch.build([_spec(1.0, seed)], [7], allowed=[mask])
            assert sample_batch(logits[:1], batch).tokens[0] in allowed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_on_the_gpu_give_the_cpu_s_logits_and_draws():
    """Each mask form on CUDA (no value read back) against the CPU, at Qwen's vocabulary."""
    vocab, g = 151936, torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 3
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    words[::3] = 0xF0F0F0F0
    masks = [TokenMask(only=(5, 77, 151935)), TokenMask(banned=tuple(range(0, vocab, 7))),
             TokenMask(words=words.view(np.int32).tobytes()), None]
    specs, positions = [_spec(1.0, s) for s in range(4)], [9] * 4
    cpu = SamplingBatch.build(specs, positions, allowed=masks)
    gpu = SamplingBatch.build(specs, positions, device="cuda", allowed=masks)
    raw = cpu.suppress(logits)
    assert torch.equal(gpu.suppress(logits.cuda()).cpu(), raw)
    drawn = sample_batch(logits.cuda(), gpu).tokens  # the GPU's draw rule has blocks of its own: in the mask
    assert all(torch.isfinite(raw[r, t]) for r, t in enumerate(drawn.tolist()))
    greedy = [_spec(0.0, 0)] * 4
    assert torch.equal(sample_batch(logits.cuda(), SamplingBatch.build(greedy, positions, device="cuda",
                                                                     allowed=masks)).tokens,
                       sample_batch(logits, SamplingBatch.build(greedy, positions, allowed=masks)).tokens)


@pytest.mark.parametrize("allowed, form", [(list(range(5)), "only"), (list(range(3, 151936)), "banned"),
                                           (list(range(0, 151936, 3)), "words")])
def test_the_driver_sends_a_mask_in_its_smallest_form(allowed, form):
    vocab = 151936
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    mask = token_mask(words.view(np.int32), vocab)
    assert [name for name in ("only", "banned", "words") if getattr(mask, name) is not None] == [form]
    if form == "only":
        assert list(mask.only) == allowed
    elif form == "banned":
        assert set(mask.banned) == set(range(vocab)) - set(allowed)
    else:
        assert mask.words == words.tobytes()
    padded = np.full(5, -1, dtype=np.int32)  # every bit set, the vocabulary ending inside the last word
    assert token_mask(padded, 150).only == tuple(range(150)) and token_mask(padded, 40).only == tuple(range(40))


def _compiled(engine: Engine, constraint: StructuredOutput):
    return engine.request_factory._grammar(SamplingParams(structured_output=constraint), "")


def _complete_or_prefix(engine: Engine, constraint: StructuredOutput, out) -> bool:
    """Whether an answer is complete under its grammar (True) or a prefix of one cut by its length (False)."""
    matcher = xgr.GrammarMatcher(_compiled(engine, constraint))
    assert all(matcher.accept_token(t) for t in out.token_ids), out.text
    return out.finish_reason == "stop"


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float32", numerics="invariant", max_model_len=256) as eng:
        yield eng


def _params(constraint: StructuredOutput, n: int = 4, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_new_tokens=96, temperature=temperature, seed=5, n=n, structured_output=constraint)


@pytest.mark.slow
def test_answers_follow_their_constraint(engine):
    prompts = ["the water is", "a long time"]
    outs = engine.generate(prompts, _params(JSON, n=8), use_tqdm=False)
    samples = [s for o in outs for s in o.samples]
    complete = [s for s in samples if _complete_or_prefix(engine, JSON, s)]
    assert complete  # at least some finish inside 96 tokens: checked as JSON against the schema
    for s in complete:  # strict=False: xgrammar's JSON strings admit raw control characters but newlines
        obj = json.loads(s.text, strict=False)
        assert set(obj) == {"a", "b"} and isinstance(obj["a"], int) and len(obj["b"]) <= 6
    regex = StructuredOutput.of(regex=REGEX)
    for s in engine.generate(prompts, _params(regex), use_tqdm=False)[0].samples:
        assert re.fullmatch(REGEX, s.text) and s.finish_reason == "stop"
    choice = StructuredOutput.of(choice=["the water", "good", "a long time"])
    greedy = engine.generate(prompts, _params(choice, n=1, temperature=0.0), use_tqdm=False)
    assert all(o.text in choice.choices() and o.finish_reason == "stop" for o in greedy)
    compact = StructuredOutput.of(json=SCHEMA, disable_any_whitespace=True)
    tight = [s for o in engine.generate(prompts, _params(compact), use_tqdm=False) for s in o.samples]
    ended = [s for s in tight if _complete_or_prefix(engine, compact, s)]
    assert ended and all(s.text.startswith('{"a":') for s in tight)  # no white space where JSON allows it
    assert all(json.loads(s.text, strict=False)["b"] in s.text for s in ended)
    an_object = StructuredOutput.of(json_object=True)
    objects = [s for o in engine.generate(prompts, _params(an_object, n=8), use_tqdm=False) for s in o.samples]
    finished = [s for s in objects if _complete_or_prefix(engine, an_object, s)]
    assert finished and all(isinstance(json.loads(s.text, strict=False), dict) for s in finished)


@pytest.mark.slow
def test_constrained_tokens_are_the_same_across_a_switch_async_scheduling_and_speculation(engine, model_dir):
    prompts = ["the water is", "a long time", "good"]
    params = _params(JSON, n=2)
    static = engine.generate(prompts, params, use_tqdm=False)
    switched = engine.generate(prompts, params, switch_schedule=[(6, 2)], from_base_layout=True, use_tqdm=False)
    assert engine.switches and [s.token_ids for o in switched for s in o.samples] == \
        [s.token_ids for o in static for s in o.samples]
    for options in ({"async_scheduling": True}, {"speculative": True}):
        with Engine(model_dir("llama"), tp=1, dp=2, dtype="float32", numerics="invariant", max_model_len=256,
                    **options) as other:
            again = other.generate(prompts, params, use_tqdm=False)
        assert [s.token_ids for o in again for s in o.samples] == [s.token_ids for o in static for s in o.samples]


@pytest.mark.slow
def test_structured_output_over_http_and_its_refusals(engine):
    with BackgroundServer(build_app(engine, ServerConfig("tiny"))) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the water"}],
                                                      "response_format": fmt, "max_tokens": 96, "seed": 5, "n": 4})
        assert r.status_code == 200, r.text
        done = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
        assert done and all(set(json.loads(c["message"]["content"], strict=False)) == {"a", "b"} for c in done)
        r = client.post("/v1/completions", json={"prompt": "the water", "guided_regex": REGEX, "max_tokens": 16})
        assert r.status_code == 200 and re.fullmatch(REGEX, r.json()["choices"][0]["text"]), r.text
        r = client.post("/generate", json={"text": "the water", "sampling_params": {"regex": REGEX,
                                                                                      "max_new_tokens": 16}})
        assert r.status_code == 200 and re.fullmatch(REGEX, r.json()["text"]), r.text
        for body, match in (({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                             "json_schema needs"),
                            ({"response_format": {"type": "xml"}}, "text, json_object or json_schema"),
                            ({"guided_json": '{"type": "objec'}, "the json does not compile"),
                            ({"guided_regex": "(a"}, "the regex does not compile")):
            r = client.post("/v1/completions", json={"prompt": "the water", "max_tokens": 4, **body})
            assert r.status_code == 400 and match in r.text, r.text
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_tool_choice_required_or_named_holds_the_answer_to_calls(engine):
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": city}},
             {"type": "function", "function": {"name": "time"}}]
    chat = [{"role": "user", "content": "the water"}]
    with BackgroundServer(build_app(engine, ServerConfig("tiny"))) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        # the tiny random model would fill JSON's optional white space to the token limit: bias it away
        blank = {str(t): -100 for t in range(engine.arch.vocab_size - 6)
                 if engine.tokenizer.decode([t]) and not engine.tokenizer.decode([t]).strip()}

        def ask(choice, **more) -> list[dict]:
            r = client.post("/v1/chat/completions", json={"messages": chat, "tools": tools, "tool_choice": choice,
                                                          "max_tokens": 64, "seed": 3, "n": 4, "logit_bias": blank,
                                                          **more})
            assert r.status_code == 200, r.text
            return r.json()["choices"]

        named = ask({"type": "function", "function": {"name": "weather"}})
        called = [c for c in named if c["finish_reason"] == "tool_calls"]
        assert called and all(c["message"]["content"] is None for c in called)
        for c in called:
            (call,) = c["message"]["tool_calls"]
            assert call["function"]["name"] == "weather"
            assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Bergen")
        required = ask("required", parallel_tool_calls=False)  # one call: the list closes after it
        assert all(c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1 for c in required)
        assert {c["message"]["tool_calls"][0]["function"]["name"] for c in required} <= {"weather", "time"}
        r = client.post("/v1/chat/completions", json={"messages": chat, "tools": tools, "tool_choice": "required",
                                                      "guided_regex": "a+", "max_tokens": 4})
        assert r.status_code == 400 and "cannot take another structured output constraint" in r.text


def test_with_think_tags_the_grammar_holds_once_the_thinking_is_closed(engine):
    tokenizer, tags = engine.tokenizer, ("<think>", "</think>")
    compiled = _compiled(engine, JSON)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    grammars = engine.request_factory.grammars
    assert not grammars.follow(compiled, tags, ids("<|user|>x\n<|assistant|><think></think>")).waiting  # off
    assert not grammars.follow(compiled).waiting  # no tags: the grammar holds from the first token
    state = grammars.follow(compiled, tags, ids("<|user|>x\n<|assistant|><think>"))
    assert state.waiting and state.allowed() is None
    for token in ids("the water is good</think>"):
        assert state.allowed() is None and state.accept(token)  # free while thinking, whatever is drawn
    assert not state.waiting and state.allowed().only == tuple(ids("{"))  # then the schema's first token


@pytest.mark.slow
def test_a_server_with_a_reasoning_parser_lets_the_model_think_before_the_grammar(model_dir, tmp_path):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
                "<think></think>{% endif %}{% endif %}")
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float32", max_model_len=256, chat_template=template) as eng, \
            BackgroundServer(build_app(eng, ServerConfig("tiny", reasoning_parser="qwen3"))) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        def ask(**more) -> list[dict]:
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "the water"}], "max_tokens": 48, "seed": 7, "n": 4,
                "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, **more})
            assert r.status_code == 200, r.text
            return [c["message"]["content"] for c in r.json()["choices"]]

        # thinking off: the template closed it in the prompt, so the grammar holds from the first token
        assert all(a.startswith('{"a":') for a in ask(chat_template_kwargs={"enable_thinking": False}))
        # thinking on: the tiny model never writes </think>, so nothing holds its answer to the schema
        assert not all(a.startswith("{") for a in ask())


@pytest.mark.slow
def test_a_constrained_request_survives_a_killed_worker_with_its_tokens(model_dir):
    """The matchers live on the driver: a worker SIGKILLed mid-answer is replaced, the requests recomputed,
    and the constrained answers come out token for token as in an undisturbed run."""
    prompts = ["the water is", "a long time"]
    params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=11, n=2, structured_output=JSON)
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float32", numerics="invariant", max_model_len=256) as eng:
        want = [s.token_ids for o in eng.generate(prompts, params, use_tqdm=False) for s in o.samples]
        handles = [h for p in prompts for h in eng.submit_samples(p, params)]
        deadline = time.monotonic() + 60
        while not any(h.num_generated >= 4 for h in handles):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(eng.coordinator.stepping.pool.procs[0].pid, signal.SIGKILL)
        assert all(h.wait(120) for h in handles)
        assert [h.output().token_ids for h in handles] == want
        assert eng.worker_failures
