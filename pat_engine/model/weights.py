"""Loading a rank's shard from Hugging Face tensors, from disk or from memory.

Hugging Face names map onto local parameters; fused local parameters (qkv,
gate_up) take one component from each of several HF tensors. For each
(parameter, component) only the rows or columns this rank owns are read, so
no rank ever holds the full model. The same slicing serves ``update_weights``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch
from safetensors import safe_open
from torch import nn

from pat_engine.errors import ModelLoadError
from pat_engine.parallel.shard_spec import ShardSpec

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(
    r"^(layers\.\d+\.(?:self_attn|mlp|mlp\.experts\.\d+))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def hf_to_local(hf_name: str) -> tuple[str, int | None] | None:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``layers.0.self_attn.qkv_proj.weight``, 1);
    an expert's ``model.layers.0.mlp.experts.5.up_proj.weight`` -> (``layers.0.mlp.experts.5.gate_up_proj.weight``, 1).

    Returns None for tensors the engine does not use (rotary caches).
    """
    if _IGNORED.search(hf_name):
        return None
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    m = _FUSED_RE.match(name)
    if m:
        fused, component = _FUSED[m.group(2)]
        return f"{m.group(1)}.{fused}.{m.group(3)}", component
    return name, None


class SliceReader(Protocol):
    """Something that returns rows ``[start, stop)`` of a tensor along ``dim``."""

    shape: tuple[int, ...]

    def __call__(self, dim: int, start: int, stop: int) -> torch.Tensor: ...


def component_target(spec: ShardSpec, component: int | None, rank: int, tp: int) -> tuple[int, int, int, int]:
    """(full_start, full_stop, local_start, full_size) along the split dim for one component."""
    comps = spec.components
    idx = component or 0
    local_offset = sum(c.local_size(tp) for c in comps[:idx])
    start, stop = comps[idx].range_for(rank, tp)
    return start, stop, local_offset, comps[idx].size


def copy_component(param: nn.Parameter, component: int | None, read: SliceReader, rank: int, tp: int, name: str) -> None:
    """Fill the part of ``param`` that ``component`` of ``rank`` owns from ``read``."""
    spec: ShardSpec = param.shard_spec
    if spec.replicated:
        if tuple(read.shape) != tuple(spec.full_shape):
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(read.shape)} != expected {spec.full_shape}")
        param.data.copy_(read(0, 0, spec.full_shape[0]))
        return
    dim = spec.split_dim
    start, stop, local, size = component_target(spec, component, rank, tp)
    expected = list(spec.full_shape)
    expected[dim] = size
    if list(read.shape) != expected:
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(read.shape)} != expected {tuple(expected)}")
    if stop > start:
        param.data.narrow(dim, local, stop - start).copy_(read(dim, start, stop))


class _SafetensorsSlice:
    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __call__(self, dim: int, start: int, stop: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, stop)
        return self._slice[tuple(index)] if self.shape else self._slice[:]


class _InMemorySlice:
    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        self.shape = tuple(tensor.shape)

    def __call__(self, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._tensor.narrow(dim, start, stop - start)


class ShardLoader:
    """Tracks which (parameter, component) pairs have been filled for one rank."""

    def __init__(self, model: nn.Module, rank: int, tp: int):
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.rank, self.tp = rank, tp
        self.filled: set[tuple[str, int]] = set()

    def load(self, hf_name: str, read: SliceReader) -> None:
        target = hf_to_local(hf_name)
        if target is None:
            return
        local, component = target
        if local not in self.params:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no matching parameter")
        copy_component(self.params[local], component, read, self.rank, self.tp, hf_name)
        self.filled.add((local, component or 0))

    def missing(self) -> list[str]:
        out = []
        for name, param in self.params.items():
            n = max(1, len(param.shard_spec.components))
            for c in range(n):
                if (name, c) not in self.filled:
                    out.append(name if n == 1 else f"{name}[{c}]")
        return out


def _tied_alias_filled(loader: ShardLoader) -> None:
    # A tied LM head shares the embedding Parameter; loading one fills both names.
    params = loader.params
    if "lm_head.weight" in params and params["lm_head.weight"] is params.get("embed_tokens.weight"):
        if ("embed_tokens.weight", 0) in loader.filled or ("lm_head.weight", 0) in loader.filled:
            loader.filled |= {("embed_tokens.weight", 0), ("lm_head.weight", 0)}


def safetensors_files(model_path: str | Path) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(model_path)!r}")
    return files


def check_safetensors_headers(files: list[Path]) -> None:
    """Open each file's header (no tensor data is read): a truncated or corrupted file is named here,
    in the driver, before any worker starts. safetensors checks that the header covers the whole file."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as exc:
            raise ModelLoadError(f"checkpoint file {str(file)!r} is corrupted or truncated: {exc}") from None


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ModelLoadError(f"checkpoint tensor {name!r} holds NaN or infinite values")


@torch.no_grad()
def load_shard_from_disk(model: nn.Module, model_path: str | Path, rank: int, tp: int) -> None:
    loader = ShardLoader(model, rank, tp)
    for file in safetensors_files(model_path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    loader.load(name, _SafetensorsSlice(handle, name))
        except ModelLoadError:
            raise
        except Exception as exc:  # a file damaged after the driver's header check, or unreadable data
            raise ModelLoadError(f"cannot read checkpoint file {str(file)!r}: {exc}") from None
    for name, param in loader.params.items():  # this rank's shard only: every element is checked by some rank
        _check_finite(name, param.data)
    _tied_alias_filled(loader)
    missing = loader.missing()
    if missing:
        raise ModelLoadError(f"checkpoint {str(model_path)!r} lacks tensors for: {', '.join(missing[:8])}")


def byte_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of named tensors; a group closes once it holds ``limit`` bytes or more, so
    a weight update holds about one group at a time (every weight-sync path buckets with this)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


@torch.no_grad()
def load_shard_from_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], rank: int, tp: int,
    on_loaded: Callable[[str], None] | None = None,
) -> list[str]:
    """Load full HF-named tensors (as a trainer holds them); returns the names applied."""
    loader = ShardLoader(model, rank, tp)
    applied = []
    for name, tensor in named_tensors:
        loader.load(name, _InMemorySlice(tensor))
        applied.append(name)
        if on_loaded:
            on_loaded(name)
    return applied


class WeightNameCheck:
    """The HF tensor names and shapes a model accepts; lets the driver refuse a bad update up front."""

    def __init__(self, model: nn.Module):
        self.specs = {name: p.shard_spec for name, p in model.named_parameters(remove_duplicate=False)}

    def check(self, hf_name: str, shape: tuple[int, ...]) -> None:
        target = hf_to_local(hf_name)
        if target is None:
            return
        local, component = target
        spec = self.specs.get(local)
        if spec is None:
            raise ModelLoadError(f"unknown weight {hf_name!r} for this architecture")
        expected = list(spec.full_shape)
        if not spec.replicated:
            expected[spec.split_dim] = spec.components[component or 0].size
        if list(shape) != expected:
            raise ModelLoadError(f"{hf_name}: shape {tuple(shape)} != expected {tuple(expected)}")
