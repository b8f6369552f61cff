"""The adapters' result shapes for ``n`` samples and prompt log-probs (built from RequestOutputs, no engine)."""

from __future__ import annotations

import pytest

from pat_engine.outputs import RequestOutput, of_prompt
from pat_integrations.openrlhf.outputs import to_vllm_shape

PROMPT = [4, 9, 2]
PROMPT_LPS = [None, -1.5, -0.25]
PROMPT_TOPS = [[], [(7, -0.5), (9, -1.5)], [(2, -0.25), (3, -2.0)]]  # token 9 ranks 2nd, token 2 first


def sample(i: int, tokens: list[int], reason: str = "length", stop: int | str | None = None) -> RequestOutput:
    return RequestOutput("r", PROMPT, tokens, f"text{i}", reason, logprobs=[-0.1 * (t + 1) for t in range(len(tokens))],
                         prompt_logprobs=PROMPT_LPS, prompt_top_logprobs=PROMPT_TOPS, stop_reason=stop,
                         sample_index=i, metrics={"cached_tokens": 2})


def three_samples() -> RequestOutput:
    return of_prompt([sample(0, [5, 6]), sample(1, [8], "stop", "ab"), sample(2, [5, 1, 1], "abort")])


def test_of_prompt_keeps_one_sample_plain():
    one = sample(0, [5])
    assert of_prompt([one]) is one and one.samples == []
    many = three_samples()
    assert many.token_ids == [5, 6] and [s.sample_index for s in many.samples] == [0, 1, 2]


def test_openrlhf_gets_one_completion_per_sample_and_vllm_prompt_logprobs():
    out = to_vllm_shape(three_samples())
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [[5, 6], [8], [5, 1, 1]]
    assert [c.text for c in out.outputs] == ["text0", "text1", "text2"]
    assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [("length", None), ("stop", "ab"),
                                                                       ("abort", None)]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    row1, row2 = out.prompt_logprobs[1:]
    assert {t: (lp.logprob, lp.rank) for t, lp in row1.items()} == {7: (-0.5, 1), 9: (-1.5, 2)}
    assert {t: (lp.logprob, lp.rank) for t, lp in row2.items()} == {2: (-0.25, 1), 3: (-2.0, 2)}
    plain = to_vllm_shape(RequestOutput("q", PROMPT, [1], "x", "stop", prompt_logprobs=PROMPT_LPS))
    assert [{t: lp.logprob for t, lp in row.items()} for row in plain.prompt_logprobs[1:]] == [{9: -1.5}, {2: -0.25}]
    assert len(plain.outputs) == 1 and plain.outputs[0].stop_reason is None  # EOS: no stop reason, as vLLM


def test_verl_token_output_carries_samples_and_teacher_prompt_logprobs():
    pytest.importorskip("verl", reason="veRL is not installed")
    from pat_integrations.verl.outputs import token_output

    out = token_output(three_samples(), prompt_logprobs=2, global_steps=5)
    assert out.token_ids == [5, 6] and out.stop_reason == "completed"
    extra = out.extra_fields
    assert extra["global_steps"] == 5 and extra["num_cached_tokens"] == 2
    assert [s["token_ids"] for s in extra["samples"]] == [[5, 6], [8], [5, 1, 1]]
    assert [s["stop_reason"] for s in extra["samples"]] == ["completed", "completed", "aborted"]
    # veRL's extract_prompt_logprobs: rows for prompt tokens 1.., top k each, then a dummy row
    assert extra["prompt_ids"] == [[7, 9], [2, 3], [0, 0]]
    assert extra["prompt_logprobs"] == [[-0.5, -1.5], [-0.25, -2.0], [0.0, 0.0]]
    k0 = token_output(sample(0, [5]), prompt_logprobs=0, global_steps=None).extra_fields
    assert k0["prompt_ids"] == [[9], [2], [0]] and k0["prompt_logprobs"] == [[-1.5], [-0.25], [0.0]]
    assert "samples" not in k0
    rejected = token_output(None, prompt_logprobs=None, global_steps=1)
    assert rejected.token_ids == [] and rejected.stop_reason == "aborted"
