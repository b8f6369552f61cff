"""The layering docs/switch.md draws: core -> protocol <- worker, and the pure layers below import upward never.

The predictor is below core: core installs a controller and asks it for switch costs, the
predictor knows nothing of the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pat_engine"

# package -> packages of pat_engine it may not import
FORBIDDEN = {
    "core": {"worker"},
    "worker": {"core", "predictor", "serve"},
    "protocol": {"core", "worker", "predictor", "serve", "model"},
    "parallel": {"core", "worker", "predictor", "serve", "model", "protocol"},
    "model": {"core", "worker", "predictor", "serve", "protocol"},
    "predictor": {"core", "worker", "serve", "protocol", "rollout"},
    "rollout": {"worker", "protocol", "serve"},
    "sampling": {"core", "worker", "predictor", "serve", "model", "protocol", "parallel"},
}


def imported_subpackages(path: Path) -> set[str]:
    """The pat_engine subpackages and modules ``path`` imports ("" for ``import pat_engine`` itself)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "pat_engine":
                out.add(parts[1] if len(parts) > 1 else "")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_the_wrong_way(package):
    forbidden = FORBIDDEN[package]
    if "core" in forbidden:
        forbidden = forbidden | {""}  # the package root imports core.engine: ``import pat_engine`` reaches core
    bad = {}
    for path in (PACKAGE / package).rglob("*.py"):
        wrong = imported_subpackages(path) & forbidden
        if wrong:
            bad[str(path.relative_to(PACKAGE))] = sorted(wrong)
    assert not bad, f"imports against the layering: {bad}"
