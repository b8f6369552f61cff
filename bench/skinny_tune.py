"""Write the skinny GEMM's tuned table (``csrc/pat_kernels/skinny_tuned.json``) from a GPU run's gemm part.

The gemm part of ``bench/gpu_check.py`` times every config of its sweep at each projection of the model
shapes and at 1, 8 and 64 rows (16 and 32 without --quick), and keeps the fastest (``best``). This script
files those bests under the device's name, keyed by the weight's shape and the rows they were timed at,
so the engine multiplies those shapes with the config measured fastest on that device
(``pat_kernels/skinny_matmul.engine_config``); other shapes and devices keep the rule. Run it after a GPU
run whose gemm part is in the results:

    python bench/skinny_tune.py bench/results/gpu_check.json

Entries of other devices already in the table are kept; the device's own are replaced.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from gpucheck.shared import LLAMA3_8B, LLAMA32_1B
from gpucheck.skinny_gemm import projections

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "csrc" / "pat_kernels" / "skinny_tuned.json"
SPECS = {"Llama-3-8B": LLAMA3_8B, "Llama-3.2-1B": LLAMA32_1B}  # the gemm part's model names


def device_of(machine: str) -> str:
    """The GPU's name in a results file's machine line ("..., GPU NVIDIA H100 80GB HBM3, Python ...")."""
    found = re.search(r"GPU (.+?), Python", machine)
    if not found:
        raise ValueError(f"no GPU named in the machine line {machine!r}")
    return found[1]


def tuned_entries(gemm: dict) -> list[dict]:
    """One entry per (model, projection, rows) of a gemm part's data: the shape, the rows and the best config,
    with its time and cuBLAS's for the record."""
    entries = []
    for model, cases in gemm["data"].items():
        shapes = {p.name: (p.n, p.k) for p in projections(SPECS[model])}
        for c in cases:
            n, k = (c["n"], c["k"]) if "n" in c else shapes[c["name"]]  # runs before the shape was recorded
            entries.append({"model": model, "projection": c["name"], "n": n, "k": k, "rows": c["rows"],
                            "config": c["best"], "us": round(c["best_s"] * 1e6, 2),
                            "cublas_us": round(c["cublas_s"] * 1e6, 2)})
    return entries


def render(table: dict) -> str:
    """The table as JSON with one config a line (diffs of a new run read shape by shape)."""
    devices = []
    for device, entry in table["devices"].items():
        configs = ",\n".join(f"    {json.dumps(c)}" for c in entry["configs"])
        devices.append(f"  {json.dumps(device)}: {{\"source\": {json.dumps(entry['source'])}, \"configs\": [\n"
                       f"{configs}]}}")
    return "{\"devices\": {\n" + ",\n".join(devices) + "}}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="a gpu_check JSON holding a gemm part")
    ap.add_argument("--table", type=Path, default=TABLE)
    args = ap.parse_args()
    gemm = json.loads(args.results.read_text())["gemm"]
    if gemm.get("status") != "ok":
        raise SystemExit(f"the gemm part of {args.results} did not pass: {gemm.get('status')}")
    device = device_of(gemm["machine"])
    table = json.loads(args.table.read_text()) if args.table.exists() else {"devices": {}}
    table["devices"][device] = {"source": f"{args.results.name}, gemm part: {gemm['command']} at {gemm['date']}",
                                "configs": tuned_entries(gemm)}
    args.table.write_text(render(table))
    print(f"wrote {len(table['devices'][device]['configs'])} tuned configs for {device} to {args.table}")


if __name__ == "__main__":
    main()
