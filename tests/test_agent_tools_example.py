"""examples/agent_tools.py: an agent's episodes through the OpenAI SDK against pat-serve, a live switch
between them; every turn's calls name an offered tool with valid arguments and every answer parses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # an engine, a server and the SDK

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_tools.py"


def test_the_agent_example_runs_its_episodes_through_a_live_switch(capsys):
    pytest.importorskip("xgrammar", reason="the example holds calls and answers to schemas")
    spec = importlib.util.spec_from_file_location("agent_tools", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "episode 0 (TP1xDP2)" in out and "episode 1 (TP2xDP1)" in out
