"""Turning user prompts and sampling parameters into validated sequences.

Everything is checked before anything is queued, so a bad request in a batch
rejects the call with a message naming the request and the problem, and the
engine keeps running. The checks here are those that need the model: stop
ids and ``top_k`` against the vocabulary, prompt length against the context.
A text prompt is measured in characters before it is tokenized (tokenizing
a 20 MB string took 27 s and 3.6 GB), and a token list is measured before
its ids are scanned.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.model.arch import ModelArch
from pat_engine.sampling.sampler import SamplingSpec, _splitmix64
from pat_engine.sampling_params import SamplingParams
from pat_engine.core.request import Sequence

# No tokenizer we serve has tokens this long on average: a text longer than this many characters per
# context position cannot fit, whatever it tokenizes to, so it is refused without tokenizing.
MAX_CHARS_PER_TOKEN = 32


def max_prompt_chars(max_model_len: int) -> int:
    """The longest text prompt (characters) worth tokenizing for a context of ``max_model_len`` tokens."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def load_tokenizer(path: str | None):
    """A Hugging Face tokenizer if the directory has one, else None (token-id prompts only)."""
    if path is None:
        return None
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


class RequestFactory:
    def __init__(self, arch: ModelArch, tokenizer, max_model_len: int, engine_seed: int):
        self.arch = arch
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.engine_seed = engine_seed
        self._ids = itertools.count()

    def tokenize(self, prompt: Any, where: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where}: text prompt given but the model has no tokenizer; pass token ids")
            if not prompt:
                raise InvalidRequestError(f"{where}: empty prompt")
            limit = max_prompt_chars(self.max_model_len)
            if len(prompt) > limit:
                raise InvalidRequestError(
                    f"{where}: prompt has {len(prompt)} characters, more than the {limit} that can fit a context "
                    f"of {self.max_model_len} tokens; shorten the prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"{where}: a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError(f"{where}: empty prompt")
        if len(prompt) >= self.max_model_len:  # before scanning the ids: a 100 MB list is refused at once
            raise InvalidRequestError(
                f"{where}: prompt has {len(prompt)} tokens but the context holds {self.max_model_len}; shorten the prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(f"{where}: a prompt must be a string or a list of token ids (integers)")
        bad = [t for t in prompt if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})")
        return list(prompt), None

    def make(self, prompt: Any, params: SamplingParams, request_id: str | None = None, where: str = "request") -> Sequence:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        self.check_params(params, where)
        ids, text = self.tokenize(prompt, where)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{where}: prompt has {len(ids)} tokens but the context holds {self.max_model_len}; shorten the prompt"
            )
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"{where}: prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length {self.max_model_len}"
            )
        seq_id = next(self._ids)
        # no seed given: derive one from the engine seed and the request number, still layout-invariant
        seed = params.seed if params.seed is not None else _splitmix64(self.engine_seed * 1_000_003 + seq_id) >> 1
        spec = SamplingSpec(params.temperature, params.top_k, params.top_p, int(seed), params.logprobs,
                            params.logprobs_mode == "processed")
        return Sequence(
            seq_id=seq_id,
            request_id=request_id or f"req-{seq_id}",
            prompt_ids=ids,
            params=params,
            spec=spec,
            eos_ids=self.arch.eos_token_ids,
            max_len=self.max_model_len,
            prompt=text,
        )

    def check_params(self, params: SamplingParams, where: str) -> None:
        """What SamplingParams cannot check alone: ids and counts against this model's vocabulary."""
        vocab = self.arch.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"{where}: stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidRequestError(f"{where}: top_k={params.top_k} is larger than the vocabulary ({vocab} tokens)")

    def decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)
