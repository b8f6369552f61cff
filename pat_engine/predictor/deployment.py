"""Describe a deployment (what a latency table is valid for) and the model facts the cost model needs."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import torch

from pat_engine.config import EngineConfig
from pat_engine.model.arch import ModelArch
from pat_engine.model.footprint import weight_bytes_per_rank
from pat_engine.parallel import ipc_collectives
from pat_engine.parallel.devices import DevicePlacement, visible_devices
from pat_engine.parallel.layout import Layout
from pat_engine.platform_info import cpu_name, gpu_name
from pat_engine.predictor.table import Deployment, ModelShape
from pat_engine.version import __version__


def device_name(device: str, ranks_per_device: int = 1) -> str:
    """CPU timings depend on the processor and the core count; GPU timings on the GPU model, and on how many
    ranks share each GPU and which path their collectives take (a co-located test deployment's steps and
    collectives are not a one-per-GPU one's, and its host-staged collectives not its IPC slots')."""
    if device == "cuda":
        shared = ""
        if ranks_per_device > 1:
            shared = f", {ranks_per_device} ranks per device, collectives {ipc_collectives.colocated_path()}"
        return f"cuda: {gpu_name() or 'unknown'}{shared}"
    return f"cpu: {cpu_name()} ({os.cpu_count()} cores)"


def library_versions() -> dict:
    """The versions of what computes a step (``table.LATENCY_LIBRARIES``): torch, Triton, pat-engine."""
    out = {"torch": torch.__version__, "pat-engine": __version__}
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        out["triton"] = None
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_deployment(arch: ModelArch, model_path: str, dtype: torch.dtype, device: str, world: int,
                    block_size: int, threads_per_worker: int | None, candidate_tps: list[int] | None = None,
                    emulated: bool = False, collective_model: dict | None = None,
                    ranks_per_device: int = 1) -> Deployment:
    return Deployment(
        model_fingerprint=arch.fingerprint(),
        model_name=Path(model_path).name,
        dtype=dtype_name(dtype),
        device=device_name(device, ranks_per_device),
        world=world,
        candidate_tps=tuple(candidate_tps or (layout.tp for layout in arch.valid_layouts(world))),
        block_size=block_size,
        threads_per_worker=threads_per_worker if device == "cpu" else None,
        libraries=library_versions(),
        emulated=emulated,
        collective_model=collective_model,
    )


def engine_deployment(arch: ModelArch, cfg: EngineConfig) -> Deployment:
    """The deployment an engine of ``cfg`` serving ``arch`` runs (what its profile table must match)."""
    placement = DevicePlacement(cfg.world, visible_devices(cfg.device))
    return make_deployment(arch, cfg.model, cfg.torch_dtype(), cfg.device, cfg.world, cfg.block_size,
                           cfg.worker_threads(), ranks_per_device=placement.most_sharing)


def model_shape(arch: ModelArch, dtype: torch.dtype) -> ModelShape:
    elt = torch.empty((), dtype=dtype).element_size()
    return ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, elt, weight_bytes_per_rank(arch, 1, dtype))


def reshard_bytes(arch: ModelArch, dtype: torch.dtype, old: Layout, new: Layout) -> int:
    """Bytes the busiest rank sends when resharding weights old -> new (same plan the workers run)."""
    from pat_engine.model.llama import CausalLM
    from pat_engine.parallel.reshard_plan import plan_moves

    model = CausalLM(arch, new.tp, dtype, "meta")  # shapes and shard specs only, no memory
    elt = torch.empty((), dtype=dtype).element_size()
    sent: dict[int, int] = {}
    load: dict[int, int] = {}
    for _, p in model.named_parameters():
        spec = p.shard_spec
        if spec.replicated:
            continue
        row = elt
        for d, n in enumerate(spec.full_shape):
            if d != spec.split_dim:
                row *= n
        for mv in plan_moves(spec, old, new, load):
            if mv.src != mv.dst:
                sent[mv.src] = sent.get(mv.src, 0) + (mv.stop - mv.start) * row
    return max(sent.values(), default=0)
