"""Structured output on the driver: a request's constraint (``sampling/structured.py``) compiled by
xgrammar, and one matcher per sample that follows its tokens and says which tokens may come next.

The driver owns the matchers, so a constrained request survives live switches, preemption and worker
restarts unchanged: the workers only receive, with each step, the allowed tokens (``TokenMask``: their ids,
the ids of the others, or xgrammar's bitmask, whichever is smallest) and give the others -inf before the
draw (``SamplingBatch.suppress``). A step for
such a request needs its previous token appended first, so it never runs ahead (async scheduling) nor with
drafted tokens (speculation).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pat_engine.errors import InvalidRequestError
from pat_engine.protocol import TokenMask
from pat_engine.sampling.structured import StructuredOutput

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[time] file.cc:line: " before its message


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured output needs xgrammar: pip install xgrammar "
                                  "(or pip install -e '.[structured]')") from None
    return xgrammar


GRAMMAR_CACHE_BYTES = 64 << 20
SPARSE_TOKENS = 2048  # a mask allowing, or banning, at most this many tokens is sent as their ids
_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def _bit_ids(words: np.ndarray, at: np.ndarray, set_bits: bool) -> np.ndarray:
    """Token ids of the set (or clear) bits of the words at indices ``at``."""
    bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(len(at), 32)
    rows, cols = np.nonzero(bits if set_bits else 1 - bits)
    return at[rows] * 32 + cols


def token_mask(words: np.ndarray, vocab_size: int) -> TokenMask:
    """A bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``) as the smallest
    ``TokenMask``: the ids when few tokens are allowed (a JSON key's next character) or few are not (inside
    a string), else the words. Masks of tens of thousands of tokens are what most steps would otherwise carry
    and unpack (``bench/results/structured_output_cost.md``)."""
    words = words[: (vocab_size + 31) // 32].copy()
    if vocab_size % 32:  # the last word's bits past the vocabulary are no tokens: cleared
        words.view(np.uint32)[-1] &= np.uint32((1 << (vocab_size % 32)) - 1)
    allowed = int(_POPCOUNT8[words.view(np.uint8)].sum())
    if allowed <= SPARSE_TOKENS:
        return TokenMask(only=tuple(_bit_ids(words, np.flatnonzero(words), True).tolist()))
    if vocab_size - allowed <= SPARSE_TOKENS:
        banned = _bit_ids(words, np.flatnonzero(words != -1), False)
        return TokenMask(banned=tuple(banned[banned < vocab_size].tolist()))
    return TokenMask(words=words.tobytes())


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]):
        if tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer, and the model has none")
        xgr = _xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        # one thread: the driver shares the host's cores; the cache of compiled grammars bounded, so clients
        # sending ever new schemas cannot grow the server without bound (xgrammar evicts the least used)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar; a constraint xgrammar cannot read is refused with its reason."""
        c = self._compiler
        try:
            if constraint.kind in ("json", "json_object"):  # json_object: an object, as OpenAI means it
                schema = constraint.spec if constraint.kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=constraint.any_whitespace)
            if constraint.kind == "regex":
                return c.compile_regex(constraint.spec)
            if constraint.kind == "choice":
                import json
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                  for s in constraint.choices()))
            return c.compile_grammar(constraint.spec)
        except RuntimeError as exc:
            reason = _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise InvalidRequestError(f"structured output: the {constraint.kind} does not compile: {reason}") from None

    def follow(self, compiled: Any) -> "GrammarState":
        return GrammarState(self._xgr, compiled, self.vocab_size)


class GrammarState:
    """One sample's place in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int):
        self._vocab_size = vocab_size
        self._matcher = xgr.GrammarMatcher(compiled)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fill = xgr.GrammarMatcher.fill_next_token_bitmask

    def accept(self, token: int) -> bool:
        """Follow a drawn token; False if the grammar does not allow it (it cannot have been drawn)."""
        return bool(self._matcher.accept_token(token))

    def allowed(self) -> TokenMask:
        """The tokens that may come next, in the smallest form (``token_mask``)."""
        self._fill(self._matcher, self._mask)
        return token_mask(self._mask[0].numpy(), self._vocab_size)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
