"""Turning user prompts and sampling parameters into validated sequences.

Everything is checked before anything is queued, so a bad request in a batch
rejects the call with a message naming the request and the problem, and the
engine keeps running. The checks here are those that need the model: stop
ids, logit-bias ids and ``top_k`` against the vocabulary, prompt length
against the context, stop strings against the tokenizer. A text prompt is
measured in characters before it is tokenized (tokenizing a 20 MB string
took 27 s and 3.6 GB), and a token list is measured before its ids are scanned.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

from pat_engine.core.grammar import GrammarCompiler
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.request import Sequence
from pat_engine.core.stop_strings import StopStringMatcher
from pat_engine.errors import InvalidRequestError
from pat_engine.model.arch import ModelArch
from pat_engine.parallel.layout import Layout
from pat_engine.sampling.params import SamplingParams
from pat_engine.sampling.seeds import request_seed, sample_seed
from pat_engine.sampling.spec import SamplingSpec

# No tokenizer we serve has tokens this long on average: a text longer than this many characters per
# context position cannot fit, whatever it tokenizes to, so it is refused without tokenizing.
MAX_CHARS_PER_TOKEN = 32


def max_prompt_chars(max_model_len: int) -> int:
    """The longest text prompt (characters) worth tokenizing for a context of ``max_model_len`` tokens."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def load_tokenizer(path: str | None, required: bool = False):
    """A Hugging Face tokenizer if the directory has one, else None (token-id prompts only); ``required``
    (a tokenizer directory the user named): ``InvalidRequestError`` naming it instead of None."""
    if path is None:
        return None
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        if required:
            raise InvalidRequestError(f"tokenizer {path!r}: no tokenizer.json, tokenizer_config.json or "
                                      "tokenizer.model there")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def _place(where: str) -> str:
    """The start of an error message: which prompt of a batch (empty for a single request)."""
    return f"{where}: " if where else ""


class RequestFactory:
    def __init__(self, arch: ModelArch, tokenizer, max_model_len: int, engine_seed: int):
        self.arch = arch
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.engine_seed = engine_seed
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # structured output (core/grammar.py), made when first needed

    def tokenize(self, prompt: Any, where: str, add_special_tokens: bool = True) -> tuple[list[int], str | None]:
        """A prompt's token ids (and its text, if it was one), checked against the context and vocabulary."""
        at = _place(where)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{at}text prompt given but the model has no tokenizer; pass token ids")
            if not prompt:
                raise InvalidRequestError(f"{at}empty prompt")
            limit = max_prompt_chars(self.max_model_len)
            if len(prompt) > limit:
                raise InvalidRequestError(
                    f"{at}prompt has {len(prompt)} characters, more than the {limit} that can fit a context "
                    f"of {self.max_model_len} tokens; shorten the prompt")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"{at}a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError(f"{at}empty prompt")
        if len(prompt) >= self.max_model_len:  # before scanning the ids: a 100 MB list is refused at once
            raise InvalidRequestError(
                f"{at}prompt has {len(prompt)} tokens but the context holds {self.max_model_len}; shorten the prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(f"{at}a prompt must be a string or a list of token ids (integers)")
        bad = [t for t in prompt if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError(f"{at}token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})")
        return list(prompt), None

    def make_batch(self, prompts: Any, params: SamplingParams | list[SamplingParams] | None,
                   request_ids: list[str] | None, memory: MemoryPlan, layout: Layout) -> list[list[Sequence]]:
        """``Engine.generate``'s prompts (one prompt, or a list) and params (one for all, or one each) as
        validated sequences, one list per prompt (its ``n`` samples, sample 0 first), each of which fits
        a DP group of ``layout``."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(request_ids)} request ids")
        single = len(prompts) == 1  # one prompt: errors need no "prompt i" to say which
        families = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            where = "" if single else f"prompt {i}"
            samples = self.make_samples(p, sp, request_ids[i] if request_ids else None, where=where)
            prompt_len = len(samples[0].prompt_ids)
            if not memory.fits(layout, prompt_len, sp.max_new_tokens):
                raise InvalidRequestError(
                    f"{_place(where)}needs {memory.slots_needed(prompt_len, sp.max_new_tokens)} KV token "
                    f"slots but a DP group of {layout} holds {memory.tokens_per_group(layout)}; "
                    "lower max_new_tokens or raise kv_cache_bytes")
            families.append(samples)
        return families

    def make_samples(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                     where: str = "") -> list[Sequence]:
        """The ``params.n`` samples of one prompt: one request id, sample 0 first; the later samples
        wait for sample 0's prefill and share its prompt blocks."""
        first = self.make(prompt, params, request_id, where)
        compiled = self._grammar(params, where)
        tags = params.structured_output.think_tags if params.structured_output is not None else None
        first.grammar = self.grammars.follow(compiled, tags, first.prompt_ids) if compiled is not None else None
        samples = [first]
        for i in range(1, params.n):
            seq_id = next(self._ids)
            samples.append(replace(first, seq_id=seq_id,
                                   sampling=replace(first.sampling, seed=sample_seed(first.sampling.seed, i)),
                                   sample_index=i, first_sample=first, prompt_ids=list(first.prompt_ids),
                                   output_ids=[], logprobs=[], top_logprobs=[], weight_versions=[], block_table=[],
                                   arrival_time=first.arrival_time, stop_strings=self._stop_matcher(params),
                                   grammar=self.grammars.follow(compiled, tags, first.prompt_ids)
                                   if compiled is not None else None))
        return samples

    def _grammar(self, params: SamplingParams, where: str) -> Any:
        """The request's compiled grammar (None without structured output); the compiler is made on the
        first request that needs one, so engines that never constrain never import xgrammar."""
        if params.structured_output is None:
            return None
        try:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
            return self._grammars.compile(params.structured_output)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{_place(where)}{exc}") from None

    @property
    def grammars(self) -> GrammarCompiler:
        assert self._grammars is not None, "compiled before any sample follows a grammar"
        return self._grammars

    def make(self, prompt: Any, params: SamplingParams, request_id: str | None = None, where: str = "") -> Sequence:
        at = _place(where)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{at}sampling params must be a SamplingParams, got {type(params).__name__}")
        self.check_params(params, where)
        ids, text = self.tokenize(prompt, where)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{at}prompt has {len(ids)} tokens but the context holds {self.max_model_len}; shorten the prompt")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"{at}prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length {self.max_model_len}")
        seq_id = next(self._ids)
        seed = params.seed if params.seed is not None else request_seed(self.engine_seed, seq_id)
        return Sequence(
            seq_id=seq_id,
            request_id=request_id or f"req-{seq_id}",
            prompt_ids=ids,
            params=params,
            sampling=SamplingSpec.of(params, seed, len(ids)),
            eos_ids=self.arch.eos_token_ids,
            max_len=self.max_model_len,
            prompt=text,
            stop_strings=self._stop_matcher(params),
        )

    def check_params(self, params: SamplingParams, where: str) -> None:
        """What SamplingParams cannot check alone: ids and counts against this model and tokenizer."""
        at, vocab = _place(where), self.arch.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"{at}stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidRequestError(f"{at}top_k={params.top_k} is larger than the vocabulary ({vocab} tokens)")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{at}logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"{at}stop strings need a tokenizer but the model has none; use stop_token_ids")

    def _stop_matcher(self, params: SamplingParams) -> StopStringMatcher | None:
        if not params.stop:
            return None
        return StopStringMatcher(self.tokenizer, params.stop, params.include_stop_str_in_output)

    def decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)
