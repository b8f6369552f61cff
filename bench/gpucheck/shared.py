"""What the parts of the GPU check share: model sizes and rooflines, the interleaved timer, the run's
context (mode, device, checkpoint) and the engine they start. One home, so no part copies another's."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pat_engine.tiny_model import TinyModelSpec

LLAMA3_8B = TinyModelSpec(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                          num_heads=32, num_kv_heads=8, max_position=8192, rope_theta=500000.0, seed=23)
# Llama-3.2-1B's shape (1.24 B parameters, 2.47 GB in bf16): the switch part's model, small enough for
# four ranks to share one GPU
LLAMA32_1B = TinyModelSpec(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                           num_heads=32, num_kv_heads=8, head_dim=64, max_position=8192, rope_theta=500000.0,
                           tie_word_embeddings=True, seed=32)
SMOKE_SPEC = TinyModelSpec(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_position=512, seed=23)
BLOCK_SIZE = 16  # the engine's default page

# Datasheet HBM bandwidth (bytes/s) by device name; the first match wins (H100 NVL / PCIe before SXM).
DATASHEET_BW = (
    ("H200", 4.8e12, "H200 SXM, 4.8 TB/s"),
    ("H100 NVL", 3.9e12, "H100 NVL, 3.9 TB/s"),
    ("H100 PCIe", 2.0e12, "H100 PCIe, 2.0 TB/s"),
    ("H100", 3.35e12, "H100 SXM, 3.35 TB/s"),
    ("A100-SXM4-80GB", 2.039e12, "A100 SXM 80GB, 2.04 TB/s"),
)


# ---- sizes and rooflines (pure) -----------------------------------------------------------------------


def weight_bytes(spec: TinyModelSpec, elt: int) -> int:
    """Bytes of every parameter of a Llama-shaped ``spec`` (what ``checkpoint.write_checkpoint`` writes)."""
    if spec.arch != "llama":
        raise ValueError(f"only the llama shape is written here, got {spec.arch!r}")
    h, v = spec.hidden_size, spec.vocab_size
    layer = 2 * h + layer_matmul_params(spec)  # 2 norms + the products
    return (v * h + spec.num_layers * layer + h + (0 if spec.tie_word_embeddings else v * h)) * elt


def layer_matmul_params(spec: TinyModelSpec) -> int:
    """Weights one decoder layer multiplies by: q, k, v, o, gate, up, down."""
    h, inter = spec.hidden_size, spec.intermediate_size
    hd = spec.head_dim or h // spec.num_heads
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    return h * q + 2 * h * kv + q * h + 3 * h * inter


def kv_bytes_per_token(spec: TinyModelSpec, elt: int) -> int:
    """K and V of one token over every layer."""
    hd = spec.head_dim or spec.hidden_size // spec.num_heads
    return 2 * spec.num_layers * spec.num_kv_heads * hd * elt


def roofline_ms(nbytes: float, bandwidth: float) -> float:
    """The time to stream ``nbytes`` once at ``bandwidth`` bytes/s, in ms."""
    return nbytes / bandwidth * 1e3


def datasheet_bandwidth(device_name: str | None) -> tuple[float, str] | None:
    """(bytes/s, label) of the device's HBM from its datasheet, None for an unknown device."""
    if not device_name:
        return None
    for key, bw, label in DATASHEET_BW:
        if key.lower() in device_name.lower():
            return bw, label
    return None


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ---- timing ---------------------------------------------------------------------------------------------


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                     device: str | torch.device) -> dict[str, list[float]]:
    """Seconds per call of each function, the calls interleaved (the order rotates every repeat).

    CUDA: GPU time between two events around each call, with the stream held busy by a sleep kernel
    first so the host's launch overhead is not timed. CPU: wall time."""
    names = list(fns)
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        for n in names:
            fns[n]()
    synchronize(device)
    out: dict[str, list[float]] = {n: [] for n in names}
    events = []
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                # ~0.5 ms of GPU work ahead of the start event: longer than any call's host side (a split-K
                # skinny GEMM allocates twice and launches two Triton kernels), so the GPU never drains
                # between a call's launches and their gaps are not timed as the call's
                torch.cuda._sleep(1_000_000)
                start.record()
                fns[n]()
                end.record()
                events.append((n, start, end))
            else:
                t = time.perf_counter()
                fns[n]()
                out[n].append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
        for n, start, end in events:
            out[n].append(start.elapsed_time(end) / 1e3)
    return out


