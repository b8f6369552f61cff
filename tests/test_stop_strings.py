"""Stop strings: incremental detokenization equals a whole decode, the first match ends the text,
and what a reader may see never runs past a stop string."""

from __future__ import annotations

import pytest

from pat_engine.core.stop_strings import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("llama"))


def feed(matcher, ids, check=True):
    for n in range(1, len(ids) + 1):
        if matcher.add(ids[:n], check=check) is not None:
            return n
    return None


def test_incremental_text_equals_decoding_the_whole_response(tokenizer):
    text = "héllo wörld, ünïcode — ✓ and plain ascii 123 " * 3
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    m = StopStringMatcher(tokenizer, ("@@never@@",), False)
    assert feed(m, ids) is None
    assert m.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_first_match_ends_the_text_with_or_without_the_stop_string(tokenizer):
    ids = tokenizer("The answer is 42.</answer> trailing words", add_special_tokens=False)["input_ids"]
    m = StopStringMatcher(tokenizer, ("</answer>", "words"), False)
    at = feed(m, ids)
    assert at is not None and m.matched == "</answer>" and m.text == "The answer is 42."
    keep = StopStringMatcher(tokenizer, ("</answer>",), True)
    feed(keep, ids)
    assert keep.text == "The answer is 42.</answer>"


def test_a_match_split_across_many_tokens_is_found(tokenizer):
    ids = tokenizer("abc STOP-HERE xyz", add_special_tokens=False)["input_ids"]
    m = StopStringMatcher(tokenizer, ("STOP-HERE",), False)
    assert feed(m, ids) is not None and m.text == "abc "


def test_visible_text_holds_back_a_possible_partial_match(tokenizer):
    m = StopStringMatcher(tokenizer, ("</answer>",), False)
    ids = tokenizer("x = 1 </ans", add_special_tokens=False)["input_ids"]
    feed(m, ids)
    assert m.text.endswith("</ans") and m.text[: m.safe_len(False)] == "x = 1 "
    assert m.safe_len(True) == len(m.text)


def test_before_min_tokens_the_text_grows_but_nothing_stops(tokenizer):
    ids = tokenizer("STOP then more", add_special_tokens=False)["input_ids"]
    m = StopStringMatcher(tokenizer, ("STOP",), False)
    assert feed(m, ids, check=False) is None and m.text.startswith("STOP")
