"""One command for a one-GPU machine: run the ``gpu``-marked tests and measure (issue 23, item 4).

    python bench/gpu_check.py                          # every part, ~10 min on an H100: bench/results/gpu_check.md
    python bench/gpu_check.py --only decode splitkv    # some parts; the others' last results are kept
    python bench/gpu_check.py --smoke                  # toy sizes on the CPU, into a temp file (never the results)

Needs: one CUDA GPU with about 60 GB free (an H100 80GB or an H200), Python 3.10+, torch with CUDA
(2.4-2.13), Triton, safetensors, numpy, tqdm (transformers' own dependencies) and about 17 GB free
under ``--workdir`` (default /tmp/pat_gpu_check) for the checkpoint. pytest for part 6 only: without
it that part says so and is skipped. Not needed: network, the serving extras (fastapi, uvicorn,
prometheus-client, ray, httpx), ``pip install`` of this repository (the script puts the repo's
source folders on ``sys.path`` itself), a tokenizer (prompts are token ids).

Parts (``--only`` names), each printed as a table and collected into the results file with the
command, the machine and the date; a failing part is recorded as failed and the others still run:

1. ``decode``: TP1 decode ms per step (= per token of each sequence) of a Llama-3-8B-shaped random
   bfloat16 checkpoint (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocab 128256:
   16.06 GB) at batch 1 / 16 / 64 through the real ``Engine``, CUDA graphs on and ``enforce_eager``,
   both engines up at once and their runs interleaved, beside the HBM roofline (weight bytes /
   bandwidth: a measured device-to-device copy, and the datasheet figure for the device).
   Goal: batch 1 within 1.25x of the roofline (6.0 ms on an H100 SXM).
2. ``graphs``: CUDA graph capture seconds per ladder size, and the recapture after an emulated switch.
3. ``splitkv``: the split-KV decode kernel against the one-program kernel at tail shapes
   (2 x 16K, 8 x 4K; bf16, head_dim 128, 32 / 8 heads, block 16). Goal: >= 3x at 2 x 16K.
4. ``profile``: ``pat-profile --emulate-world 8 --device cuda`` on a small grid, as a subprocess.
5. ``weightsync``: ``Engine.update_weights`` GB/s (host and CUDA tensors) and
   ``update_weights_from_distributed`` from a trainer process (gloo; NCCL attempted, see the part).
6. ``tests``: ``python -m pytest -q -m gpu`` over the test files that hold ``gpu``-marked tests.
7. ``invariant``: decode ms per step, ``numerics="fast"`` vs ``"invariant"``, at batch 1 and 64 (issue 31).

The checkpoint is written once into ``--workdir`` (layer by layer, drawn on the GPU) and reused by
later runs. Under the device tool's 10-minute limit per command, run it as two commands on the same
warm machine: ``--only decode weightsync graphs`` then ``--only splitkv profile tests``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "bench", ROOT / "integrations", ROOT / "profiler", ROOT / "csrc", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from common import RESULTS, machine, markdown_table  # noqa: E402
from pat_engine.tiny_model import BOS_ID, EOS_ID, PAD_ID, TinyModelSpec, _hf_config  # noqa: E402

PARTS = ("decode", "graphs", "splitkv", "profile", "weightsync", "tests", "invariant")  # results-file order
# weightsync reuses decode's engine
RUN_ORDER = ("decode", "weightsync", "graphs", "splitkv", "profile", "tests", "invariant")
TITLES = {
    "decode": "1. TP1 decode vs the HBM roofline (Llama-3-8B shape, bf16)",
    "graphs": "2. CUDA graph capture and recapture",
    "splitkv": "3. Split-KV vs one-program decode attention at tail shapes",
    "profile": "4. pat-profile --emulate-world 8",
    "weightsync": "5. Weight sync",
    "tests": "6. gpu-marked tests",
    "invariant": "7. Invariant numerics' cost (issue 31)",
}

LLAMA3_8B = TinyModelSpec(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                          num_heads=32, num_kv_heads=8, max_position=8192, rope_theta=500000.0, seed=23)
SMOKE_SPEC = TinyModelSpec(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_position=512, seed=23)

# Datasheet HBM bandwidth (bytes/s) by device name; the first match wins (H100 NVL / PCIe before SXM).
DATASHEET_BW = (
    ("H200", 4.8e12, "H200 SXM, 4.8 TB/s"),
    ("H100 NVL", 3.9e12, "H100 NVL, 3.9 TB/s"),
    ("H100 PCIe", 2.0e12, "H100 PCIe, 2.0 TB/s"),
    ("H100", 3.35e12, "H100 SXM, 3.35 TB/s"),
    ("A100-SXM4-80GB", 2.039e12, "A100 SXM 80GB, 2.04 TB/s"),
)
ROOFLINE_GOAL = 1.25  # issue 23: batch-1 decode within 1.25x of weight bytes / bandwidth
SPLIT_KV_GOAL = 3.0  # issue 23: split-KV >= 3x the one-program kernel at 2 x 16K
LINK_BW = 150e9  # pat-profile's default per-rank link bandwidth (bytes/s), for the modelled switch


# ---- pure helpers (tests/test_gpu_check.py) ---------------------------------------------------------


def weight_bytes(spec: TinyModelSpec, elt: int) -> int:
    """Bytes of every parameter of a Llama-shaped ``spec`` (what ``write_checkpoint`` writes)."""
    if spec.arch != "llama":
        raise ValueError(f"only the llama shape is written here, got {spec.arch!r}")
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = spec.head_dim or h // spec.num_heads
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * inter  # 2 norms, q k v o, gate up down
    return (v * h + spec.num_layers * layer + h + (0 if spec.tie_word_embeddings else v * h)) * elt


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
    if cuda:
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {n: [] for n in names}
    events = []
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(200_000)  # ~0.1 ms of GPU work ahead of the start event
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


def pytest_summary(output: str) -> str:
    """pytest -q's last summary line ("3 passed, 1 skipped in 4.2s"), or the last line of the output."""
    lines = [ln.strip().strip("=").strip() for ln in output.strip().splitlines() if ln.strip()]
    pattern = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b|no tests ran")
    for line in reversed(lines):
        if pattern.search(line):
            return line
    return lines[-1] if lines else "(no output)"


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """Test files that hold a ``gpu``-marked test (collecting the others would import the serving extras)."""
    return sorted(p for p in tests_dir.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


@dataclass
class Section:
    part: str
    title: str
    body: str
    status: str  # "ok", "failed", "skipped"
    seconds: float
    command: str
    date: str
    machine: str


def render_report(sections: dict[str, Section], command: str, machine_line: str, date: str, smoke: bool,
                  environment: str = "") -> str:
    """The results file: header, then the sections in the issue's order (each with its own run when it
    came from an earlier command)."""
    lines = ["# GPU check (issue 23, item 4)", ""]
    if smoke:
        lines += ["**SMOKE RUN: toy sizes on the CPU. These numbers measure nothing.**", ""]
    lines += [f"- command: `{command}`", f"- machine: {machine_line}", f"- date: {date}"]
    lines += [f"- environment: {environment}", ""] if environment else [""]
    lines += ["| part | status | seconds | run |", "|---|---|---|---|"]
    for part in PARTS:
        s = sections.get(part)
        if s is not None:
            run = "this command" if s.command == command and s.date == date else f"`{s.command}` at {s.date}"
            lines.append(f"| {s.title} | {s.status} | {s.seconds:.0f} | {run} |")
    for part in PARTS:
        s = sections.get(part)
        if s is None:
            continue
        lines += ["", f"## {s.title}", ""]
        if not (s.command == command and s.date == date):
            lines += [f"_From `{s.command}` at {s.date} on {s.machine}._", ""]
        lines.append(s.body.rstrip())
    return "\n".join(lines) + "\n"


# ---- the checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(path: str | Path, spec: TinyModelSpec, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu") -> Path:
    """A random Llama checkpoint in Hugging Face format, one safetensors file per layer, reused when
    ``path`` already holds this spec in this dtype.

    ``pat_engine.tiny_model.write_tiny_model`` draws every tensor in float32 on one CPU thread and
    serialises the whole dict at once: for the 8B shape that is ~32 GB of float32 + 16 GB cast + a
    16 GB serialisation copy. Here each layer is drawn on ``device`` in ``dtype`` and written on its
    own (peak host memory: the LM head, 1 GB). No tokenizer: prompts are token ids."""
    from safetensors.torch import save_file

    out = Path(path)
    stamp = {"spec": asdict(spec), "dtype": str(dtype)}
    done = out / "gpu_check_checkpoint.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    cfg = _hf_config(spec)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}))
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(spec.seed)
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = cfg["head_dim"]
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, device=dev, dtype=torch.float32 if dev.type == "cpu" else dtype)
        return t.mul_(std).add_(mean).to(dtype).cpu().contiguous()

    def save(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / f"{name}.safetensors"), metadata={"format": "pt"})

    save("model-00-embed", {"model.embed_tokens.weight": normal(v, h, std=1.0)})
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        save(f"model-{i + 1:02d}-layer", {
            p + "input_layernorm.weight": normal(h, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": normal(h, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": normal(q, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, q, std=q**-0.5),
            p + "mlp.gate_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, inter, std=inter**-0.5),
        })
    head = {"model.norm.weight": normal(h, std=0.1, mean=1.0)}
    if not spec.tie_word_embeddings:
        head["lm_head.weight"] = normal(v, h, std=h**-0.5)
    save(f"model-{spec.num_layers + 1:02d}-head", head)
    (out / "pat_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    done.write_text(json.dumps(stamp))
    return out


def checkpoint_tensors(path: str | Path, limit_bytes: int | None = None) -> list[tuple[str, str]]:
    """(file, tensor name) in file order, up to ``limit_bytes`` of tensors (all when None)."""
    from safetensors import safe_open

    out, total = [], 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if limit_bytes is not None and total >= limit_bytes:
                    return out
                sl = f.get_slice(name)
                total += math.prod(sl.get_shape()) * 2  # bf16 here; only a budget
                out.append((str(file), name))
    return out


def load_tensors(pairs: list[tuple[str, str]], device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    out = []
    by_file: dict[str, list[str]] = {}
    for file, name in pairs:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                out.append((name, f.get_tensor(name).to(device)))
    return out


# ---- the run's context ------------------------------------------------------------------------------


class Ctx:
    """What the parts share: mode, sizes, the checkpoint, the open engines."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.smoke: bool = args.smoke
        self.device = "cpu" if self.smoke else "cuda"
        self.dtype = torch.bfloat16
        self.spec = SMOKE_SPEC if self.smoke else LLAMA3_8B
        self.workdir = Path(args.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ckpt: Path | None = None
        self.engines: dict[str, Any] = {}
        self.decode_max_batch = 2 if self.smoke else 64
        self.prompt_len = 8 if self.smoke else 64
        self.new_tokens = args.new_tokens or (4 if self.smoke else 128)

    @property
    def gpu_name(self) -> str | None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() and not self.smoke else None

    def checkpoint(self) -> Path:
        if self._ckpt is None:
            name = "llama_smoke" if self.smoke else "llama3_8b_shape_bf16"
            t = time.perf_counter()
            self._ckpt = write_checkpoint(self.workdir / name, self.spec, self.dtype, self.device)
            log(f"checkpoint {self._ckpt} ready in {time.perf_counter() - t:.1f}s")
        return self._ckpt

    def engine(self, kind: str):
        """The TP1 engine with decode graphs ("graphs") or without ("eager"), started once."""
        if kind not in self.engines:
            from pat_engine import Engine

            ctx_len = self.prompt_len + self.new_tokens + 16
            kv_bytes = int(self.decode_max_batch * ctx_len * kv_bytes_per_token(self.spec, 2) * 2) + (64 << 20)
            kw: dict[str, Any] = dict(tp=1, device=self.device, dtype="bfloat16", max_num_seqs=self.decode_max_batch,
                                      max_model_len=max(1024 if not self.smoke else 128, ctx_len),
                                      kv_cache_bytes=kv_bytes, enable_prefix_caching=False)
            if self.smoke:
                kw["graph_backend"] = "standin"  # the CUDA graphs' bookkeeping, replayed eagerly on the CPU
            if kind == "eager":
                kw["enforce_eager"] = True
            t = time.perf_counter()
            self.engines[kind] = Engine(str(self.checkpoint()), **kw)
            log(f"engine ({kind}) started in {time.perf_counter() - t:.1f}s")
        return self.engines[kind]

    def close_engine(self, kind: str) -> None:
        engine = self.engines.pop(kind, None)
        if engine is not None:
            engine.shutdown()
        free_device_memory()

    def close_engines(self) -> None:
        for kind in list(self.engines):
            self.close_engine(kind)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_check +{time.perf_counter() - _START:6.1f}s] {msg}", flush=True)


def measure_copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``, counting the read and the write (2 x nbytes)."""
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1) for _ in range(2)]
    times = time_interleaved({"copy": lambda: bufs[1].copy_(bufs[0])}, repeats, 2, device)["copy"]
    bufs.clear()
    free_device_memory()
    return 2 * nbytes / median(times)


# ---- 1. decode ----------------------------------------------------------------------------------------


def _decode_run(engine, batch: int, prompt_len: int, new_tokens: int, seed: int, vocab: int) -> dict:
    from pat_engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, min(vocab, 30000), (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    with engine.record_steps() as steps:
        outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    assert all(len(o.token_ids) == new_tokens for o in outs), "a request did not run to its fixed length"
    dec = [s for s in steps if not s.is_prefill and s.batch_size == batch]
    return {"step_s": [s.seconds for s in dec], "forward_s": [s.forward_seconds for s in dec], "wall_s": wall}


def part_decode(ctx: Ctx) -> str:
    spec, elt = ctx.spec, 2
    wbytes = weight_bytes(spec, elt)
    streamed = wbytes - spec.vocab_size * spec.hidden_size * elt  # the embedding table is gathered by row
    batches = (1, 2) if ctx.smoke else (1, 16, 64)
    rounds = ctx.args.rounds or (1 if ctx.smoke else 3)
    bw = measure_copy_bandwidth(ctx.device, (64 << 20) if ctx.smoke else (1 << 30))
    sheet = datasheet_bandwidth(ctx.gpu_name)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s; datasheet {sheet[1] if sheet else 'n/a'}")
    modes = ("graphs", "eager")
    for mode in modes:
        ctx.engine(mode)
    for mode in modes:  # warm-up: every batch size once (lazy allocations, Triton JIT, the allocator)
        for b in batches:
            _decode_run(ctx.engine(mode), b, ctx.prompt_len, min(8, ctx.new_tokens), 99, spec.vocab_size)
    got: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in range(rounds):
        for b in batches:
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                res = _decode_run(ctx.engine(mode), b, ctx.prompt_len, ctx.new_tokens, r * 100 + b, spec.vocab_size)
                acc = got.setdefault((mode, b), {"step_s": [], "forward_s": [], "wall_s": []})
                acc["step_s"] += res["step_s"]
                acc["forward_s"] += res["forward_s"]
                acc["wall_s"].append(res["wall_s"])
        log(f"decode round {r + 1}/{rounds} done")
    stats = {mode: ctx.engine(mode).worker_stats()[0]["graphs"] for mode in modes}
    ctx.close_engine("eager")  # weightsync reuses the graphs engine
    mean_ctx = ctx.prompt_len + ctx.new_tokens / 2
    rows = []
    for b in batches:
        kv = b * mean_ctx * kv_bytes_per_token(spec, elt)
        for mode in modes:
            a = got[(mode, b)]
            step = median(a["step_s"]) * 1e3
            rows.append([b, mode, len(a["step_s"]), step, median(a["forward_s"]) * 1e3, b / step * 1e3,
                         roofline_ms(wbytes, bw), step / roofline_ms(wbytes, bw),
                         roofline_ms(wbytes, sheet[0]) if sheet else "n/a",
                         step / roofline_ms(wbytes, sheet[0]) if sheet else "n/a",
                         roofline_ms(streamed + kv, bw)])
    table = markdown_table(
        ["batch", "mode", "steps", "ms / step (driver)", "ms / step (worker forward)", "tok/s",
         "roofline ms (measured BW)", "x roofline", "roofline ms (datasheet)", "x datasheet roofline",
         "streamed weights + KV / measured BW, ms"], rows)
    g1 = median(got[("graphs", 1)]["step_s"]) * 1e3
    ref_bw, ref_label = (sheet[0], sheet[1]) if sheet else (bw, f"measured copy {bw / 1e12:.2f} TB/s")
    limit = ROOFLINE_GOAL * roofline_ms(wbytes, ref_bw)
    goal = (f"**Goal (batch 1 within {ROOFLINE_GOAL}x of the roofline, {ref_label}): {g1:.2f} ms vs limit "
            f"{limit:.2f} ms: {'met' if g1 <= limit else 'NOT met'}.**")
    if ctx.smoke:
        goal = "Goal: not judged in the smoke run."
    graphs = stats["graphs"]
    lines = [
        f"Model: {'a toy Llama' if ctx.smoke else 'Llama-3-8B shape'} (hidden {spec.hidden_size}, "
        f"{spec.num_layers} layers, {spec.num_heads} / {spec.num_kv_heads} heads, intermediate "
        f"{spec.intermediate_size}, vocab {spec.vocab_size}), random bfloat16, {wbytes / 1e9:.2f} GB of weights. "
        f"Engine: tp=1, device={ctx.device}, max_num_seqs "
        f"{ctx.decode_max_batch}, prefix caching off; requests of {ctx.prompt_len} prompt tokens and exactly "
        f"{ctx.new_tokens} new tokens (min_new_tokens = max_new_tokens, ignore_eos, greedy). The graphs engine and "
        f"the enforce_eager engine are up at once and run each batch in turn, the order swapped every round; "
        f"{rounds} round(s) after a warm-up. ms / step: median decode step over the rounds, driver side "
        f"(dispatch to result, the worker round trip included); at batch B each step gives each sequence one "
        f"token, so it is the ms per token.",
        "",
        f"Bandwidth: measured device-to-device copy {bw / 1e9:.0f} GB/s (2 x bytes / time, read + write); "
        f"datasheet: {sheet[1] if sheet else 'unknown device, n/a'}. Roofline = all weight bytes / bandwidth, "
        f"as issue 23 computes its 6.0 ms; a step streams {streamed / 1e9:.2f} GB of them (the embedding table is "
        f"gathered by row) plus the batch's KV (last column, at the mean context {mean_ctx:.0f}).",
        "",
        table,
        "",
        goal,
        "",
        f"Graphs engine at start-up: captured {graphs.get('captured')} in {graphs.get('capture_s', 0):.2f} s "
        f"({graphs.get('capture_s_per_size', 0) * 1e3:.0f} ms per size); replays {graphs.get('replays')}, eager "
        f"decodes {graphs.get('eager_decodes')}. Eager engine: {stats['eager'].get('captures')} captures, "
        f"{stats['eager'].get('replays')} replays.",
    ]
    if ctx.smoke:
        lines.append("\nSmoke: graph_backend \"standin\" (eager replays); datasheet roofline n/a on the CPU.")
    return "\n".join(lines)


# ---- 2. graph capture -------------------------------------------------------------------------------


def _executor(ctx: Ctx, arch, world: int, tp: int, ladder: tuple[int, ...], max_context: int, num_blocks: int):
    from pat_engine.parallel.comm import TPGroup
    from pat_engine.parallel.layout import Layout
    from pat_engine.worker.graph_capture import GraphSettings
    from pat_engine.worker.infer_executor import InferExecutor
    from pat_profiler.emulate import EmulatedTPGroup

    group = TPGroup(rank=0, size=1, ranks=(0,)) if tp == 1 else EmulatedTPGroup(tp)
    layout = Layout(1, 1) if tp == 1 else Layout.for_world(world, tp)
    settings = GraphSettings("standin" if ctx.smoke else "cuda", ladder, max_context)
    ex = InferExecutor(arch, layout, group, ctx.dtype, torch.device(ctx.device), block_size=16,
                       num_blocks=num_blocks, graphs=settings)
    with torch.no_grad(), ex.writing_weights():  # random weights: capture does not depend on their values
        for p in ex.model.parameters():
            p.data.normal_(0.0, 0.02)
    return ex


def _timed_captures(ex) -> dict[int, float]:
    """Seconds of each size's capture from now on (the manager's per-size step, wrapped)."""
    times: dict[int, float] = {}
    inner = ex.graphs._capture_one

    def timed(b: int):
        t = time.perf_counter()
        graph = inner(b)
        times[b] = time.perf_counter() - t
        return graph

    ex.graphs._capture_one = timed
    return times


def part_graphs(ctx: Ctx) -> str:
    from pat_engine.config import graph_ladder, graph_sizes_upto
    from pat_engine.model.arch import load_model_arch
    from pat_engine.parallel.layout import Layout
    from pat_engine.predictor.deployment import reshard_bytes

    arch = load_model_arch(str(ctx.checkpoint()))
    world = 2 if ctx.smoke else 8
    ladder = graph_ladder(8 if ctx.smoke else 256)
    max_context, num_blocks = (128, 32) if ctx.smoke else (4096, 512)
    uptos = (1, 4, 8) if ctx.smoke else (1, 8, 64, 256)
    switches = ((2, 1), (1, 2)) if ctx.smoke else ((2, 1), (1, 2), (2, 4), (4, 8))

    # (a) the TP1 ladder, one size at a time (largest first, as the engine captures)
    ex = _executor(ctx, arch, world, 1, ladder, max_context, num_blocks)
    times = _timed_captures(ex)
    n, total = ex.capture_graphs()
    per_size = markdown_table(["batch size", "capture ms"], [[b, times[b] * 1e3] for b in sorted(times)])
    log(f"TP1 ladder: {n} graphs in {total:.2f}s")

    # (b) an emulated switch: the target's rank-0 shard, a new pool (install drops the graphs), then the
    # capture a switch runs for `upto` unfinished requests
    rows, current = [], 1
    for src, dst in switches:
        if dst != current:
            del ex
            free_device_memory()
            ex, current = _executor(ctx, arch, world, dst, ladder, max_context, num_blocks), dst
            cold_n, cold_s = ex.capture_graphs(max(uptos))
            rows.append([f"TP{src}->TP{dst}", f"{max(uptos)}, first capture of this shard (cold)", cold_n, cold_s,
                         cold_s / max(cold_n, 1) * 1e3, "", ""])
        moved = reshard_bytes(arch, ctx.dtype, Layout.for_world(world, src), Layout.for_world(world, dst))
        moved_s = moved / LINK_BW
        for upto in uptos:
            old = ex.kv
            ex.install(ex.layout, ex.tp, ex.new_pool(ex.layout, num_blocks), {})
            old.release()
            got, secs = ex.capture_graphs(upto)
            assert got == len(graph_sizes_upto(ladder, upto)), (got, upto)
            rows.append([f"TP{src}->TP{dst}", upto, got, secs, secs / max(got, 1) * 1e3, moved_s,
                         secs / (secs + moved_s) if moved_s else "n/a (no weight moves)"])
        log(f"emulated switch TP{src}->TP{dst} done")
    del ex
    free_device_memory()
    recapture = markdown_table(
        ["switch (emulated)", "upto (unfinished requests)", "graphs captured", "recapture s", "ms per graph",
         f"modelled weight move s ({LINK_BW / 1e9:.0f} GB/s link)", "recapture share of (recapture + move)"], rows)
    return "\n".join([
        f"In this process, one InferExecutor per shard with the engine's own DecodeGraphs "
        f"({'stand-in' if ctx.smoke else 'torch.cuda.CUDAGraph'} backend, attention backend auto), random "
        f"bf16 weights of the checkpoint's shapes, block tables {max_context} tokens wide, ladder {list(ladder)}.",
        "",
        f"**TP1 ladder: {n} graphs in {total:.2f} s ({total / max(n, 1) * 1e3:.0f} ms per size on average).** "
        "Per size (each includes the backend's 2 warm-up forwards and the synchronise after the capture):",
        "",
        per_size,
        "",
        "**Recapture after an emulated switch.** One GPU cannot run a switch (a switch needs a world of at "
        "least 2), so what is emulated: the target layout's TP rank-0 shard of a world of "
        f"{world} (pat-profile's EmulatedTPGroup: its collectives return local data, so no communication is "
        "timed), a fresh KV pool installed as a switch's KV phase installs it (which drops every graph), then "
        "`capture_graphs(upto)`, the call a switch makes in its timed graphs phase for a DP group with `upto` "
        "unfinished requests. The first row of each target shard is its first capture (cold: Triton compiles "
        "kernels for the new head counts; a long-lived worker pays this once per layout, and Triton's disk "
        "cache spares later processes). No switch time was measured on this machine, so the share is against "
        "a modelled switch: the busiest rank's weight bytes (the reshard plan's) over the link model "
        "pat-profile assumes; a real switch also pays its KV migration, group set-up and the drain, so the real "
        "share is lower. A switch to a higher TP moves no weights (each rank slices what it holds), so that "
        "share is n/a here.",
        "",
        recapture,
    ])


# ---- 3. split-KV ------------------------------------------------------------------------------------


def split_kv_case(batch: int, context: int, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  block_size: int = 16, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                  repeats: int = 50, warmup: int = 5, sm_count: int | None = None,
                  tokens_per_split: int | None = None, seed: int = 0) -> dict:
    """Time the split-KV kernel (split from ``decode_splits``, or ``tokens_per_split``) against the
    one-program kernel on ``batch`` sequences of ``context`` tokens; also their largest difference."""
    from pat_engine.model.layers.triton_attention import decode_splits
    from pat_kernels.paged_decode_attention import paged_decode_attention
    from pat_kernels.split_kv_decode import split_kv_decode_attention

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    per_seq = -(-context // block_size)
    blocks = batch * per_seq + 1  # one spare block nobody reads
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g, device=dev).to(dtype)
    perm = torch.randperm(blocks - 1, generator=g, device=dev)
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()  # shuffled pages
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, head_dim, generator=g, device=dev).to(dtype)
    scale = head_dim**-0.5
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    rule = decode_splits(batch, heads, per_seq * block_size, sm_count, "fast", block_size)
    tps = tokens_per_split or rule
    if tps is None:
        raise ValueError(f"decode_splits gives one program for {batch} x {context} (no split to time)")
    k, v = kv[0], kv[1]
    fns = {"one-program": lambda: paged_decode_attention(q, k, v, tables, lens, scale),
           "split-KV": lambda: split_kv_decode_attention(q, k, v, tables, lens, scale, tps)}
    diff = (fns["one-program"]().float() - fns["split-KV"]().float()).abs().max().item()
    times = time_interleaved(fns, repeats, warmup, dev)
    one, split = median(times["one-program"]), median(times["split-KV"])
    kv_bytes = batch * context * kv_heads * head_dim * 2 * kv.element_size()
    return {"batch": batch, "context": context, "sm_count": sm_count, "rule_tps": rule, "tps": tps,
            "splits": -(-per_seq * block_size // tps), "one_s": one, "split_s": split, "speedup": one / split,
            "kv_bytes": kv_bytes, "one_gbps": kv_bytes / one / 1e9, "split_gbps": kv_bytes / split / 1e9,
            "max_abs_diff": diff, "repeats": repeats}


def part_splitkv(ctx: Ctx) -> str:
    if ctx.smoke:
        cases = [dict(batch=2, context=64, heads=4, kv_heads=2, head_dim=16, tokens_per_split=32),
                 dict(batch=4, context=32, heads=4, kv_heads=2, head_dim=16, tokens_per_split=16)]
        repeats, warmup = 2, 1
    else:
        cases = [dict(batch=2, context=16384), dict(batch=8, context=4096)]
        repeats, warmup = ctx.args.repeats, 5
    rows, results = [], []
    for case in cases:
        r = split_kv_case(device=ctx.device, repeats=repeats, warmup=warmup, **case)
        results.append(r)
        rows.append([f"{r['batch']} x {r['context']}", r["tps"], r["splits"], r["one_s"] * 1e6, r["split_s"] * 1e6,
                     r["speedup"], r["one_gbps"], r["split_gbps"], r["max_abs_diff"]])
        log(f"split-KV {r['batch']} x {r['context']}: {r['speedup']:.2f}x")
    table = markdown_table(["shape (seqs x context)", "tokens per split", "splits", "one-program us", "split-KV us",
                            "speedup", "one-program KV GB/s", "split-KV KV GB/s", "max |diff|"], rows)
    head = results[0]
    goal = (f"**Goal (split-KV >= {SPLIT_KV_GOAL}x at 2 x 16K): {head['speedup']:.2f}x: "
            f"{'met' if head['speedup'] >= SPLIT_KV_GOAL else 'NOT met'}.**")
    if ctx.smoke:
        setup = ("Smoke: toy shapes (4 q heads / 2 KV heads, head_dim 16) under TRITON_INTERPRET=1 (numpy), the "
                 "split forced (decode_splits gives none below 2 x 256 tokens); times measure the interpreter.")
        goal = "Goal: not judged in the smoke run."
    else:
        setup = (f"bf16, head_dim 128, 32 q heads / 8 KV heads, block size 16, pages shuffled; split chosen by "
                 f"decode_splits(fast) with the device's {head['sm_count']} SMs. GPU time per call from CUDA "
                 f"events (stream held busy ahead of each call, so launch overhead is excluded), {repeats} calls "
                 f"each after {warmup} warm-ups, interleaved, median. KV GB/s = K+V bytes of the contexts / time, "
                 f"each byte counted once (the 4 q heads of a KV head each read it).")
    return "\n".join([setup, "", table, "", goal])


# ---- 4. pat-profile --emulate-world -----------------------------------------------------------------


def part_profile(ctx: Ctx) -> str:
    from pat_engine.predictor.table import ProfileTable

    out = ctx.workdir / ("profile_emulated_smoke.json" if ctx.smoke else "profile_emulated.json")
    if ctx.smoke:
        grid = ["--emulate-world", "2", "--device", "cpu", "--tp", "1", "2", "--batch-sizes", "1", "2",
                "--context-lens", "16", "--decode-window", "2"]
    else:
        grid = ["--emulate-world", "8", "--device", "cuda", "--tp", "1", "2", "4", "8", "--batch-sizes", "1", "16",
                "64", "--context-lens", "256", "2048", "--decode-window", "16"]
    argv = ["--model", str(ctx.checkpoint()), "--dtype", "bfloat16", *grid, "--output", str(out)]
    cmd = [sys.executable, "-m", "pat_profiler.cli", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "TQDM_DISABLE": "1"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.args.profile_timeout, env=env, cwd=ROOT)
    secs = time.perf_counter() - t
    shown = "pat-profile " + " ".join(shlex.quote(a) for a in argv)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shown}` exited {proc.returncode} after {secs:.0f}s:\n{proc.stderr[-3000:]}")
    table = ProfileTable.load(out)
    rows = [[p.tp, p.batch_size, p.context_len, p.prefill_s * 1e3, p.decode_step_s * 1e3, p.decode_step_std_s * 1e3]
            for p in sorted(table.points, key=lambda p: p.key)]
    copied = ""
    if not ctx.smoke:
        dest = RESULTS / "gpu_check_profile_emulated.json"
        dest.write_text(out.read_text())
        copied = f" The table: `{dest.relative_to(ROOT)}`."
    return "\n".join([
        f"`{shown}` ({secs:.0f} s, a subprocess). Emulated: each TP degree's rank-0 shard runs alone on this "
        "device and the collectives it skips are charged from pat-profile's ring model (link "
        f"{LINK_BW / 1e9:.0f} GB/s, 8 us per hop); switch costs are modelled, not run.{copied}",
        "",
        "```",
        proc.stdout.strip()[-2000:],
        "```",
        "",
        markdown_table(["TP", "batch", "context", "prefill ms", "decode ms / step", "decode std ms"], rows),
    ])


