"""One command for a one-GPU machine: measure the engine against its targets and run the ``gpu`` tests
(issues 23 and 30). The parts live in ``bench/gpucheck/`` (one file each, listed in ``registry.py``).

    python bench/gpu_check.py --quick                 # every headline row (146 s on the second H100 run) + the QUICK test selections
    python bench/gpu_check.py --only controller graphs weightsync tests invariant   # the rest, ~10 min
    python bench/gpu_check.py                         # every part (> 10 min: split it under the device tool)
    python bench/gpu_check.py --smoke [--quick]       # toy sizes on the CPU, into a temp file (never the results)

On a lent machine (``run`` tool), write where the files come back, then copy them into bench/results/:

    python bench/gpu_check.py --quick --output "$OUT/gpu_check.md"     # timeout_s=600 leaves room to spare

A session's 15 device minutes (start-up included) hold two such calls (the fourth H100 run took 686 s for
three). What is still unmeasured first: the CUDA defaults set since the fourth run (async scheduling, the
Triton sampler and its greedy first maximum, the LM head through the skinny GEMM) in the decode rows and
under the gpu tests, a batch-1 step's attention at short contexts with and without the fused reduce, the
skinny GEMMs with their tuned configs and with the norms and SiLU-mul in their prologues (the attention
part's latency table, the kernels part's variants, and the decode part's batch-1 row on an engine built
with all three, for the 6.0 ms goal), programmatic dependent launch (``PAT_PDL``: the kernels part's two
PDL variants), then the controller with them (its table now splits the predictor's
error into bias and the steps' own noise, and keeps every step; two passes over its grid) and the switch
with its weights and KV passed by CUDA IPC handle (the fourth run's host-staged moves took 3.6 of a 4.0 s
switch; the part times both paths' GB/s, interleaved) and a TP2 group's collectives through each other's
device memory (the fourth run's host-staged ones took 0.6 ms an all-reduce, 20 ms of a 44 ms TP2 step; the
part times both paths, interleaved). Timeouts of about 460 and 420 s; the machine stays warm between
back-to-back calls:

    python bench/gpu_check.py --quick --only attention sampler kernels decode tests --budget-s 380 --output "$OUT/gpu_check.md"
    python bench/gpu_check.py --only controller switch collectives --quick --budget-s 330 --output "$OUT/gpu_check.md"

(The first command's co-located gpu tests switch by handle and reduce through the IPC slots; should one
fail there, run the second with ``PAT_SWITCH_P2P=host`` or ``PAT_COLOCATED_COLLECTIVES=host`` (whichever
path failed: the fourth run's), and say so.)

Parts (``--only`` names; each a section of ``bench/results/gpu_check.md`` with its command, machine, date
and environment, headlines with each target's verdict at the top). Each part's expected seconds on an
H100 are in ``registry.py``; the parts table prints them beside what they took, so a run can correct them:

| part | measures |
|---|---|
| attention | decode attention GB/s vs SDPA at 6 shapes, the split sweep; batch-1 latency at 64-2K tokens (the rule as graphs run it, each split with the reduce kernel and fused); fused layer kernels vs torch |
| gemm | decode GEMMs at 1, 8, 64 rows: cuBLAS vs the skinny Triton GEMM (its rule, the engine's tuned config and a config sweep), a step's GEMM ms; `bench/skinny_tune.py` files its bests as the tuned table |
| sampler | the RL draw (temperature 1, log-probs; top_p 0.9) at 1 and 64 rows: the torch twin vs the Triton kernels (weights, Z, draw, nucleus); greedy beside |
| (checkpoint) | the 16 GB random checkpoint, written once per ``--workdir``, before the parts using it |
| kernels | kernels per step and per layer, GPU ms by piece, batch 1 and 64, graphs vs eager, the step as built vs cuBLAS everywhere, the skinny GEMM everywhere (tuned configs), with the GEMM prologues (batch 1), the fused attention reduce, all three, and PDL with the defaults and with all three (sm_90); a graphs step's host phases beside its GPU busy time |
| prefill | 64 x 512 and 8 x 4K prefill: tokens/s, model FLOP/s vs an 8192^3 bf16 GEMM |
| decode | Engine decode ms / token vs roofline and floor: batch 1/16/64, 64 x 512, 64 x 2K, async off/on; 64 x 512 sampled (RL); batch 1 on an engine built with the candidate settings (skinny GEMMs, prologues, fused reduce, PDL; its failure costs its rows only) |
| profile | pat-profile --emulate-world 8, graphs on, median step; predictor error at TP1 |
| controller | the controller on a co-located long-tail rollout (the switch part's 1B shape, 2 ranks), driven by a pat-profile table measured on those ranks: the predictor's step error (goal <= 5%) with its bias and the steps' own noise, its choices against its table |
| switch | the live switch with 2 (full: and 4) ranks sharing the GPU, 1B shape: each phase in s and bytes, the graphs share, point-to-point GB/s by handle (CUDA IPC, the switch's path) and staged through the host, CUDA memory, full: four ranks, capture warm-ups |
| collectives | each collective of a co-located TP2 decode step (1B shape, batch 1/8/32) through the IPC slots and staged through the host, interleaved; a host-staged all-reduce piece by piece |
| graphs | CUDA graph capture per ladder size, recapture after an emulated switch |
| weightsync | update_weights GB/s, update_weights_from_distributed (gloo; NCCL attempted) |
| tests | ``pytest -m gpu`` over the files holding gpu tests |
| invariant | decode ms per step, numerics fast vs invariant, batch 1 and 64 (issue 31) |

``--quick`` (146 s on the second H100 run before the tests selections joined it, the checkpoint written in
17 s of it; with them and the parts added since, about 8 minutes planned from the registry): one engine in
``decode`` (graphs on; no eager engine: the kernels part times eager against graph steps in process at
batch 1 and 64), one round of 64 (batch 1) or 32 (long prompts) tokens; ``attention`` with 20 calls per
case and splits up to 64; ``prefill`` with 2 runs per row; ``profile`` on TP 1/2/4/8 x batch 1/64 x
contexts 512 and 2048, 8 steps a point; ``switch`` with one measured batch (migrate) after its warm-up;
``tests`` with the selections of ``gpu_tests.QUICK``. It skips ``graphs``, ``weightsync`` and ``invariant`` (their figures are not
headlines; run them as the second command above). ``--budget-s`` (default 540 with ``--quick``) caps
each part's timeout by what is left of it and skips a part when less is left than the registry expects
it to take, so the command ends inside the device tool's 10 minutes.

Robustness: each part runs in its own process (a CUDA error that poisons a context, an out-of-memory
or a hang costs that part only), under a timeout that ends its process group; its section is then
"failed" with the end of its log, and the next part runs. The results file is rewritten after every
part, so a cut-off run keeps what it finished. ``--in-process`` runs the parts in this process instead.

Needs: one CUDA GPU with about 60 GB free (an H100 80GB or an H200), torch with CUDA, Triton,
safetensors, numpy, tqdm, and about 17 GB free under ``--workdir`` for the checkpoint (written once,
layer by layer, and reused). pytest for ``tests`` only. Not needed: network, the serving extras,
``pip install`` of this repository (the source folders go on ``sys.path`` here), a tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "bench", ROOT / "integrations", ROOT / "profiler", ROOT / "csrc", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from gpucheck.registry import CHECKPOINT_S, CHECKPOINT_TIMEOUT_S, NAMES, PARTS, Part, part  # noqa: E402
from gpucheck.report import (RESULTS, PartResult, Section, load_sections, render_report,  # noqa: E402, F401
                             results_path, save_sections)

QUICK_BUDGET_S = 540  # the device tool ends a command at 600 s
MIN_START_S = 30  # no part starts with less of the budget left
CHECKPOINT = "checkpoint"  # the step before the parts that writes (or finds) the checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", nargs="+", choices=NAMES, help="run these parts (default: all; --quick: its own)")
    p.add_argument("--smoke", action="store_true", help="every part at toy sizes on the CPU; results to a temp file")
    p.add_argument("--quick", action="store_true", help="the headline rows and two gpu test selections (~5 min)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pat_gpu_check"),
                   help="the checkpoint (written once, reused), the parts' logs and scratch files")
    p.add_argument("--output", help="results file (default bench/results/gpu_check.md; --smoke: under --workdir)")
    p.add_argument("--budget-s", type=float, help=f"start no part past this many seconds (--quick: {QUICK_BUDGET_S})")
    p.add_argument("--in-process", action="store_true", help="run the parts in this process (no isolation)")
    p.add_argument("--rounds", type=int, help="decode: interleaved rounds (default 3; --quick and smoke 1)")
    p.add_argument("--new-tokens", type=int, help="decode: tokens per request (default: per row)")
    p.add_argument("--repeats", type=int, default=50, help="attention: timed calls per case (--quick: 20)")
    p.add_argument("--sync-gb", type=float, default=4.0, help="weightsync: GB the trainer broadcasts")
    p.add_argument("--sync-timeout", type=float, default=120.0, help="weightsync: seconds for each group step")
    p.add_argument("--profile-timeout", type=float, default=420.0, help="profile: seconds for pat-profile")
    p.add_argument("--tests-timeout", type=float, default=420.0, help="tests: seconds for pytest")
    p.add_argument("--child", choices=(*NAMES, CHECKPOINT), help=argparse.SUPPRESS)  # one step, for the driver
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def selected(args: argparse.Namespace) -> list[Part]:
    """The parts this command runs, in the registry's order."""
    if args.only:
        return [p for p in PARTS if p.name in args.only]
    return [p for p in PARTS if not args.quick or p.quick_s is not None]


