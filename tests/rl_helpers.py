"""Helpers shared by the RL integration tests: updated checkpoints and Ray start-up."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
CODE_PATHS = [str(ROOT), str(ROOT / "integrations"), str(ROOT / "tests")]


def perturbed_checkpoint(src: str, dst: Path, seed: int, scale: float = 0.05) -> str:
    """A copy of ``src`` whose every tensor moved by seeded noise: what a trainer step produces."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    moved = {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in weights.items()}
    save_file(moved, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def fresh_tensors(path: str):
    """Yield every tensor of a checkpoint as a new object, as a trainer's generator does."""
    for name, tensor in load_file(str(Path(path) / "model.safetensors")).items():
        yield name, tensor.clone()


def export_code_paths() -> dict[str, str | None]:
    """Make pat_engine / pat_integrations importable in Ray workers (a checkout is not installed).

    Ray's raylets inherit the environment of the process that starts them, so this must run
    before the cluster starts. Returns the previous values for ``restore_env``.
    """
    old = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    paths = CODE_PATHS + ([old["PYTHONPATH"]] if old["PYTHONPATH"] else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    return old


def restore_env(old: dict[str, str | None]) -> None:
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class VllmLikeSamplingParams:
    """The attributes of ``vllm.SamplingParams`` that OpenRLHF sets (vLLM is not installable here).

    Mutable like vLLM's: OpenRLHF's executors assign ``max_tokens`` on it. ``extra``: any other
    vLLM attribute (``repetition_penalty=1.2``, ``bad_words=[...]``, ...).
    """

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, max_tokens: int | None = 16,
                 min_tokens: int = 0, skip_special_tokens: bool = True, logprobs: int | None = None,
                 seed: int | None = None, n: int = 1, stop: list | None = None, ignore_eos: bool = False,
                 **extra):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.skip_special_tokens, self.logprobs, self.seed, self.n = skip_special_tokens, logprobs, seed, n
        self.stop, self.ignore_eos = stop or [], ignore_eos
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.min_p = 1.0, 0.0, 0.0, 0.0
        self.best_of, self.logit_bias, self.prompt_logprobs, self.bad_words = None, None, None, None
        self.include_stop_str_in_output, self.truncate_prompt_tokens, self.structured_outputs = False, None, None
        self.stop_token_ids = None
        for name, value in extra.items():
            if not hasattr(self, name):
                raise TypeError(f"not a vllm.SamplingParams attribute this stand-in knows: {name}")
            setattr(self, name, value)


def sync_by_handles(engines, model, key: str = "cpu") -> None:
    """OpenRLHF's ``broadcast_to_vllm`` with ``colocate_all`` (``_handle_cuda_ipc``): per parameter, a
    clone, its ``reduce_tensor`` keyed by the trainer's device (one trainer rank here: on CPU every
    rank's key is "cpu"), the call on every engine, the last parameter marked ``empty_cache``."""
    import ray
    from torch.multiprocessing.reductions import reduce_tensor

    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):
        weight = param.data.clone()
        refs = [e.update_weight_cuda_ipc.remote(name, dtype=param.dtype, shape=param.shape,
                                                ipc_handles={key: reduce_tensor(weight)}, empty_cache=count == len(params))
                for e in engines]
        ray.get(refs)
