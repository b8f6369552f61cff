"""One decode step's wall time with OpenMP threads that sleep (PASSIVE) or spin (the OpenMP default),
new code, 2 torch threads, batch 1/16/64, run alternately in fresh processes (the policy is read at start).

    PYTHONPATH=. python bench/omp_wait_policy_ab.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child() -> None:
    import torch

    from peer_cpu import model_path
    from step_breakdown import Rollout

    torch.set_num_threads(2)
    out = []
    for b in (1, 16, 64):
        r = Rollout(model_path(), b, 32, 40, False)
        r.prefill()
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            r.decode()
            ts.append(time.perf_counter() - t)
        out.append(round(1000 * statistics.median(ts), 1))
    print(*out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child()
    from common import markdown_table, write_result

    rows = []
    for _ in range(args.rounds):
        for policy in ("PASSIVE", None):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            load = os.getloadavg()[0]
            ms = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                check=True).stdout.split()
            rows.append([policy or "unset (spin, then sleep)", *ms, round(load, 2)])
    body = ("Decode step ms (median of 30), in process, 2 threads, the peer_cpu checkpoint.\n\n"
            + markdown_table(["OMP_WAIT_POLICY", "batch 1", "batch 16", "batch 64", "1-min load before"], rows))
    write_result("omp_wait_policy_ab", "OpenMP wait policy: sleeping vs spinning threads", body)


if __name__ == "__main__":
    main()