# ---- one part ---------------------------------------------------------------------------------------------


def execute(name: str, args: argparse.Namespace) -> dict:
    """Run part ``name`` (or the checkpoint step) here: {status, body, headlines, data}. A raise is a failed
    part, not a failed command."""
    from gpucheck.shared import Ctx, PartFailed

    ctx = Ctx(args, load_sections(results_path(args.output, args.smoke, args.workdir)))
    try:
        if name == CHECKPOINT:
            t = time.perf_counter()
            path = ctx.checkpoint()
            return {"status": "ok", "body": f"`{path}`, ready in {time.perf_counter() - t:.0f} s", "headlines": [],
                    "data": {}}
        res: PartResult = part(name).runner()(ctx)
        status = "skipped" if res.body.startswith("skipped") else "ok"
        return {"status": status, "body": res.body, "headlines": res.headlines, "data": res.data}
    except PartFailed as exc:
        return {"status": "failed", "body": str(exc), "headlines": [f"FAILED: {str(exc).splitlines()[0][:200]}"],
                "data": {}}
    except Exception as exc:
        tb = traceback.format_exc()
        return {"status": "failed", "body": f"FAILED: {type(exc).__name__}: {exc}\n\n```\n{tb[-4000:]}\n```",
                "headlines": [f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"],
                "data": {}}


def in_child(name: str, argv: list[str], args: argparse.Namespace, timeout: float) -> dict:
    """Run part ``name`` in its own process group; on a timeout the group ends (engine workers, pat-profile)."""
    logs = Path(args.workdir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out, log_path = logs / f"{name}.json", logs / f"{name}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name, "--child-out", str(out)]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            why = None if out.is_file() else f"its process exited {proc.returncode} without a result"
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:.0f} s (its process group was ended)"
        _end_group(proc)  # and whatever it left behind (engine workers hold device memory)
    tail = log_path.read_text(errors="replace")[-3000:]
    print(tail, flush=True)
    if why is None:
        return json.loads(out.read_text())
    return {"status": "failed", "headlines": [f"FAILED: {why}"], "data": {},
            "body": f"FAILED: {why}. The end of its log ({log_path}):\n\n```\n{tail}\n```"}


def _end_group(proc: subprocess.Popen, term_wait: float = 15.0, kill_wait: float = 5.0) -> None:
    """End every process of the child's group, not its leader alone (engine workers and pat-profile outlive
    it and hold device memory the next part would size itself from): politely, then for good."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # the group is empty
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)  # reap the leader: a zombie still counts as a member
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


# ---- the run ----------------------------------------------------------------------------------------------


def describe_machine(smoke: bool) -> dict:
    """{machine, environment, gpu} from a fresh process (this one never imports torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-m", "gpucheck.environment"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"machine": "unknown", "environment": f"probe failed: {res.stderr.strip()[-300:]}",
                "gpu": None if smoke else "unknown"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported (children inherit it)
    if args.child:
        result = execute(args.child, args)
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    out = results_path(args.output, args.smoke, args.workdir)
    info = describe_machine(args.smoke)
    _log(info["environment"])
    if not args.smoke and not info["gpu"]:
        print("no CUDA device visible: this script measures a GPU; on a CPU machine run it with --smoke",
              file=sys.stderr)
        return 2
    sections = load_sections(out) if args.only else {}  # --only keeps the other parts' last results
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + argv)
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    budget = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else None)
    started = time.perf_counter()

    def step(name: str, timeout: float, expected: float) -> tuple[dict, float]:
        """One step in its own process (or here), under what is left of the budget; skipped when less is left
        than it is expected to take (a part cut off part-way keeps nothing)."""
        left = None if budget is None else budget - (time.perf_counter() - started)
        t = time.perf_counter()
        if left is not None and left < max(MIN_START_S, expected):
            return {"status": "skipped", "headlines": [], "data": {},
                    "body": f"skipped: {left:.0f} s of the run's time budget (--budget-s {budget:.0f}) were left, "
                            f"the part is expected to take {expected:.0f} s"}, 0.0
        timeout = timeout if left is None else min(timeout, left)
        _log(f"{name} (timeout {timeout:.0f} s) ...")
        res = execute(name, args) if args.in_process else in_child(name, argv, args, timeout)
        return res, time.perf_counter() - t

    todo = selected(args)
    notes = []
    if any(p.needs_checkpoint for p in todo):  # its own step, so a slow disk shows here and not in a part
        res, secs = step(CHECKPOINT, CHECKPOINT_TIMEOUT_S, CHECKPOINT_S)
        notes.append(f"checkpoint: {res['body'].splitlines()[0]} ({res['status']}, {secs:.0f} s of this command; "
                     f"expected ~{CHECKPOINT_S} s to write, ~0 reused)")
    for p in todo:
        expected = p.quick_s if args.quick and p.quick_s is not None else p.full_s
        res, secs = step(p.name, p.quick_timeout_s if args.quick else p.full_timeout_s, expected)
        sections[p.name] = Section(p.name, p.title, res["body"], res["status"], secs, command, date, info["machine"],
                                   res["headlines"], res["data"])
        print(f"\n## {p.title} [{res['status']}, {secs:.0f}s]\n\n{res['body']}\n", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_report(sections, command, info["machine"], date, smoke=args.smoke, quick=args.quick,
                                     environment=info["environment"], notes=notes))
        save_sections(out, sections)
    _log(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    return 0 if all(sections[p.name].status != "failed" for p in todo) else 1


def _log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
