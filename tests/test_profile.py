"""torch.profiler over the engine's workers: ``Engine.start_profile`` / ``stop_profile`` and the HTTP routes
vLLM and SGLang serve (``/start_profile``, ``/stop_profile``).

One engine (TP1xDP2, float64, two worker processes) and its server serve the module. A profile must hold the
engine's own steps (the step's labelled pieces in every rank's trace and table), stop itself after
``num_steps``, refuse what makes no sense by name, and leave the engine generating as before.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pat_engine import InvalidRequestError, SamplingParams
from pat_engine.core.profiling import PROFILER_DIR_ENV
from pat_engine.serve import profile_routes

from http_fixtures import client, engine, server  # noqa: F401 (fixtures, used by name)

pytestmark = pytest.mark.slow  # starts worker processes

PROMPTS = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
PARAMS = SamplingParams(max_new_tokens=6, logprobs=True)


def generate(engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]


def trace_names(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def test_a_profile_holds_every_ranks_steps(engine, tmp_path):
    before = generate(engine)
    folder = engine.start_profile(str(tmp_path / "profiles"))
    assert Path(folder) == tmp_path / "profiles"
    assert generate(engine) == before  # profiled steps compute the same
    files = engine.stop_profile()
    traces = sorted(f for f in files if f.endswith(".pt.trace.json.gz"))
    tables = sorted(f for f in files if f.endswith(".table.txt"))
    assert [Path(t).name.split("-rank")[1] for t in traces] == ["0.pt.trace.json.gz", "1.pt.trace.json.gz"]
    assert len(tables) == 2 and all(Path(f).parent == Path(folder) for f in files)
    for trace, table in zip(traces, tables):
        assert {"forward", "prepare"} <= trace_names(trace)  # the executor's labelled pieces of a step
        text = Path(table).read_text()
        assert "forward" in text and "Self CPU" in text
        assert int(text.split(" steps")[0].split(", ")[1]) >= 1  # "rank r, N steps"
    assert generate(engine) == before  # and after it


def test_a_profile_stops_itself_after_its_steps(engine, tmp_path):
    engine.start_profile(str(tmp_path), num_steps=2)
    generate(engine)  # more than two steps on each rank
    tables = [f for f in engine.stop_profile() if f.endswith(".table.txt")]
    assert [Path(t).read_text().splitlines()[0].split(", ")[1] for t in tables] == ["2 steps", "2 steps"]


def test_profiling_mistakes_are_refused_by_name(engine, tmp_path):
    with pytest.raises(InvalidRequestError, match="no profile is running"):
        engine.stop_profile()
    for bad in (0, -3, 1.5, True):
        with pytest.raises(InvalidRequestError, match="num_steps must be a positive integer"):
            engine.start_profile(str(tmp_path), num_steps=bad)
    engine.start_profile(str(tmp_path))
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.start_profile(str(tmp_path))
    first = engine.stop_profile()
    with pytest.raises(InvalidRequestError, match="no profile is running"):
        engine.stop_profile()
    engine.start_profile(str(tmp_path))  # at once, into the same folder: its own files
    second = engine.stop_profile()
    assert len(first) == len(second) == 4 and not set(first) & set(second)
    assert all(Path(f).is_file() for f in first + second)


def test_the_default_folder_is_the_environments(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path / "from-env"))
    assert engine.start_profile() == str(tmp_path / "from-env")
    assert all(Path(f).parent == tmp_path / "from-env" for f in engine.stop_profile())


def test_http_profiling_is_off_without_the_servers_folder(client, monkeypatch):
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    r = client.post("/start_profile")
    assert r.status_code == 404 and PROFILER_DIR_ENV in r.json()["error"]["message"]


def test_http_start_and_stop(client, engine, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    r = client.post("/start_profile")  # vLLM's clients send no body
    assert r.status_code == 200, r.text
    assert r.json()["output_dir"] == str(tmp_path) and str(profile_routes.DEFAULT_HTTP_STEPS) in r.json()["message"]
    assert client.post("/generate", json={"input_ids": PROMPTS[0],
                                          "sampling_params": {"max_new_tokens": 4}}).status_code == 200
    r = client.post("/stop_profile")
    assert r.status_code == 200, r.text
    files = r.json()["files"]
    assert len(files) == 4 and all(Path(f).is_file() and Path(f).parent == tmp_path for f in files)
    r = client.post("/start_profile", json={"num_steps": 3, "record_shapes": True})  # SGLang's body
    assert r.status_code == 200 and "3 steps" in r.json()["message"]
    assert client.post("/stop_profile").status_code == 200
    assert client.post("/stop_profile").status_code == 400  # nothing running


@pytest.mark.parametrize("body,match", [({"num_steps": 0}, "num_steps"),
                                        ({"num_steps": profile_routes.MAX_HTTP_STEPS + 1}, "num_steps"),
                                        ({"output_dir": "/etc"}, "output_dir"),
                                        ({"num_steps": "5"}, "num_steps")])
def test_http_bodies_that_are_refused(client, tmp_path, monkeypatch, body, match):
    """A request cannot choose where the server writes, nor make a profile unbounded."""
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    r = client.post("/start_profile", json=body)
    assert r.status_code == 400 and match in r.text, r.text
    assert client.post("/stop_profile").status_code == 400  # none was started


def test_a_profile_spans_a_live_switch(engine, tmp_path):
    """The switch runs while both ranks record: TP1xDP2 -> TP2xDP1 -> back, the same tokens, each rank's files."""
    before = generate(engine)
    engine.start_profile(str(tmp_path))
    try:
        assert engine.reconfigure(2).ok and str(engine.layout) == "TP2xDP1"
        assert generate(engine) == before
    finally:
        assert engine.reconfigure(1).ok
    tables = [f for f in engine.stop_profile() if f.endswith(".table.txt")]
    assert len(tables) == 2 and all("forward" in Path(t).read_text() for t in tables)
    assert generate(engine) == before
