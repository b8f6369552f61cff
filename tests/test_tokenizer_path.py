"""A tokenizer from another directory (``EngineConfig.tokenizer``, ``pat-serve --tokenizer``), as vLLM's flag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pat_engine import Engine, SamplingParams
from pat_engine.core.inputs import load_tokenizer
from pat_engine.errors import InvalidRequestError


def _without_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("tokenizer") and f.suffix != ".jinja":
            shutil.copy(f, dst / f.name)
    return dst


def test_a_named_directory_without_a_tokenizer_is_refused_by_name(model_dir, tmp_path):
    bare = _without_tokenizer(Path(model_dir("llama")), tmp_path / "bare")
    assert load_tokenizer(str(bare)) is None  # the model's own directory may have none: token ids only
    with pytest.raises(InvalidRequestError, match="tokenizer .*bare.*: no tokenizer.json"):
        load_tokenizer(str(bare), required=True)
    with pytest.raises(InvalidRequestError, match="no tokenizer.json"):
        Engine(str(bare), tokenizer=str(bare))  # before any worker starts


@pytest.mark.slow
def test_a_checkpoint_without_a_tokenizer_takes_text_through_a_named_one(model_dir, tmp_path):
    from transformers import AutoTokenizer

    src = model_dir("llama")
    bare = _without_tokenizer(Path(src), tmp_path / "bare")
    with Engine(str(bare), tp=1, dp=1, dtype="float32", tokenizer=src) as engine:
        out = engine.generate(["the answer is"], SamplingParams(max_new_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == AutoTokenizer.from_pretrained(src)("the answer is")["input_ids"]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
