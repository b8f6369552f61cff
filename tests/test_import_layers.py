"""The layering docs/switch.md draws: core -> protocol <- worker, and the pure layers below import upward never."""

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
    "sampling": {"core", "worker", "predictor", "serve", "model", "protocol", "parallel"},
}


def imported_subpackages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "pat_engine" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_the_wrong_way(package):
    bad = {}
    for path in (PACKAGE / package).rglob("*.py"):
        wrong = imported_subpackages(path) & FORBIDDEN[package]
        if wrong:
            bad[str(path.relative_to(PACKAGE))] = sorted(wrong)
    assert not bad, f"imports against the layering: {bad}"
