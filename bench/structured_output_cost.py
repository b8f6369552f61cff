"""What structured output adds to a decode step's sampling, at Qwen's vocabulary (151,936 tokens).

A constrained row costs, per step: the driver's mask (xgrammar's ``fill_next_token_bitmask``, then the
mask in its smallest form, ``core/grammar.token_mask``: the allowed ids, the banned ids or the bitmask) and
the worker's (the other tokens set to -inf, ``SamplingBatch.suppress``), on top of the draw every row pays. This times, interleaved (plain,
constrained, plain, constrained, ...) on this noisy shared host, ``sample_batch`` of temperature-1 rows with
log-probs (as RL rollouts draw; ``sample_on_device`` on the step's own logits, as the workers call it)
against the same rows constrained by a JSON schema, the masks made fresh
each step from matchers standing at four places of an answer: before the first key (a few tokens allowed),
inside a string value (almost all), inside a number (a few), and inside a string held to a pattern (tens of
thousands: the bitmask form).

No tokenizer of that size can be downloaded here: the vocabulary is synthetic (the 256 bytes, JSON
punctuation, and random lower-case pieces with and without a leading space, as BPE vocabularies hold), so
the mask's time is of the right order, not Qwen's to the microsecond.

    python bench/structured_output_cost.py      # writes bench/results/structured_output_cost.md
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import xgrammar as xgr

from common import markdown_table, write_result
from pat_engine.core.grammar import token_mask
from pat_engine.sampling.params import SamplingParams
from pat_engine.sampling.sampler import SamplingBatch, sample_on_device
from pat_engine.sampling.spec import SamplingSpec

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "number"},
                                           "code": {"type": "string", "pattern": "^[a-m ]+$"}},
          "required": ["answer", "score", "code"]}
PLACES = {"before the first key": "", "inside a string": '{"answer": "the value is',
          "inside a number": '{"answer": "x", "score": 12',
          "inside a patterned string": '{"answer": "x", "score": 1, "code": "ab'}


def vocabulary(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [chr(b) for b in range(32, 127)] + ['{"', '":', '",', '"}', '": "', ', "', "\n", "  ", "\t"]
    seen = set(pieces)
    while len(pieces) < VOCAB - 1:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        word = (" " + word) if rng.random() < 0.5 else word
        if word not in seen:
            seen.add(word)
            pieces.append(word)
    return pieces + ["<eos>"]


def matchers(compiled, info_vocab: list[str], rows: int) -> list:
    """``rows`` matchers spread over the three places of an answer."""
    index = {piece: i for i, piece in enumerate(info_vocab)}
    out = []
    for r in range(rows):
        m = xgr.GrammarMatcher(compiled)
        for ch in list(PLACES.values())[r % len(PLACES)]:  # one-character pieces: every prefix is reachable
            assert m.accept_token(index[ch]), ch
        out.append(m)
    return out


def step(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int], state=None) -> float:
    logits = logits.clone()  # the step's own logits, as the LM head hands them over (the mask may overwrite them)
    start = time.perf_counter()
    allowed = None
    if state is not None:
        ms, mask = state
        allowed = []
        for m in ms:  # the driver: one mask a row, in its smallest form
            m.fill_next_token_bitmask(mask)
            allowed.append(token_mask(mask[0].numpy(), VOCAB))
    sample_on_device(logits, SamplingBatch.build(specs, positions, allowed=allowed), logits_owned=True).to_host()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args()
    torch.manual_seed(0)
    pieces = vocabulary()
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[VOCAB - 1])
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    rows_out = []
    for rows in args.batches:
        logits = torch.randn(rows, VOCAB) * 3
        specs = [SamplingSpec.of(SamplingParams(temperature=1.0, logprobs=True), seed, 100) for seed in range(rows)]
        positions = [100 + r for r in range(rows)]
        state = (matchers(compiled, pieces, rows), xgr.allocate_token_bitmask(1, VOCAB))
        plain, constrained = [], []
        step(logits, specs, positions), step(logits, specs, positions, state)  # warm
        for _ in range(args.rounds):
            plain.append(step(logits, specs, positions))
            constrained.append(step(logits, specs, positions, state))
        a, b = statistics.median(plain) * 1e3, statistics.median(constrained) * 1e3
        rows_out.append([rows, f"{a:.2f}", f"{b:.2f}", f"{b - a:.2f}", f"{(b - a) / rows * 1e3:.0f}", f"{b / a:.2f}"])
    forms = []
    for place, m in zip(PLACES, matchers(compiled, pieces, len(PLACES))):
        mask = xgr.allocate_token_bitmask(1, VOCAB)
        m.fill_next_token_bitmask(mask)
        tm = token_mask(mask[0].numpy(), VOCAB)
        form = next(name for name in ("only", "banned", "words") if getattr(tm, name) is not None)
        size = len(getattr(tm, form)) if form != "words" else len(tm.words)
        forms.append([place, form, f"{size:,}" + (" bytes" if form == "words" else " ids")])
    table = markdown_table(["rows", "plain draw ms", "constrained ms", "added ms", "added us a row", "ratio"],
                           rows_out)
    body = (f"Temperature 1 with log-probs, float32 logits of {VOCAB:,} tokens, medians of {args.rounds} "
            f"interleaved rounds; constrained rows' matchers spread over four places of a JSON answer "
            f"({', '.join(PLACES)}). Compiling the schema once took {compile_ms:.0f} ms.\n\n{table}\n\n"
            f"The form each place's mask travels in:\n\n{markdown_table(['place', 'form', 'size'], forms)}\n")
    write_result("structured_output_cost", "Structured output: what a constrained row adds to the draw", body)


if __name__ == "__main__":
    main()
