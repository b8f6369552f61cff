"""Draft proposers (pure logic): the n-gram index, the response store and where drafts come from."""

from __future__ import annotations

from driver_fixtures import ARCH
from pat_engine.core.inputs import RequestFactory
from pat_engine.sampling.sampler import Sampled
from pat_engine.sampling.params import SamplingParams
from pat_engine.speculative.config import SpeculativeConfig
from pat_engine.speculative.ngram import NgramIndex
from pat_engine.speculative.proposer import NgramProposer
from pat_engine.speculative.store import ResponseStore
from pat_engine.speculative.verify import accept, accepted_length

FACTORY = RequestFactory(ARCH, None, ARCH.max_position, 0)


def seq(prompt, output=(), n_new=50):
    s = FACTORY.make(list(prompt), SamplingParams(max_new_tokens=n_new))
    s.output_ids = list(output)
    return s


def test_index_finds_the_latest_occurrence_with_a_token_after_it():
    idx = NgramIndex(2, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2]
    idx.update(tokens)
    assert idx.end_of((1, 2)) == 6  # the occurrence at the very end has nothing after it
    assert idx.end_of((1, 2, 3)) == 7
    assert idx.end_of((5, 5)) is None
    tokens += [3, 4]
    idx.update(tokens)  # extends in place
    assert idx.end_of((1, 2)) == 10 and idx.end_of((2, 3)) == 11 and len(idx) == 12


def test_accepts_the_longest_matching_prefix_and_the_bonus_token():
    assert accepted_length([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_length([], [4]) == 0
    out = Sampled([5, 6, 8, 9, 4, 1, 2], [float(i) for i in range(7)], None)
    kept, counts = accept([[5, 6, 7], [], [1, 3]], out)
    assert counts == [3, 1, 2]
    assert kept.tokens == [5, 6, 8, 4, 1, 2] and kept.logprobs == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]


def test_proposes_from_the_requests_own_text():
    cfg = SpeculativeConfig(enabled=True, min_ngram=2, max_ngram=3)
    p = NgramProposer(cfg)
    s = seq([10, 11, 12, 13, 14, 20, 21], [10, 11, 12])
    p.track(s)
    assert p.propose(s, 3) == [13, 14, 20]  # "10 11 12" occurred in the prompt
    assert p.propose(s, 10) == [13, 14, 20, 21, 10, 11, 12]  # up to the end of the text
    s.output_ids += [99]
    assert p.propose(s, 3) == []  # "12 99" never occurred


def test_prefers_the_longest_ngram_then_the_longest_continuation():
    p = NgramProposer(SpeculativeConfig(enabled=True, min_ngram=1, max_ngram=3))
    s = seq([1, 2, 3, 4, 9, 3, 5, 2, 3], [])
    p.track(s)
    assert p.propose(s, 2) == [4, 9]  # "2 3" (n=2) beats "3" (n=1, latest: followed by 5)


def test_siblings_and_finished_siblings_are_draft_sources():
    cfg = SpeculativeConfig(enabled=True)
    p = NgramProposer(cfg)
    prompt = [7, 8, 9]
    a, b, c = seq(prompt, [1, 2, 3, 4, 5, 6]), seq(prompt, [1, 2]), seq([7, 8, 0], [1, 2])
    for s in (a, b, c):
        p.track(s)
    assert p.propose(b, 3) == [3, 4, 5]  # from live sibling a
    assert p.propose(c, 3) == []  # another prompt: not a sibling
    a.finish("stop")
    p.release(a)
    assert p.propose(b, 3) == [3, 4, 5]  # a finished: its response is kept while b runs
    b.finish("length")
    p.release(b)
    assert len(p.store) == 0  # the family is over and history is off: nothing kept


def test_history_keeps_responses_across_batches_and_remember_feeds_it():
    p = NgramProposer(SpeculativeConfig(enabled=True, history=True))
    prompt = [7, 8, 9]
    a = seq(prompt, [1, 2, 3, 4])
    p.track(a)
    a.finish("stop")
    p.release(a)
    later = seq(prompt, [1, 2])
    p.track(later)
    assert p.propose(later, 2) == [3, 4]
    p.remember([5, 5], [6, 6, 6, 8])
    other = seq([5, 5], [6, 6, 6])
    p.track(other)
    assert p.propose(other, 1) == [8]  # "6 6 6" -> 8 from the remembered response (own text has 6 6 -> 6)


def test_store_is_bounded_by_prompts_responses_and_tokens():
    store = ResponseStore(max_prompts=2, max_responses=2, max_tokens=40, min_n=2, max_n=3)
    store.add([1], [1, 2, 3])
    store.add([1], [4, 5, 6])
    store.add([1], [7, 8, 9])
    assert [r.tokens for r in store.responses([1])] == [[1, 7, 8, 9], [1, 4, 5, 6]]  # latest two, latest first
    store.add([2], [1, 2])
    store.add([3], [1, 2])  # a third prompt: the least recently used one ([1]) goes
    assert len(store) == 2 and store.responses([2]) and not store.responses([1])
    store.add([4] * 30, [1] * 9)  # 39 tokens: the others go to respect the cap
    assert len(store) == 1 and store.tokens == 39
    store.add([5], [1])  # shorter than an n-gram: not kept
    assert not store.responses([5])
