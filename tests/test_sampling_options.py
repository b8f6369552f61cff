"""The one translator from client sampling options to ``SamplingParams`` (no engine, milliseconds).

Every face goes through ``pat_engine.sampling.options``: the OpenAI server, SGLang's
``/generate``, the batch job, and the RL adapters (veRL's dict, OpenRLHF's
``vllm.SamplingParams``). The adapters' end-to-end checks that each option takes
effect are in test_verl_adapter.py and test_openrlhf_contract.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from pat_engine.errors import InvalidRequestError
from pat_engine.sampling.options import ALIASES, OPTION_NAMES, REFUSED, TEXT_ONLY, to_sampling_params
from pat_engine.serve.openai.protocol import CompletionRequest
from pat_engine.serve.sglang.protocol import SGLSamplingParams
from pat_engine.serve.openai.translate import completion_inputs
from pat_integrations.openrlhf.settings import PatActorSettings
from pat_integrations.sampling import from_verl, from_vllm_like
from rl_helpers import VllmLikeSamplingParams

# what the RL integrations refused as "not implemented" before they shared the translator
NOW_ACCEPTED = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.2,
                "n": 3, "stop": ["ab", "cd"], "logit_bias": {7: 5.0}, "prompt_logprobs": 2}
EXPECTED = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.2,
            "n": 3, "stop": ("ab", "cd"), "logit_bias": ((7, 5.0),), "prompt_logprobs": 2}


@pytest.mark.parametrize("a, b, value", [
    ("max_tokens", "max_new_tokens", 7), ("min_tokens", "min_new_tokens", 2), ("seed", "sampling_seed", 11),
    ("include_stop_str_in_output", "no_stop_trim", True),
])
def test_aliases_set_the_same_field_and_must_agree(a, b, value):
    base = {} if a == "max_tokens" else {"max_tokens": 9}
    assert to_sampling_params({**base, a: value}) == to_sampling_params({**base, b: value})
    assert ALIASES[a] == ALIASES[b]
    other = not value if isinstance(value, bool) else value + 1
    with pytest.raises(InvalidRequestError, match=f"{a}=.* and {b}=.* set the same option"):
        to_sampling_params({**base, a: value, b: other})


def test_client_defaults_and_caller_defaults():
    p = to_sampling_params({"max_tokens": 4})
    assert p.temperature == 1.0 and p.logprobs is False  # vLLM, OpenAI and SGLang sample at 1 unless told
    p = to_sampling_params({"top_k": 5}, defaults={"max_tokens": 8, "temperature": 0.0})
    assert (p.max_new_tokens, p.temperature, p.top_k) == (8, 0.0, 5)
    assert to_sampling_params({"max_tokens": 3, "temperature": None}, defaults={"max_tokens": 8}).temperature == 1.0
    with pytest.raises(InvalidRequestError, match="max_tokens is not given"):
        to_sampling_params({"temperature": 0.5})


def test_values_are_reshaped_not_judged():
    p = to_sampling_params({"max_tokens": np.int64(5), "temperature": np.float32(0.5), "stop": "x",
                            "logit_bias": {"3": 2}, "logprobs": 0})
    assert type(p.max_new_tokens) is int and p.temperature == 0.5 and p.stop == ("x",)
    assert p.logit_bias == ((3, 2.0),) and p.logprobs  # vLLM's count 0: the sampled token's log-prob
    assert to_sampling_params({"max_tokens": 5, "stop": ["", "y"]}).stop == ("y",)  # as SGLang: empty ones dropped
    with pytest.raises(InvalidRequestError, match="logit_bias: key 'x' is not a token id"):
        to_sampling_params({"max_tokens": 5, "logit_bias": {"x": 1.0}})
    with pytest.raises(InvalidRequestError, match="logprobs must be true, false or a count"):
        to_sampling_params({"max_tokens": 5, "logprobs": "yes"})
    with pytest.raises(InvalidRequestError, match="top_p"):  # ranges: SamplingParams' own checks
        to_sampling_params({"max_tokens": 5, "top_p": 0})


def test_text_only_options_are_accepted_and_refused_ones_named():
    for name in TEXT_ONLY:
        to_sampling_params({"max_tokens": 2, name: object()})
    for name, off in REFUSED.items():
        to_sampling_params({"max_tokens": 2, name: off[-1]})  # its "off" value passes
        with pytest.raises(InvalidRequestError, match=f"^where: {name}=.* is not supported by pat-engine"):
            to_sampling_params({"max_tokens": 2, name: ["on"]}, where="where: ")
    assert to_sampling_params({"max_tokens": 2, "n": 2, "best_of": 2}).n == 2
    with pytest.raises(InvalidRequestError, match="best_of=3 with n=2"):
        to_sampling_params({"max_tokens": 2, "n": 2, "best_of": 3})
    with pytest.raises(InvalidRequestError, match="unknown sampling option 'tmperature'"):
        to_sampling_params({"max_tokens": 2, "tmperature": 1})


def test_every_face_field_has_a_home():
    """The SGLang schema and the OpenAI sampling fields only name options the translator knows."""
    assert set(SGLSamplingParams.model_fields) <= OPTION_NAMES
    openai_only = {"model", "stream", "stream_options", "user", "response_format", "tool_choice", "return_token_ids",
                   "return_tokens_as_token_ids", "prompt", "echo"}
    assert set(CompletionRequest.model_fields) - openai_only <= OPTION_NAMES


def test_openai_face_goes_through_the_translator():
    req = CompletionRequest.model_validate({"prompt": [1, 2], "max_tokens": 5, "seed": 3, "stop": "z",
                                            "logit_bias": {"4": -1}, "min_tokens": 2, "n": 2, "logprobs": 2})
    (inp,) = completion_inputs(req)
    want = to_sampling_params({"max_tokens": 5, "seed": 3, "stop": "z", "logit_bias": {4: -1.0}, "min_tokens": 2,
                               "n": 2, "logprobs": True, "top_logprobs": 2})
    assert inp.params == want


@pytest.mark.parametrize("name", sorted(NOW_ACCEPTED))
def test_rl_integrations_accept_what_the_engine_implements(name):
    verl = from_verl({name: NOW_ACCEPTED[name]}, default_max_tokens=6)
    vllm = from_vllm_like(VllmLikeSamplingParams(max_tokens=6, **{name: NOW_ACCEPTED[name]}))
    assert getattr(verl, name) == getattr(vllm, name) == EXPECTED[name]


@pytest.mark.parametrize("name, value", [("best_of", 4), ("bad_words", ["no"]),
                                         ("structured_outputs", {"json": {}, "disable_fallback": True}),
                                         ("truncate_prompt_tokens", 8)])
def test_rl_integrations_refuse_what_the_engine_lacks_by_name(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        from_verl({name: value}, default_max_tokens=6)
    with pytest.raises(InvalidRequestError, match=name):
        from_vllm_like(VllmLikeSamplingParams(max_tokens=6, **{name: value}))


def test_rl_integrations_defaults_and_min_tokens_clamp():
    p = from_verl({"min_tokens": 50, "detokenize": False}, default_max_tokens=10,
                  defaults={"repetition_penalty": 1.1, "ignore_eos": True})
    assert (p.max_new_tokens, p.min_new_tokens, p.repetition_penalty, p.ignore_eos) == (10, 10, 1.1, True)
    assert from_verl({"repetition_penalty": 1.0}, 4, defaults={"repetition_penalty": 1.1}).repetition_penalty == 1.0
    with pytest.raises(InvalidRequestError, match="unknown sampling option 'foo'"):
        from_verl({"foo": 1}, default_max_tokens=4)
    q = from_vllm_like(VllmLikeSamplingParams(max_tokens=None, top_k=0, logprobs=None), default_max_tokens=12)
    assert (q.max_new_tokens, q.top_k, q.logprobs) == (12, 0, False)


def test_openrlhf_prefix_caching_switch_reaches_the_engine_config():
    for flag in (False, True):
        settings = PatActorSettings.from_vllm_kwargs({"model": "m", "enable_prefix_caching": flag})
        assert settings.engine_kwargs["enable_prefix_caching"] is flag
    assert "enable_prefix_caching" not in PatActorSettings.from_vllm_kwargs({"model": "m"}).engine_kwargs
