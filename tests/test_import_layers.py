"""The layering docs/switch.md draws: core -> protocol <- worker, and the pure layers below import upward never.

The predictor is below core: core installs a controller and asks it for switch costs, the
predictor knows nothing of the engine. Leaf modules (the version, the environment switches)
import nothing of pat_engine, so anything may read them without an import circle. The wire
protocol is plain data: no torch, and of sampling only the plain ``SamplingSpec``. The serve
faces are routers that share the server state, never the app or each other."""

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
    "sampling": {"core", "worker", "predictor", "serve", "model", "protocol", "parallel", "speculative", "rollout"},
    "speculative": {"worker", "serve", "rollout"},
}
PLAIN_SAMPLING = {"pat_engine.sampling.spec", "pat_engine.sampling.params",  # what the protocol may carry
                  "pat_engine.sampling.structured"}
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


def test_the_protocol_is_plain_data():
    """No torch and no sampler in the messages: a SamplingSpec travels as plain fields."""
    bad = {}
    for path in (PACKAGE / "protocol").rglob("*.py"):
        mods = imported_modules(path)
        wrong = {m for m in mods if m.split(".")[0] == "torch"}
        wrong |= {m for m in mods if m.startswith("pat_engine.sampling") and m not in PLAIN_SAMPLING}
        if wrong:
            bad[str(path.relative_to(PACKAGE))] = sorted(wrong)
    assert not bad, f"the protocol imports more than plain data: {bad}"


FACES = {"openai": PACKAGE / "serve" / "openai", "sglang": PACKAGE / "serve" / "sglang",
         "pat_routes": PACKAGE / "serve" / "pat_routes.py", "batch": PACKAGE / "serve" / "batch"}


def _files(where: Path) -> list[Path]:
    return list(where.rglob("*.py")) if where.is_dir() else [where]


@pytest.mark.parametrize("face", sorted(FACES))
def test_the_serve_faces_share_the_server_state_not_the_app(face):
    """serve/server.py includes every face's router: a face importing it back would be a circle."""
    bad = [str(p.relative_to(PACKAGE)) for p in _files(FACES[face]) if "pat_engine.serve.server" in imported_modules(p)]
    assert not bad, f"import serve/state.py instead: {bad}"


def test_the_openai_and_sglang_faces_do_not_import_each_other():
    pairs = (("openai", "pat_engine.serve.sglang"), ("sglang", "pat_engine.serve.openai"))
    bad = {str(p.relative_to(PACKAGE)): other for face, other in pairs for p in _files(FACES[face])
           if any(m.startswith(other) for m in imported_modules(p))}
    assert not bad, f"a face imports the other face: {bad}"
