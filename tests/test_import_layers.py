"""The layering docs/switch.md draws: core -> protocol <- worker, and the pure layers below import upward never.

The predictor is below core: core installs a controller and asks it for switch costs, the
predictor knows nothing of the engine. Leaf modules (the version, the environment switches)
import nothing of pat_engine, so anything may read them without an import circle."""

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
LEAVES = ("version.py", "env.py")


def _is_submodule(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name).is_dir()


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, by its dotted name (``from pat_engine import env``: pat_engine.env)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "pat_engine":
            out.update(f"pat_engine.{a.name}" if _is_submodule(a.name) else "pat_engine" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def imported_subpackages(path: Path) -> set[str]:
    """The pat_engine subpackages and modules ``path`` imports ("" for ``import pat_engine`` itself)."""
    parts = [name.split(".") for name in imported_modules(path)]
    return {p[1] if len(p) > 1 else "" for p in parts if p[0] == "pat_engine"}


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


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_the_package(leaf):
    assert not imported_subpackages(PACKAGE / leaf)


def test_the_sglang_routes_share_the_server_state_not_the_openai_app():
    """serve/server.py registers the SGLang routes: importing it back would be a circle."""
    bad = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "serve" / "sglang").rglob("*.py")
           if "pat_engine.serve.server" in imported_modules(p)]
    assert not bad, f"import serve/state.py instead: {bad}"