def measure_copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``, counting the read and the write (2 x nbytes)."""
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1) for _ in range(2)]
    times = time_interleaved({"copy": lambda: bufs[1].copy_(bufs[0])}, repeats, 2, device)["copy"]
    bufs.clear()
    free_device_memory()
    return 2 * nbytes / median(times)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_START = time.perf_counter()


@contextlib.contextmanager
def env_switches(values: dict[str, str]) -> Iterator[None]:
    """The ``PAT_*`` switches (pat_engine/env.py) set to ``values`` inside, each restored after (unset where
    it was unset)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log(msg: str) -> None:
    print(f"[gpu_check +{time.perf_counter() - _START:6.1f}s] {msg}", flush=True)


class PartFailed(Exception):
    """A part that ran but failed its check; its message is the section body."""


# ---- the run's context ----------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a part reads: the mode (smoke: toy sizes on the CPU; quick: the headline rows only), the
    device, the model, the checkpoint and the sections earlier parts wrote (``previous``)."""

    args: argparse.Namespace
    previous: dict[str, Any]  # part name -> its last Section (report.Section), from the sidecar file

    @property
    def smoke(self) -> bool:
        return bool(self.args.smoke)

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def spec(self) -> TinyModelSpec:
        return SMOKE_SPEC if self.smoke else LLAMA3_8B

    @property
    def workdir(self) -> Path:
        path = Path(self.args.workdir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def gpu_name(self) -> str | None:
        return torch.cuda.get_device_name(0) if not self.smoke and torch.cuda.is_available() else None

    @property
    def sm_count(self) -> int:
        """The device's SMs (an H100 SXM's 132 for the CPU smoke, so the split rule sees a real count)."""
        if self.smoke:
            return 132
        return torch.cuda.get_device_properties(0).multi_processor_count

    def checkpoint(self, spec: TinyModelSpec | None = None, name: str | None = None) -> Path:
        """The random checkpoint of ``spec`` (default: the run's ``spec``) under the workdir as ``name``,
        written by the first part that asks."""
        from gpucheck.checkpoint import write_checkpoint

        if spec is None:
            spec, name = self.spec, "llama_smoke" if self.smoke else "llama3_8b_shape_bf16"
        t = time.perf_counter()
        path = write_checkpoint(self.workdir / name, spec, self.dtype, self.device)
        log(f"checkpoint {path} ready in {time.perf_counter() - t:.1f}s")
        return path

    def start_engine(self, *, eager: bool, max_batch: int, max_len: int, kv_tokens: int):
        """A TP1 ``Engine`` over the checkpoint with room for ``kv_tokens`` tokens of KV (+20%: the last
        block of each request and the graphs' scratch block), prefix caching off."""
        from pat_engine import Engine

        kv_bytes = int(kv_tokens * 1.2 * kv_bytes_per_token(self.spec, 2)) + (64 << 20)
        kw: dict[str, Any] = dict(tp=1, device=self.device, dtype="bfloat16", max_num_seqs=max_batch,
                                  max_model_len=-(-max_len // BLOCK_SIZE) * BLOCK_SIZE, kv_cache_bytes=kv_bytes,
                                  enable_prefix_caching=False)
        if self.smoke:
            kw["graph_backend"] = "standin"  # the CUDA graphs' bookkeeping, replayed eagerly on the CPU
        if eager:
            kw["enforce_eager"] = True
        t = time.perf_counter()
        engine = Engine(str(self.checkpoint()), **kw)
        log(f"engine ({'eager' if eager else 'graphs'}) started in {time.perf_counter() - t:.1f}s")
        return engine
