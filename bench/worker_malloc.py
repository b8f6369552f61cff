"""The CPU workers' glibc allocator settings on RL rollouts: how large buffers are mapped, and whether freed
heap memory stays in the process.

glibc serves an allocation above its mmap threshold (dynamic up to 32 MiB) with a fresh mapping and unmaps it
on free, and gives the heap's free top back to the OS beyond its trim threshold (twice the mmap threshold),
so a step's buffers that a step before it freed may be faulted in again, and on this VM a fault of fresh
memory sometimes costs far more than zeroing the page. Settings (``GLIBC_TUNABLES``, which the workers read
when they start; EngineConfig.worker_env sets the engine's default where the environment sets none):

- ``4k``: glibc's defaults;
- ``huge``: ``hugetlb=1``, transparent huge pages for the mappings and the heap (the engine's default);
- ``kept``: ``huge`` with the mmap threshold fixed at 32 MiB and a 1 GiB trim threshold: buffers up to 32 MiB
  come back from the heap, which keeps what it had (a release, as a sleep makes, hands it back:
  ``device_memory.release_cached``);
- ``kept-4k``: ``kept`` without huge pages.

Each engine (TP1, float32) warms up, then times ``--repeats`` rollouts; engines alternate setting by setting.

    python bench/worker_malloc.py [--rounds 2] [--repeats 3] [--settings huge kept]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from rollout_ab import ab_args, ab_cases, alternating, median_seconds  # noqa: E402

KEPT = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
SETTINGS = {"4k": "glibc.malloc.hugetlb=0", "huge": "glibc.malloc.hugetlb=1",
            "kept": f"glibc.malloc.hugetlb=1:{KEPT}", "kept-4k": KEPT}
BASELINE = "huge"


def main() -> None:
    args = ab_args(__doc__.split("\n\n")[0], repeats=3, settings=(list(SETTINGS), ["huge", "kept", "kept-4k"]))
    names = list(dict.fromkeys([BASELINE, *args.settings]))
    settings = {name: {"GLIBC_TUNABLES": SETTINGS[name]} for name in names}
    rows = []
    for shape, path, w in ab_cases(args.shapes):
        runs, same = alternating(path, settings, w, args.rounds, repeats=args.repeats)
        first = {n: median_seconds(r, slice(0, 1)) for n, r in runs.items()}
        later = {n: median_seconds(r, slice(1, None)) for n, r in runs.items()} if args.repeats > 1 else {}
        for n in names:
            rss = max(r.rss for r in runs[n]) / 2**20
            faults = sorted(r.faults for r in runs[n])[len(runs[n]) // 2]
            rows.append([shape, w.name, n, f"{first[n]:.2f}", f"{first[BASELINE] / first[n]:.2f}x",
                         f"{later[n]:.2f}" if later else "", f"{later[BASELINE] / later[n]:.2f}x" if later else "",
                         faults, f"{rss:.0f}", "yes" if same else "NO"])
    body = (f"{args.rounds} engines per setting, alternating, each warmed up and then timing {args.repeats} "
            "rollouts (TP1, float32; seconds from submitting a rollout to its last token). `first`: the median "
            "over engines of the first rollout; `later`: of the rollouts after it, as a long-lived RL engine runs "
            f"them. Speed-ups are against `{BASELINE}`. Faults: the worker's minor page faults over an engine's "
            "rollouts (median); RSS: its resident memory after the last (the largest of the engines).\n\n"
            + "\n".join(f"- `{n}`: `GLIBC_TUNABLES={SETTINGS[n]}`" for n in names) + "\n\n"
            + markdown_table(["model", "workload", "setting", "first s", "first speed-up", "later s",
                              "later speed-up", "faults", "worker RSS MiB", "same tokens"], rows))
    write_result("worker_malloc", "The CPU workers' allocator: huge pages, and freed heap memory kept", body)


if __name__ == "__main__":
    main()
