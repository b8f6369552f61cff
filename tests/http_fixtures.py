"""The engine, HTTP server and client the server tests share, one of each per test module.

Float64 tiny Llama at TP1xDP2; a module imports the three fixtures by name.
"""

from __future__ import annotations

import httpx
import pytest

from pat_engine import Engine
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app

MAX_LEN = 512  # room for requests long enough to disconnect from or switch under
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=MAX_LEN) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, ServerConfig(MODEL, max_queued_requests=64))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
