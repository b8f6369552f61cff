"""Where one decode step's time goes, on the worker and on the driver (CPU, TP1).

Worker side (in this process, one ``InferExecutor`` with the engine's own code): a prefill of
``batch`` prompts, then ``--new-tokens`` decode steps. Each step is timed without a profiler
(wall ms/step), then once more under ``torch.profiler`` with the model's pieces wrapped in
labels (GEMMs, RMSNorm, rotary, attention incl. KV write/read, input preparation, sampling);
"other" is the rest of the step (Python between the pieces, embedding, residual adds, SiLU-mul).
Profiled times include the profiler's own overhead; the shares are what to read.
The engine's workers run with OMP_WAIT_POLICY=PASSIVE (EngineConfig.worker_env); this process uses
whatever policy its environment sets, and the results file records it.

Driver side (a real ``Engine``, one worker process): per decode step, the round trip
(dispatch to result) minus the worker's own time is pickling + the socket + wake-ups, and the
gap between one result and the next dispatch is the driver's scheduling and bookkeeping.

    PYTHONPATH=.:profiler:integrations:csrc python bench/step_breakdown.py --label after

``--rollout``: whole RL rollouts instead (bench/peer_rollout.py's ragged, long-tailed, n-sample
workloads on its two model shapes), each split into prefill, decode forward, LM head + sampling,
the worker round trip and the driver, with the tail's steps counted apart.
"""

from __future__ import annotations

import os

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC as SPEC, markdown_table, write_result  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.model import llama  # noqa: E402
from pat_engine.model.arch import load_model_arch  # noqa: E402
from pat_engine.model.layers.embedding import ParallelLMHead  # noqa: E402
from pat_engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from pat_engine.model.layers.norm import RMSNorm  # noqa: E402
from pat_engine.parallel.comm import TPGroup  # noqa: E402
from pat_engine.parallel.layout import Layout  # noqa: E402
from pat_engine.protocol import SeqStep, StepCommand  # noqa: E402
from pat_engine.sampling.spec import SamplingSpec  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402
from pat_engine.worker.infer_executor import InferExecutor  # noqa: E402

BLOCK = 16
PIECES = ["prepare", "gemm", "norm", "rotary", "attention", "sample"]  # labels, in table order


def _labelled(label: str, fn):
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def labelled_pieces():
    """Wrap the model's pieces in profiler labels (restored afterwards)."""
    patches = [(ColumnParallelLinear, "forward"), (RowParallelLinear, "forward"), (ParallelLMHead, "forward"),
               (RMSNorm, "forward"), (RMSNorm, "add_forward"), (llama, "apply_rotary"), (llama, "paged_attention")]
    labels = ["gemm", "gemm", "gemm", "norm", "norm", "rotary", "attention"]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    try:
        for (obj, name), label in zip(patches, labels):
            setattr(obj, name, _labelled(label, getattr(obj, name)))
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


