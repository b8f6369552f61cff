"""Engine start, shutdown and recovery with CPU workers started fresh or forked from a warm fork server.

A fresh worker (``worker_launch="fresh"``) is a new interpreter that imports torch and the worker's modules
before it joins the world; a forked one (``"auto"``, the CPU default) is a fork of a fork server that did
those imports once (core/worker_launch.py). For TP1 x DP1, TP2 x DP1 and TP2 x DP2 engines of the CPU
benchmarks' checkpoint (bench/common.py ``PEER_SPEC``, float32), each round times in both modes, one after
the other (the order swapped every round): the start (``Engine(...)`` until it can serve), a 4-token
greedy generation, the recovery after one worker is killed (SIGKILL to the next generation's end: the
death noticed, the world restarted, the request recomputed) and the shutdown. The fork server of each
environment is started before the rounds, after one fresh engine has paid the driver's own first-use costs
(its one-off start, timed once, is in its own column); the tokens of both modes are compared.

    PYTHONPATH=.:csrc python bench/engine_start.py
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC, markdown_table, write_result  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402
from pat_engine.core import worker_launch  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402

LAYOUTS = ((1, 1), (2, 1), (2, 2))
PROMPT = [5, 6, 7, 8]
PARAMS = SamplingParams(max_new_tokens=4)


def memory_mb(pid: int) -> tuple[float, float]:
    """A process's resident and proportional set (MB; proportional: shared pages split among their users)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("Rss", "Pss"))


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def one_run(path: str, tp: int, dp: int, mode: str) -> dict:
    t0 = time.perf_counter()
    engine = Engine(path, tp=tp, dp=dp, dtype="float32", worker_launch=mode)
    t1 = time.perf_counter()
    tokens = engine.generate([PROMPT], PARAMS, use_tqdm=False)[0].token_ids
    t2 = time.perf_counter()
    workers = [memory_mb(pid) for pid in engine.worker_pids()]
    parents = {parent_of(pid) for pid in engine.worker_pids()} - {os.getpid()}  # the fork server, if any
    server_rss = sum(memory_mb(pid)[0] for pid in parents)
    os.kill(engine.worker_pids()[-1], signal.SIGKILL)
    again = engine.generate([PROMPT], PARAMS, use_tqdm=False)[0].token_ids
    t3 = time.perf_counter()
    engine.shutdown()
    t4 = time.perf_counter()
    return {"start": t1 - t0, "generate": t2 - t1, "recover": t3 - t2, "shutdown": t4 - t3,
            "tokens": (tokens, again), "worker_rss": statistics.mean(r for r, _ in workers),
            "worker_pss": statistics.mean(p for _, p in workers), "server_rss": server_rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-dir", default="/tmp/pat_bench_engine_start")
    args = parser.parse_args()
    path = str(write_tiny_model(Path(args.model_dir), PEER_SPEC))
    Engine(path, tp=1, dp=1, dtype="float32", worker_launch="fresh").shutdown()  # the driver's own first-use costs
    server_start = {}
    for tp, dp in LAYOUTS:  # the fork server of each environment (world sizes may differ in OpenMP policy)
        servers, t = len(worker_launch._servers), time.perf_counter()
        Engine(path, tp=tp, dp=dp, dtype="float32", worker_launch="auto").shutdown()
        seconds = time.perf_counter() - t
        server_start[(tp, dp)] = seconds if len(worker_launch._servers) > servers else "(its server was warm)"
    runs: dict[tuple, list[dict]] = {}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for tp, dp in LAYOUTS:
            for mode in (("fresh", "auto") if r % 2 == 0 else ("auto", "fresh")):
                runs.setdefault((tp, dp, mode), []).append(one_run(path, tp, dp, mode))
    rows = []
    for tp, dp in LAYOUTS:
        fresh, fork = runs[(tp, dp, "fresh")], runs[(tp, dp, "auto")]
        same = all(a["tokens"] == b["tokens"] == fresh[0]["tokens"] for a, b in zip(fresh, fork))

        def med(rs: list[dict], key: str) -> float:
            return statistics.median(x[key] for x in rs)

        speed_up = med(fresh, "start") / med(fork, "start")
        rows.append([f"TP{tp} x DP{dp}", med(fresh, "start"), med(fork, "start"), speed_up,
                     med(fresh, "recover"), med(fork, "recover"), med(fresh, "shutdown"), med(fork, "shutdown"),
                     server_start[(tp, dp)], f"{med(fresh, 'worker_rss'):.0f} / {med(fresh, 'worker_pss'):.0f}",
                     f"{med(fork, 'worker_rss'):.0f} / {med(fork, 'worker_pss'):.0f}", f"{med(fork, 'server_rss'):.0f}",
                     "yes" if same else "NO"])
    body = (f"Checkpoint: bench/common.py PEER_SPEC (Llama, 4 layers, hidden 512), float32; median of {args.rounds} "
            f"rounds, the two modes interleaved (order swapped every round); load average at the start: {load:.2f}.\n"
            "*start*: `Engine(...)` until it serves; *recover*: from a SIGKILL of the last rank to the end of the "
            "next 4-token generation (the death noticed, the world restarted, the request recomputed); *first "
            "start with a cold server*: the engine that started its environment's fork server (timed once, "
            "before the rounds; TP1 x DP1 and TP2 x DP1 share one environment, TP2 x DP2 (4 ranks on 2 cores: "
            "OpenMP's passive wait policy) has its own). "
            "*worker MB*: a worker's resident / proportional set after the first generation (proportional: "
            "pages shared with other processes, the fork server's among them, split among their users), mean "
            "over the ranks; *server MB*: the fork server's resident set (its imports; the workers share them). "
            "*same tokens*: every generation of both modes, before and after the recovery, gave the same "
            "tokens.\n\n")
    body += markdown_table(["layout", "fresh start s", "fork start s", "start speed-up", "fresh recover s",
                            "fork recover s", "fresh shutdown s", "fork shutdown s",
                            "first start with a cold server s", "fresh worker MB", "forked worker MB", "server MB",
                            "same tokens"], rows)
    write_result("engine_start", "Engine start, shutdown and recovery: fresh worker processes vs a fork server", body)


if __name__ == "__main__":
    main()
