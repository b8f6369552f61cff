"""Active requests and layout over time, one panel per policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {1: "#bbbbbb", 2: "#8ecae6", 4: "#ffb703", 8: "#fb8500"}


def plot_runs(runs: dict, title: str, path: Path) -> None:
    """runs: label -> Simulation (finished). Active requests as a line, TP as the shaded background."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.9 * len(runs)), sharex=True, squeeze=False)
    end = max(sim.finished_at for sim in runs.values())
    for ax, (label, sim) in zip(axes[:, 0], runs.items()):
        pts = sorted(sim.timeline)
        t = [p[0] for p in pts]
        ax.step(t, [p[1] for p in pts], where="post", color="black", lw=1.2)
        # shade each layout's span
        spans, start, tp = [], 0.0, pts[0][2]
        for ti, _, tpi in pts:
            if tpi != tp:
                spans.append((start, ti, tp))
                start, tp = ti, tpi
        spans.append((start, sim.finished_at, tp))
        for a, b, tpi in spans:
            ax.axvspan(a, b, color=COLORS.get(tpi, "#dddddd"), alpha=0.5, lw=0)
        for sw in sim.switches:
            ax.axvline(sw.t, color="red", lw=0.8, ls="--")
        ax.set_yscale("symlog", linthresh=4)
        ax.set_ylim(bottom=0)  # active requests are never negative; symlog would otherwise mirror the axis
        ax.set_ylabel("active")
        ax.set_xlim(0, end * 1.01)
        ax.set_title(f"{label}: {sim.finished_at:.1f} s", fontsize=9, loc="left")
    handles = [matplotlib.patches.Patch(color=c, alpha=0.5, label=f"TP{tp}") for tp, c in COLORS.items()]
    handles.append(matplotlib.lines.Line2D([], [], color="red", lw=0.8, ls="--", label="switch"))
    axes[0, 0].legend(handles=handles, ncol=5, fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
