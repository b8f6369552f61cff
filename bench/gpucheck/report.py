"""The results file: what a part returns, how it is kept between runs, and the markdown it becomes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpucheck.registry import PARTS, Part

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_OUTPUT = RESULTS / "gpu_check.md"


@dataclass
class PartResult:
    """What a part's ``run`` returns: its section's markdown, one-line headlines for the summary at the top
    (a goal and its verdict, the number to read first), and plain data later parts may use."""

    body: str
    headlines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    """One part's outcome in one run, as the sidecar JSON keeps it (``--only`` keeps the other parts')."""

    part: str
    title: str
    body: str
    status: str  # "ok", "failed", "skipped"
    seconds: float
    command: str
    date: str
    machine: str
    headlines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Section:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def results_path(output: str | None, smoke: bool, workdir: str) -> Path:
    """Where the results go: ``output``, else bench/results/gpu_check.md; a smoke run never writes there."""
    if smoke:
        path = Path(output) if output else Path(workdir) / "gpu_check_smoke.md"
        if path.resolve() == DEFAULT_OUTPUT.resolve():
            raise SystemExit("--smoke never writes bench/results/gpu_check.md (CPU numbers); choose another --output")
        return path
    return Path(output) if output else DEFAULT_OUTPUT


def load_sections(results: Path) -> dict[str, Section]:
    """The sections kept beside ``results`` (its ``.json`` sidecar), by part; none when there is none."""
    sidecar = results.with_suffix(".json")
    if not sidecar.is_file():
        return {}
    return {k: Section.from_dict(v) for k, v in json.loads(sidecar.read_text()).items()}


def save_sections(results: Path, sections: dict[str, Section]) -> None:
    results.with_suffix(".json").write_text(json.dumps({k: asdict(v) for k, v in sections.items()}, indent=1))


def expected_seconds(part: Part, quick: bool) -> str:
    s = part.quick_s if quick else part.full_s
    return "skipped" if s is None else f"~{s}"


def render_report(sections: dict[str, Section], command: str, machine_line: str, date: str, *, smoke: bool,
                  quick: bool = False, environment: str = "", notes: list[str] | tuple[str, ...] = ()) -> str:
    """Header (``notes``: more lines of it), the parts table, every part's headlines, then the sections in the
    registry's order (each naming its own run when it came from an earlier command)."""
    lines = ["# GPU check (issue 30, item 6)", ""]
    if smoke:
        lines += ["**SMOKE RUN: toy sizes on the CPU. These numbers measure nothing.**", ""]
    lines += [f"- command: `{command}`", f"- machine: {machine_line}", f"- date: {date}"]
    lines += [f"- environment: {environment}"] if environment else []
    lines += [f"- {n}" for n in notes] + [""]
    numbered = [(i + 1, p) for i, p in enumerate(p for p in PARTS if p.name in sections)]
    expected = "H100 s expected (--quick)" if quick else "H100 s expected"
    lines += [f"| part | status | seconds | {expected} | run |", "|---|---|---|---|---|"]
    for n, p in numbered:
        s = sections[p.name]
        run = "this command" if _this_run(s, command, date) else f"`{s.command}` at {s.date}"
        lines.append(f"| {n}. {s.title} | {s.status} | {s.seconds:.0f} | {expected_seconds(p, quick)} | {run} |")
    heads = [(p, h) for _, p in numbered for h in sections[p.name].headlines]
    if heads:
        lines += ["", "## Headlines", ""] + [f"- {p.name}: {h}" for p, h in heads]
    for n, p in numbered:
        s = sections[p.name]
        lines += ["", f"## {n}. {s.title}", ""]
        if not _this_run(s, command, date):
            lines += [f"_From `{s.command}` at {s.date} on {s.machine}._", ""]
        lines.append(s.body.rstrip())
    return "\n".join(lines) + "\n"


def _this_run(s: Section, command: str, date: str) -> bool:
    return s.command == command and s.date == date
