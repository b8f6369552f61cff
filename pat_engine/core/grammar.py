"""Structured output on the driver: a request's constraint (``sampling/structured.py``) compiled by
xgrammar, and one matcher per sample that follows its tokens and says which tokens may come next.

The driver owns the matchers, so a constrained request survives live switches, preemption and worker
restarts unchanged: the workers only receive, with each step, the allowed tokens (``TokenMask``: their ids,
the ids of the others, or xgrammar's bitmask, whichever is smallest) and give the others -inf before the
draw (``SamplingBatch.suppress``). A step for such a request needs its previous token appended first, so it
never runs ahead (async scheduling) nor with drafted tokens (speculation). With think tags (a server with a
reasoning parser) a matcher waits until the answer has closed its thinking.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from pat_engine.errors import InvalidRequestError
from pat_engine.sampling.structured import StructuredOutput, TokenMask

GRAMMAR_CACHE_BYTES = 64 << 20
TAG_WINDOW_TOKENS = 16  # the last tokens decoded to find a close tag (a tag is one token or a few)
PROMPT_TAIL_TOKENS = 64  # where a template that turned thinking off has closed it (Qwen3: "<think></think>")
SPARSE_TOKENS = 2048  # a mask allowing, or banning, at most this many tokens is sent as their ids
_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[time] file.cc:line: " before its message


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured output needs xgrammar: pip install xgrammar "
                                  "(or pip install -e '.[structured]')") from None
    return xgrammar


def _bit_ids(words: np.ndarray, at: np.ndarray, set_bits: bool) -> np.ndarray:
    """Token ids of the set (or clear) bits of the words at indices ``at``."""
    bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(len(at), 32)
    rows, cols = np.nonzero(bits if set_bits else 1 - bits)
    return at[rows] * 32 + cols


def token_mask(words: np.ndarray, vocab_size: int) -> TokenMask:
    """A bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``) as the smallest
    ``TokenMask``: the ids when few tokens are allowed (a JSON key's next character) or few are not (inside
    a string), else the words. A bitmask of Qwen's vocabulary is 19 KB to send and unpack, where most steps
    of a JSON answer allow or ban a handful of tokens (``bench/results/structured_output_cost.md``)."""
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
        self._xgr, self._tokenizer = xgr, tokenizer
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

    def follow(self, compiled: Any, think_tags: tuple[str, str] | None = None,
               prompt_ids: list[int] | None = None) -> "GrammarState":
        """A sample's matcher; with ``think_tags`` it waits for the close tag first, unless the prompt
        already closed the thinking (a template that turned it off, as Qwen3's does)."""
        waits_for = None
        if think_tags is not None:
            opened, closed = think_tags
            tail = self._tokenizer.decode((prompt_ids or [])[-PROMPT_TAIL_TOKENS:])
            waits_for = None if tail.rfind(closed) > tail.rfind(opened) else closed
        return GrammarState(self._xgr, compiled, self.vocab_size, waits_for, self._tokenizer.decode)


class GrammarState:
    """One sample's place in its grammar; with ``waits_for`` (a close tag), free until the answer has
    written it: the model thinks first, the grammar holds after."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int, waits_for: str | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        self._vocab_size = vocab_size
        self._matcher = xgr.GrammarMatcher(compiled)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fill = xgr.GrammarMatcher.fill_next_token_bitmask
        self._waits_for, self._decode, self._recent = waits_for, decode, []

    @property
    def waiting(self) -> bool:
        return self._waits_for is not None

    def accept(self, token: int) -> bool:
        """Follow a drawn token; False if the grammar does not allow it (it cannot have been drawn)."""
        if self._waits_for is not None:  # thinking: watch the last tokens' text for the close tag
            self._recent = (self._recent + [token])[-TAG_WINDOW_TOKENS:]
            if self._waits_for in self._decode(self._recent):  # type: ignore[misc]
                self._waits_for = None  # the grammar holds from the next token
            return True
        return bool(self._matcher.accept_token(token))

    def allowed(self) -> TokenMask | None:
        """The tokens that may come next, in the smallest form (``token_mask``); None while thinking."""
        if self._waits_for is not None:
            return None
        self._fill(self._matcher, self._mask)
        return token_mask(self._mask[0].numpy(), self._vocab_size)