# ---- 5. weight sync -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_main(port: int, backend: str, device: str, pairs: list, group: str, conn, timeout_s: float) -> None:
    """Trainer rank 0 of the weight-update group: join, load the tensors, broadcast them on "go"."""
    try:
        import torch.distributed as dist

        from pat_engine.parallel.update_group import join_update_group

        if device == "cuda":
            torch.cuda.set_device(0)
        pg = join_update_group("127.0.0.1", port, 0, 2, group, backend, timeout_s)
        tensors = load_tensors(pairs, device)
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send(("ready", None))
        if conn.recv() != "go":
            return
        t = time.perf_counter()
        for _, x in tensors:
            dist.broadcast(x, src=0, group=pg)
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send(("done", time.perf_counter() - t))
        conn.recv()  # the engine has left the group
        dist.destroy_process_group(pg)
    except BaseException as exc:  # reported to the parent, which decides
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))


def _distributed_update(engine, pairs: list, shapes: dict, backend: str, device: str,
                        timeout_s: float) -> tuple[int, float]:
    """One update_weights_from_distributed of ``pairs`` from a trainer process; (bytes, seconds)."""
    port, group = _free_port(), f"gpu-check-{backend}"
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_trainer_main,
                                           args=(port, backend, device, pairs, group, child, timeout_s), daemon=True)
    proc.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name=group, backend=backend,
                                         timeout_s=timeout_s)
        if not parent.poll(timeout_s):
            raise TimeoutError("the trainer did not load its tensors in time")
        tag, info = parent.recv()
        if tag != "ready":
            raise RuntimeError(f"trainer: {info}")
        names = [n for _, n in pairs]
        dtypes = [str(shapes[n][1]).removeprefix("torch.") for n in names]
        dims = [list(shapes[n][0]) for n in names]
        nbytes = sum(math.prod(shapes[n][0]) * shapes[n][2] for n in names)
        parent.send("go")
        t = time.perf_counter()
        engine.update_weights_from_distributed(names, dtypes, dims, group_name=group, timeout_s=timeout_s)
        secs = time.perf_counter() - t
        if parent.poll(timeout_s):
            tag, info = parent.recv()
            if tag == "error":
                raise RuntimeError(f"trainer: {info}")
        parent.send("bye")
        engine.destroy_weights_update_group(group)
        return nbytes, secs
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def part_weightsync(ctx: Ctx) -> str:
    engine = ctx.engine("graphs")
    ckpt = ctx.checkpoint()
    pairs = checkpoint_tensors(ckpt)
    host = load_tensors(pairs, "cpu")
    shapes = {n: (tuple(x.shape), x.dtype, x.element_size()) for n, x in host}
    total = sum(x.numel() * x.element_size() for _, x in host)
    repeats = 1 if ctx.smoke else 2
    rows, notes = [], []

    def handed_over(items: list) -> Any:
        """Yield and forget: each tensor is freed once its bucket is sent (shared memory holds ~1 bucket)."""
        items.reverse()
        while items:
            yield items.pop()

    def timed_update(tensors: list) -> float:
        count = len(tensors)
        t = time.perf_counter()
        applied = engine.update_weights(handed_over(tensors))
        assert applied == count, (applied, count)
        return time.perf_counter() - t

    # Pickling a host tensor moves its storage into shared memory (in place): fresh copies per update, as a
    # trainer hands over new tensors every step, so each timed update pays that copy.
    secs = [timed_update([(n, x.clone()) for n, x in host]) for _ in range(repeats)]
    rows.append(["update_weights, host tensors (copied into shared memory for the worker)", total / 1e9,
                 median(secs), total / median(secs) / 1e9])
    del host
    free_device_memory()
    if ctx.device == "cuda":
        try:
            on_gpu = load_tensors(pairs, "cuda")
            torch.cuda.synchronize()
            secs = [timed_update(list(on_gpu)) for _ in range(repeats)]
            rows.append(["update_weights, CUDA tensors of this process (CUDA IPC)", total / 1e9, median(secs),
                         total / median(secs) / 1e9])
            del on_gpu
        except Exception as exc:
            notes.append(f"update_weights with CUDA tensors failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        free_device_memory()
    else:
        notes.append("skipped on CPU: update_weights with CUDA tensors (needs CUDA)")
    log("update_weights done")

    limit = None if ctx.smoke else int(ctx.args.sync_gb * 1e9)
    subset = checkpoint_tensors(ckpt, limit)
    backends = ["gloo"] if ctx.smoke else ["gloo", "nccl"]
    for backend in backends:
        try:
            timeout = ctx.args.sync_timeout if backend == "gloo" else min(60.0, ctx.args.sync_timeout)
            nbytes, secs = _distributed_update(engine, subset, shapes, backend, ctx.device, timeout)
            rows.append([f"update_weights_from_distributed, {backend}, trainer process on the same "
                         f"{'GPU' if ctx.device == 'cuda' else 'host'}", nbytes / 1e9, secs, nbytes / secs / 1e9])
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            notes.append(f"update_weights_from_distributed over {backend} failed: {type(exc).__name__}: "
                         f"{(msg[0] if msg else '')[:400]}")
            ctx.close_engine("graphs")  # a failed collective may leave the worker's group half-made
            if backend != backends[-1]:
                engine = ctx.engine("graphs")
        log(f"update_weights_from_distributed ({backend}) done")
    if ctx.smoke:
        notes.append("skipped on CPU: update_weights_from_distributed over NCCL (needs CUDA)")
    table = markdown_table(["path", "GB", "seconds", "GB/s"], rows)
    return "\n".join([
        f"The decode part's TP1 engine (graphs on); the update is applied at a step boundary with nothing "
        f"running. update_weights: every tensor of the checkpoint ({total / 1e9:.2f} GB), already in this "
        f"process's memory, default 256 MiB buckets, median of {repeats}. update_weights_from_distributed: the "
        f"first {sum(math.prod(shapes[n][0]) * shapes[n][2] for _, n in subset) / 1e9:.2f} GB of tensors "
        f"(--sync-gb), broadcast by a trainer process (group rank 0) to the engine's worker (rank 1); seconds "
        "from the call to its return (the trainer starts broadcasting as the call is made). On one GPU, NCCL "
        "refuses a communicator with two ranks on the same device (\"Duplicate GPU detected\") in the NCCL "
        "versions we know of, so the gloo row (CUDA tensors staged through host memory on both sides) is the "
        "one-GPU figure and the NCCL attempt's outcome is reported as it happened; NCCL's real figure needs "
        "two GPUs.",
        "",
        table,
        *(["", *[f"- {n}" for n in notes]] if notes else []),
    ])


# ---- 6. the gpu tests ---------------------------------------------------------------------------------


def part_tests(ctx: Ctx) -> str:
    if importlib.util.find_spec("pytest") is None:
        return "skipped: pytest is not installed on this machine; the gpu-marked tests did not run."
    files = [str(p.relative_to(ROOT)) for p in gpu_test_files(ROOT / "tests")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.args.tests_timeout, env=env, cwd=ROOT)
    secs = time.perf_counter() - t
    out = proc.stdout + proc.stderr
    summary = pytest_summary(out)
    lines = [f"`python -m pytest -q -m gpu {' '.join(files)}` ({secs:.0f} s, exit {proc.returncode}): "
             f"**{summary}**", "",
             "Only the files that hold `gpu`-marked tests are collected: the full `tests/` would import the serving "
             "extras (fastapi, httpx, ray), which a bare GPU machine lacks, and fail collection."]
    if ctx.smoke:
        lines.append("\nSmoke: no CUDA here, so every gpu test is skipped; this checks the command only.")
    if proc.returncode not in (0, 5):
        lines += ["", "```", out.strip()[-3000:], "```"]
        raise PartFailed("\n".join(lines))
    return "\n".join(lines)


# ---- 7. invariant numerics' cost (issue 31) ------------------------------------------------------------


def part_invariant(ctx: Ctx) -> str:
    """Decode step wall time of ``numerics="fast"`` vs ``"invariant"`` (the Triton GEMMs, max_tp 8 chunks) at
    batch 1 and 64: one in-process TP1 InferExecutor per mode, random bfloat16 weights of the checkpoint's
    shapes, decode graphs on, 512-token prompts prefilled, then decode steps of the two modes interleaved."""
    from pat_engine.config import graph_ladder
    from pat_engine.model.arch import load_model_arch
    from pat_engine.parallel.comm import TPGroup
    from pat_engine.parallel.layout import Layout
    from pat_engine.protocol import SeqStep, StepCommand
    from pat_engine.sampling.sampler import SamplingSpec
    from pat_engine.worker.graph_capture import GraphSettings
    from pat_engine.worker.infer_executor import InferExecutor

    arch = load_model_arch(str(ctx.checkpoint()))
    batches, prompt, steps = ((1, 2), 8, 6) if ctx.smoke else ((1, 64), 512, 24)
    block, greedy = 16, SamplingSpec(0.0, -1, 1.0, 0, False)
    per_seq = -(-(prompt + steps + 1) // block)
    modes = ("fast", "invariant")
    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    rows = []
    for batch in batches:
        exes, last, pos = {}, {}, prompt
        for mode in modes:
            ex = InferExecutor(arch, Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), ctx.dtype,
                               torch.device(ctx.device), block, batch * per_seq + 2, numerics=mode,
                               graphs=GraphSettings("standin" if ctx.smoke else "cuda", graph_ladder(batch),
                                                    per_seq * block))
            with torch.no_grad(), ex.writing_weights():  # the step's time does not depend on the values
                for p in ex.model.parameters():
                    p.data.normal_(0.0, 0.02)
            ex.capture_graphs()
            seqs = [SeqStep(i, [(7 * i + j) % 1000 + 10 for j in range(prompt)], 0,
                            block_table=[1 + i * per_seq + b for b in range(-(-prompt // block))], sampling=greedy)
                    for i in range(batch)]
            last[mode] = ex.execute(StepCommand(1, True, seqs)).tokens
            exes[mode] = ex
        times: dict[str, list[float]] = {m: [] for m in modes}
        for step in range(steps):
            new = [[1 + i * per_seq + pos // block] if pos % block == 0 else [] for i in range(batch)]
            for mode in modes if step % 2 == 0 else modes[::-1]:
                cmd = StepCommand(2 + step, False, [SeqStep(i, [last[mode][i]], pos, new_blocks=new[i])
                                                    for i in range(batch)])
                sync()
                t = time.perf_counter()
                last[mode] = exes[mode].execute(cmd).tokens
                sync()
                times[mode].append(time.perf_counter() - t)
            pos += 1
        fast, inv = (median(times[m][2:]) * 1e3 for m in modes)  # the first steps warm the graphs up
        rows.append([batch, fast, inv, f"{inv / fast - 1:+.1%}", batch / inv * 1e3])
        log(f"invariant cost, batch {batch}: fast {fast:.2f} ms, invariant {inv:.2f} ms")
        del exes
        free_device_memory()
    table = markdown_table(["batch", "fast ms / step", "invariant ms / step", "cost", "invariant tok/s"], rows)
    return "\n".join([
        f"TP1 decode steps in this process, {'a toy Llama on the CPU (stand-in graphs)' if ctx.smoke else 'Llama-3-8B shape'}"
        f", bfloat16, {prompt}-token prompts, greedy; the median of {steps - 2} steps per mode after 2 warm-up "
        "steps, the modes' steps interleaved. Invariant: every GEMM through the Triton kernel "
        "(pat_kernels/invariant_matmul.py, weights read in bfloat16), the row-parallel products in 8 chunks "
        "(max_tp 8), attention through the fixed-split decode kernel. Goal (issue 31): at most 10% slower.",
        "",
        table,
    ])


# ---- environment ------------------------------------------------------------------------------------


def environment(ctx: Ctx) -> str:
    def version(mod: str) -> str:
        try:
            if importlib.util.find_spec(mod) is None:
                return "missing"
        except ImportError:
            return "missing"
        try:
            return importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            return "present"

    probe = ("import sys, pat_engine; from pat_engine import Engine; "
             "print(sorted(m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'ray', 'httpx', 'starlette') "
             "if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    extras = res.stdout.strip() or f"probe failed: {res.stderr.strip()[-300:]}"
    mods = ", ".join(f"{m} {version(m)}" for m in ("triton", "transformers", "safetensors", "pytest"))
    return (f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {mods}; "
            f"device {ctx.gpu_name or 'cpu'}. Serving extras imported by `import pat_engine; from pat_engine "
            f"import Engine`: {extras}.")


# ---- driver -------------------------------------------------------------------------------------------


class PartFailed(Exception):
    """A part that ran but failed; its message is the section body."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", nargs="+", choices=PARTS, help="run these parts (default: all)")
    p.add_argument("--smoke", action="store_true", help="every part at toy sizes on the CPU; results to a temp file")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pat_gpu_check"),
                   help="the checkpoint (written once, reused) and scratch files")
    p.add_argument("--output", help="results file (default bench/results/gpu_check.md; --smoke: under --workdir)")
    p.add_argument("--rounds", type=int, help="decode: interleaved rounds (default 3; smoke 1)")
    p.add_argument("--new-tokens", type=int, help="decode: tokens per request (default 128; smoke 4)")
    p.add_argument("--repeats", type=int, default=50, help="split-KV: timed calls per kernel and shape")
    p.add_argument("--sync-gb", type=float, default=4.0, help="weightsync: GB the trainer broadcasts")
    p.add_argument("--sync-timeout", type=float, default=120.0, help="weightsync: seconds for each group step")
    p.add_argument("--profile-timeout", type=float, default=480.0)
    p.add_argument("--tests-timeout", type=float, default=480.0)
    return p.parse_args(argv)


def results_path(args: argparse.Namespace) -> Path:
    """Where the results go: --output, else bench/results/gpu_check.md; a smoke run never writes there."""
    default = RESULTS / "gpu_check.md"
    if args.smoke:
        path = Path(args.output) if args.output else Path(args.workdir) / "gpu_check_smoke.md"
        if path.resolve() == default.resolve():
            raise SystemExit("--smoke never writes bench/results/gpu_check.md (CPU numbers); choose another --output")
        return path
    return Path(args.output) if args.output else default


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported: split-KV runs in numpy
    elif not torch.cuda.is_available():
        print("no CUDA device visible: this script measures a GPU; on a CPU machine run it with --smoke",
              file=sys.stderr)
        return 2
    ctx = Ctx(args)
    out = results_path(args)
    sidecar = out.with_suffix(".json")
    sections: dict[str, Section] = {}
    if args.only and sidecar.is_file():  # keep the other parts' last results
        sections = {k: Section(**v) for k, v in json.loads(sidecar.read_text()).items() if k in PARTS}
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine_line = machine()
    env_line = environment(ctx)
    log(env_line)
    funcs = {"decode": part_decode, "graphs": part_graphs, "splitkv": part_splitkv, "profile": part_profile,
             "weightsync": part_weightsync, "tests": part_tests, "invariant": part_invariant}
    todo = [p for p in RUN_ORDER if not args.only or p in args.only]

    def write() -> None:
        text = render_report(sections, command, machine_line, date, args.smoke, env_line)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        sidecar.write_text(json.dumps({k: asdict(v) for k, v in sections.items()}, indent=1))

    try:
        for part in todo:
            if part not in ("decode", "weightsync"):
                ctx.close_engines()  # the in-process shards and the subprocesses need the memory
            log(f"part {part} ...")
            t = time.perf_counter()
            try:
                body, status = funcs[part](ctx), "ok"
            except PartFailed as exc:
                body, status = str(exc), "failed"
            except Exception as exc:
                tb = traceback.format_exc()
                body, status = f"FAILED: {type(exc).__name__}: {exc}\n\n```\n{tb[-4000:]}\n```", "failed"
            if body.startswith("skipped"):
                status = "skipped"
            secs = time.perf_counter() - t
            sections[part] = Section(part, TITLES[part], body, status, secs, command, date, machine_line)
            print(f"\n## {TITLES[part]} [{status}, {secs:.0f}s]\n\n{body}\n", flush=True)
            write()
    finally:
        ctx.close_engines()
    log(f"wrote {out}")
    return 0 if all(sections[p].status != "failed" for p in todo) else 1


if __name__ == "__main__":
    sys.exit(main())
