"""The timeline plot: active requests and tokens/s over time, layouts as shaded bands, switches marked with their cost.

Input is the engine's timeline dict (``Engine.timeline``, ``/pat/timeline``, or
the JSON that ``pat-serve batch --timeline`` writes): ``points`` of
(t, layout, active, tokens_per_s) and ``switches`` of (t, from_layout,
to_layout, kv_path, seconds, ok, ...), where a switch's ``t`` is when it ended.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def layout_segments(timeline: dict) -> list[tuple[float, float, str]]:
    """(start, end, layout) bands covering the run; a switch's own duration is left out (drawn hatched)."""
    points, switches = timeline.get("points", []), [s for s in timeline.get("switches", []) if s.get("ok", True)]
    if not points and not switches:
        return []
    times = [p["t"] for p in points] + [s["t"] for s in switches]
    t0, t1 = min(0.0, min(times)), max(times)
    layout = switches[0]["from_layout"] if switches else points[0]["layout"]
    segments, start = [], t0
    for s in sorted(switches, key=lambda s: s["t"]):
        begin = max(start, s["t"] - s.get("seconds", 0.0))
        segments.append((start, begin, layout))
        start, layout = s["t"], s["to_layout"]
    segments.append((start, max(t1, start), layout))
    return [seg for seg in segments if seg[1] > seg[0]] or segments[-1:]


def _tp_of(layout: str) -> int:
    try:
        return int(layout.split("x")[0].removeprefix("TP"))
    except ValueError:
        return 0


def plot_timeline(timeline: dict, out: str | Path, title: str | None = None) -> Path:
    points = timeline.get("points", [])
    switches = timeline.get("switches", [])
    fig, (ax_act, ax_tps) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    segments = layout_segments(timeline)
    layouts = sorted({seg[2] for seg in segments}, key=_tp_of)
    color = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(layouts)}
    for ax in (ax_act, ax_tps):
        for start, end, name in segments:
            ax.axvspan(start, end, color=color[name], alpha=0.18, lw=0)
    ts = [p["t"] for p in points]
    ax_act.step(ts, [p["active"] for p in points], where="post", color="black", lw=1.6, label="active requests")
    rates = _smooth([p["tokens_per_s"] for p in points])
    ax_tps.plot(ts, rates, color="#333333", lw=1.2)
    positive = [r for r in rates if r > 0]
    log_rates = bool(positive) and max(positive) / min(positive) > 30  # a drained tail would sit flat on zero
    if log_rates:
        ax_tps.set_yscale("log")
    top = max([p["active"] for p in points] + [1])
    for i, s in enumerate(sorted(switches, key=lambda s: s["t"])):
        begin = s["t"] - s.get("seconds", 0.0)
        style = dict(color="#B22222" if s.get("ok", True) else "#777777", lw=1.3, ls="--")
        for ax in (ax_act, ax_tps):
            ax.axvspan(begin, s["t"], facecolor="none", edgecolor=style["color"], hatch="///", lw=0)
            ax.axvline(s["t"], **style)
        label = f"{s['from_layout']}→{s['to_layout']}\n{s.get('seconds', 0.0):.2f} s, {s.get('kv_path', '?')}"
        if not s.get("ok", True):
            label = f"failed: {s.get('to_layout')}\n{(s.get('error') or '')[:40]}"
        # labels step down so that switches close in time do not print over each other
        ax_act.annotate(label, xy=(s["t"], top * (1.2 - 0.25 * (i % 3))), xytext=(4, -4), textcoords="offset points", va="top", fontsize=8,
                        color=style["color"], bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
    ax_act.set_ylabel("active requests")
    ax_act.set_ylim(0, top * 1.25 + 0.5)
    ax_tps.set_ylabel("tokens/s (engine)" + (", log scale" if log_rates else ""))
    ax_tps.set_xlabel("time since engine start (s)")
    for ax in (ax_act, ax_tps):
        ax.grid(alpha=0.3)
    handles = [Patch(facecolor=color[n], alpha=0.35, label=f"layout {n}") for n in layouts]
    handles.append(plt.Line2D([], [], color="#B22222", ls="--", label="switch (hatched: its duration)"))
    handles.append(plt.Line2D([], [], color="black", lw=1.6, label="active requests"))
    ax_act.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    fig.suptitle(_wrap(title or timeline.get("title") or "pat-engine layout timeline"), fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _smooth(values: list[float], k: int = 5) -> list[float]:
    """Centred moving average: per-step token rates are very jumpy."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k // 2): i + k // 2 + 1]
        out.append(sum(window) / len(window))
    return out


def _wrap(text: str, width: int = 120) -> str:
    words, lines, cur = text.split(" "), [], ""
    for w in words:
        if cur and len(cur) + len(w) + 1 > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join(lines + [cur])
