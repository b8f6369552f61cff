"""Structured output on the driver: a request's constraint (``sampling/structured.py``) compiled by
xgrammar, and one matcher per sample that follows its tokens and says which tokens may come next.

The driver owns the matchers, so a constrained request survives live switches, preemption and worker
restarts unchanged: the workers only receive, with each step, the allowed tokens as a bitmask (32 tokens a
word, xgrammar's layout) and give the others -inf before the draw (``SamplingBatch.suppress``). A step for
such a request needs its previous token appended first, so it never runs ahead (async scheduling) nor with
drafted tokens (speculation).
"""

from __future__ import annotations

import re
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.sampling.structured import StructuredOutput

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[time] file.cc:line: " before its message


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured output needs xgrammar: pip install xgrammar "
                                  "(or pip install -e '.[structured]')") from None
    return xgrammar


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]):
        if tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer, and the model has none")
        xgr = _xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)  # the driver shares the host's cores
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
        self._matcher = xgr.GrammarMatcher(compiled)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fill = xgr.GrammarMatcher.fill_next_token_bitmask

    def accept(self, token: int) -> bool:
        """Follow a drawn token; False if the grammar does not allow it (it cannot have been drawn)."""
        return bool(self._matcher.accept_token(token))

    def allowed(self) -> bytes:
        """The tokens that may come next: int32 words (native order), bit ``t % 32`` of word ``t // 32`` set
        for token ``t``; as bytes, the step messages being plain data."""
        self._fill(self._matcher, self._mask)
        return self._mask[0].numpy().tobytes()

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
