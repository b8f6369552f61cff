"""The tiny checkpoints load in transformers and decode diversely (so bugs show)."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, hf_greedy
from pat_engine.model.arch import load_model_arch


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_output_is_diverse(model_dir, arch):
    path = model_dir(arch)
    for prompt in PROMPTS[:3]:
        out = hf_greedy(path, prompt, 48)
        assert len(out) == 48
        assert len(set(out)) >= 20, f"{arch}: greedy output too repetitive: {out}"
        assert max(out.count(t) for t in set(out)) <= 10


def test_tokenizer_round_trip(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("llama"))
    ids = tok("the answer is prime", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "the answer is prime"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_architecture_flags(model_dir):
    assert load_model_arch(model_dir("qwen2")).qkv_bias
    assert load_model_arch(model_dir("qwen2")).tie_word_embeddings
    assert load_model_arch(model_dir("qwen3")).qk_norm
    assert load_model_arch(model_dir("llama31")).rope.kind == "llama3"