class Rollout:
    """Drives one InferExecutor the way the scheduler does: a prefill, then one token per step."""

    def __init__(self, path: str, batch: int, prompt_len: int, new_tokens: int, sampled: bool,
                 dtype: torch.dtype = torch.float32, layout: Layout = Layout(1, 1), numerics: str = "fast"):
        """``layout``: a TP1 layout whose world sets the invariant mode's chunk count (bench/invariance.py)."""
        arch = load_model_arch(path)
        blocks_per_seq = -(-(prompt_len + new_tokens + 1) // BLOCK)
        self.ex = InferExecutor(arch, layout, TPGroup(rank=0, size=1, ranks=(0,)), dtype, torch.device("cpu"), BLOCK,
                                batch * blocks_per_seq + 1, numerics=numerics)
        self.ex.load_weights(path)
        self.batch, self.prompt_len, self.blocks_per_seq = batch, prompt_len, blocks_per_seq
        g = torch.Generator().manual_seed(batch)
        self.prompts = torch.randint(10, SPEC.vocab_size - 10, (batch, prompt_len), generator=g).tolist()
        self.spec = (SamplingSpec(1.0, 50, 0.95, 0, False) if sampled else SamplingSpec(0.0, -1, 1.0, 0, False))
        self.step_id = 0

    def prefill(self) -> list[int]:
        self.tables = [[1 + i * self.blocks_per_seq + j for j in range(-(-self.prompt_len // BLOCK))]
                       for i in range(self.batch)]
        seqs = [SeqStep(i, list(p), 0, block_table=list(self.tables[i]),
                        sampling=SamplingSpec(self.spec.temperature, self.spec.top_k, self.spec.top_p, i, False))
                for i, p in enumerate(self.prompts)]
        self.pos = self.prompt_len
        self.last = self.ex.execute(StepCommand(self._next_id(), True, seqs)).tokens
        return self.last

    def decode(self) -> list[int]:
        seqs = []
        for i in range(self.batch):
            new = []
            if self.pos // BLOCK >= len(self.tables[i]):
                new = [1 + i * self.blocks_per_seq + len(self.tables[i])]
                self.tables[i].extend(new)
            seqs.append(SeqStep(i, [self.last[i]], self.pos, new_blocks=new))
        self.last = self.ex.execute(StepCommand(self._next_id(), False, seqs)).tokens
        self.pos += 1
        return self.last

    def _next_id(self) -> int:
        self.step_id += 1
        return self.step_id


def worker_row(path: str, batch: int, args, sampled: bool) -> dict:
    run = Rollout(path, batch, args.prompt_len, args.new_tokens, sampled)
    run.prefill()
    walls = []
    for _ in range(args.new_tokens // 2):
        t = time.perf_counter()
        run.decode()
        walls.append(time.perf_counter() - t)
    with labelled_pieces(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        steps = args.new_tokens // 2 - 1
        for _ in range(steps):
            with record_function("step"):
                run.decode()
        profiled = (time.perf_counter() - t) / steps
    totals = {e.key: e.cpu_time_total / 1000 / steps for e in prof.key_averages() if e.key in PIECES + ["step"]}
    row = {p: totals.get(p, 0.0) for p in PIECES}
    row["other"] = totals["step"] - sum(row.values())
    row["profiled"] = totals["step"]
    row["wall"] = statistics.median(walls) * 1000
    row["profiled_wall"] = profiled * 1000
    return row


def driver_row(path: str, batch: int, args) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(10, SPEC.vocab_size - 10, (batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    with Engine(path, tp=1, dp=1, dtype="float32", threads_per_worker=args.threads,
                kv_cache_bytes=args.kv_cache_bytes) as engine:
        engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), use_tqdm=False)
        with engine.record_steps() as log:
            t = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
    decode = [r for r in log if not r.is_prefill]
    gaps = [b.t - a.t - b.seconds for a, b in zip(decode, decode[1:])]
    return {
        "round trip": statistics.median(r.seconds for r in decode) * 1000,
        "worker": statistics.median(r.forward_seconds for r in decode) * 1000,
        "ipc": statistics.median(r.seconds - r.forward_seconds for r in decode) * 1000,
        "gap": statistics.median(gaps) * 1000,
        "tok/s": batch * args.new_tokens / elapsed,
        "steps": f"{sum(r.is_prefill for r in log)} + {len(decode)}",
    }


TAIL_BATCH = 8  # a decode step with at most this many rows is "tail"


def rollout_row(engine: Engine, w) -> dict:
    """One whole RL rollout (peer_rollout's workloads) on a real engine, split by where its wall time went."""
    params = [SamplingParams(max_new_tokens=m, min_new_tokens=m, n=w.n, temperature=w.temperature, top_p=w.top_p,
                             seed=1000 + i, logprobs=w.n > 1) for i, m in enumerate(w.max_tokens)]
    with engine.record_steps() as log:
        t = time.perf_counter()
        engine.generate(w.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    prefill = [r for r in log if r.is_prefill]
    decode = [r for r in log if not r.is_prefill]
    tail = [r for r in decode if r.batch_size <= TAIL_BATCH]
    return {
        "wall": wall,
        "prefill": sum(r.seconds for r in prefill),
        "decode forward": sum(r.forward_seconds - r.head_seconds - r.sample_seconds for r in decode),
        "LM head": sum(r.head_seconds for r in decode),
        "sampling": sum(r.sample_seconds for r in decode),
        "ipc": sum(r.seconds - r.forward_seconds for r in decode),
        "driver": wall - sum(r.seconds for r in log),
        "steps": f"{len(prefill)} + {len(decode)}",
        "tail": f"{len(tail)} steps, {sum(r.seconds for r in tail):.2f} s, "
                f"{1000 * statistics.median([r.seconds for r in tail] or [0]):.1f} ms/step",
    }


ROLLOUT_PARTS = ["prefill", "decode forward", "LM head", "sampling", "ipc", "driver"]


def rollout_tables(args) -> str:
    """The RL rollout split for both peer_rollout shapes: where the seconds of each workload go."""
    from peer_rollout import MAX_LEN, SHAPES, model_path, workloads

    rows = []
    for shape in SHAPES:
        path = model_path(shape)
        loads = workloads(SHAPES[shape].vocab_size, seed=7)
        with Engine(path, tp=1, dtype=args.dtype, max_model_len=MAX_LEN, threads_per_worker=args.threads) as engine:
            warm = type(loads[0])("warm-up", loads[0].prompts[:4], [8] * 4)
            rollout_row(engine, warm)
            for w in loads:
                r = rollout_row(engine, w)
                rows.append([args.label, shape, w.name, f"{r['wall']:.2f}"]
                            + [f"{r[p]:.2f} ({100 * r[p] / r['wall']:.0f}%)" for p in ROLLOUT_PARTS]
                            + [r["steps"], r["tail"]])
                print(rows[-1], flush=True)
    return (f"## Whole RL rollouts (bench/peer_rollout.py's workloads), seconds and share of the wall time\n\n"
            f"One engine, TP1, {args.dtype}, {args.threads} threads. *prefill*: prefill steps, dispatch to result; "
            "*decode forward*: the worker's decode steps without the LM head and sampling; *LM head*: "
            "the logits of the decode steps; *sampling*: log-probs and the draw; *ipc*: pickling + socket + wake-ups of decode steps; *driver*: "
            "wall time with no step in flight (scheduling, bookkeeping, detokenising, outputs); *tail*: decode "
            f"steps of at most {TAIL_BATCH} rows.\n\n"
            + markdown_table(["run", "model", "workload", "wall s"] + ROLLOUT_PARTS + ["steps", "tail"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="the driver rows' engine KV bytes (default: the engine's own; 67108864 was the old CPU default)")
    ap.add_argument("--driver-only", action="store_true", help="skip the in-process worker rows")
    ap.add_argument("--rollout", action="store_true",
                    help="split whole RL rollouts (peer_rollout's workloads) instead of single decode steps; "
                         "writes bench/results/step_breakdown_rollout_<label>.md")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--rollout: the engine's dtype (the in-process rows run float32)")
    ap.add_argument("--label", default="current", help="names this run in the results file (e.g. before/after)")
    ap.add_argument("--compare-with", help="an earlier run's results file (e.g. of the code before a change): "
                    "its tables are included and the result is written to bench/results/step_breakdown.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.rollout:
        write_result(f"step_breakdown_rollout_{args.label}", f"RL rollout breakdown ({args.label})",
                     f"Load average before: {open('/proc/loadavg').read().split()[0]}.\n\n" + rollout_tables(args))
        return
    worker_rows, driver_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(tmp, SPEC))
        for batch in args.batch_sizes:
            for sampled in (False, True) if not args.driver_only else ():
                r = worker_row(path, batch, args, sampled)
                worker_rows.append([args.label, batch, "t=1 top-k 50 top-p .95" if sampled else "greedy",
                                    round(r["wall"], 2), round(r["profiled"], 2)]
                                   + [f"{r[p]:.2f} ({100 * r[p] / r['profiled']:.0f}%)" for p in PIECES + ["other"]])
            d = driver_row(path, batch, args)
            driver_rows.append([args.label, batch, round(d["tok/s"], 1), round(1000 * batch / d["tok/s"], 2),
                                round(d["round trip"], 2), round(d["worker"], 2), round(d["ipc"], 2), round(d["gap"], 2),
                                d["steps"]])
    body = (
        f"Checkpoint: Llama, {SPEC.num_layers} layers, hidden {SPEC.hidden_size}, {SPEC.num_heads} heads / "
        f"{SPEC.num_kv_heads} KV heads, intermediate {SPEC.intermediate_size}, vocab {SPEC.vocab_size}, float32; "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.threads} torch threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset (OpenMP default)')}, load average before: {open('/proc/loadavg').read().split()[0]}.\n\n"
        "## Worker: one decode step (ms), in process\n\n"
        "*wall*: median step without the profiler; the other columns are under torch.profiler (its overhead "
        "included), with each piece's share of the profiled step.\n\n"
        + markdown_table(["run", "batch", "sampling", "wall ms", "profiled ms"] + PIECES + ["other"], worker_rows)
        + "\n\n## Driver: one decode step (ms), real engine with one worker process, greedy\n\n"
        "*round trip*: dispatch to result on the driver; *worker*: the worker's own time for the step; "
        "*pickle+socket*: their difference; *driver gap*: from one result to the next dispatch; "
        "*steps*: prefill + decode steps of the timed call (a batch the KV pool cannot hold at once takes more).\n\n"
        + markdown_table(["run", "batch", "tok/s", "ms/step (wall)", "round trip", "worker", "pickle+socket",
                          "driver gap", "steps"], driver_rows)
    )
    if args.compare_with:
        earlier = Path(args.compare_with).read_text()
        body = f"# Run: {args.label}\n\n{body}\n\n# Earlier run, for comparison ({args.compare_with})\n\n" + earlier
        write_result("step_breakdown", "Decode step breakdown, before and after", body)
    else:
        write_result(f"step_breakdown_{args.label}", f"Decode step breakdown ({args.label})", body)


if __name__ == "__main__":
    main()
