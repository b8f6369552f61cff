"""Issue 12, fast: every parameter is checked at the API boundary, before anything reaches a worker.

In-process only (no worker processes): SamplingParams, RequestFactory against a
tiny model's architecture, the HTTP schemas, the guard middleware, checkpoint
checks, the worker pool's read of a dying worker, the quarantine, the restart
budget and the bounded timeline.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import time
from multiprocessing.connection import Connection

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pat_engine.config import EngineConfig
from pat_engine.core.inputs import RequestFactory, max_prompt_chars
from pat_engine.core.quarantine import Quarantine
from pat_engine.core.request import Sequence
from pat_engine.core.restart_budget import RestartBudget
from pat_engine.core.timeline import Timeline
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import InvalidRequestError, ModelLoadError, WorkerFailure
from pat_engine.model.arch import load_model_arch
from pat_engine.model.weights import check_safetensors_headers, safetensors_files
from pat_engine.protocol.calls import Reply
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.sampling.params import MAX_STOP_TOKEN_IDS, SamplingParams
from pat_engine.serve.errors import validation_error
from pat_engine.serve.guard import RequestGuard
from pat_engine.serve.openai.protocol import MAX_MESSAGES, ChatCompletionRequest, CompletionRequest
from pat_engine.serve.openai.translate import chat_input

VOCAB_TEST_LEN = 64


@pytest.fixture(scope="module")
def factory(model_dir):
    return RequestFactory(load_model_arch(model_dir("llama")), None, VOCAB_TEST_LEN, engine_seed=0)


# ---- defect 8 and 1: sampling parameters ---------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed="7"), "seed"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop_token_ids=("a",)), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), "at most"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(min_new_tokens=5, max_new_tokens=4), "min_new_tokens"),
    (dict(logprobs="yes"), "logprobs"),
])
def test_bad_sampling_params_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_sampling_conventions():
    assert SamplingParams(temperature=1e-9).greedy  # vLLM: below 1e-5 is greedy (no overflow to inf)
    assert SamplingParams(top_k=0).top_k == 0  # vLLM: 0 and -1 both mean off
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_stop_ids_and_top_k_are_checked_against_the_vocabulary(factory):
    """Defect 1: a stop id past the vocabulary crashed the worker's sampler (with min_new_tokens)."""
    vocab = factory.arch.vocab_size
    with pytest.raises(InvalidRequestError, match="stop_token_ids: token id 1000000 is outside the vocabulary"):
        factory.make([1, 2, 3], SamplingParams(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(10**6,)))
    with pytest.raises(InvalidRequestError, match=f"stop_token_ids: token id {vocab} is outside"):
        factory.make([1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=(vocab,)))
    with pytest.raises(InvalidRequestError, match="top_k=.* larger than the vocabulary"):
        factory.make([1, 2, 3], SamplingParams(max_new_tokens=4, top_k=vocab + 1))
    ok = factory.make([1, 2, 3], SamplingParams(max_new_tokens=4, top_k=vocab, stop_token_ids=(vocab - 1,)))
    assert ok.params.top_k == vocab


class _MustNotTokenize:
    def __call__(self, *a, **k):
        raise AssertionError("the prompt was tokenized before its length was checked")


def test_long_text_is_refused_before_tokenizing(factory):
    """Defect 5: a 20 MB prompt was tokenized (27 s, 3.6 GB) before its length was checked."""
    f = RequestFactory(factory.arch, _MustNotTokenize(), VOCAB_TEST_LEN, 0)
    t = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="characters, more than the"):
        f.make("x" * 20_000_000, SamplingParams(max_new_tokens=4))
    assert time.perf_counter() - t < 1.0
    assert max_prompt_chars(VOCAB_TEST_LEN) == 32 * VOCAB_TEST_LEN


def test_a_text_prompt_takes_the_special_tokens_asked(factory):
    """/tokenize's add_special_tokens reaches the tokenizer; generation always adds them (the default)."""
    class WithBos:
        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1] * add_special_tokens + [ord(c) % 50 + 2 for c in text]}

    f = RequestFactory(factory.arch, WithBos(), VOCAB_TEST_LEN, 0)
    assert f.tokenize("ab", "")[0] == [1, 49, 50] and f.tokenize("ab", "", add_special_tokens=False)[0] == [49, 50]


def test_long_token_list_is_refused_before_scanning(factory):
    class Poisoned(list):  # iterating it would mean the ids were scanned
        def __iter__(self):
            raise AssertionError("the ids were scanned before the length check")

    with pytest.raises(InvalidRequestError, match="context holds 64"):
        factory.make(Poisoned([1] * 100), SamplingParams(max_new_tokens=4))


# ---- the same over HTTP: schemas name the field --------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"temperature": "NaN"}, "temperature"),
    ({"top_p": "Infinity"}, "top_p"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [-3]}, "stop_token_ids.0"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"top_k": -5}, "top_k"),
    ({"n": 100000}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"best_of": 3}, ""),  # a whole-request check (best_of against n): no single field
    ({"prompt": ["a"] * 300}, "prompt"),
])
def test_http_schema_errors_name_the_field(body, field):
    data = {"prompt": "hi", **body}
    raw = json.loads(json.dumps(data).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity"))
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(raw)
    err = validation_error(info.value)
    assert err.status == 400 and err.param == field, (err.param, err.message)
    if not field:
        assert "best_of" in err.message


def test_chat_limits():
    with pytest.raises(ValidationError, match="at most 2048"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x" * 5000}]})
    with pytest.raises(InvalidRequestError, match="messages hold 5000 characters"):
        chat_input(req, _MustNotTokenize(), max_model_len=64)


def test_guard_checks_key_and_declared_body_size():
    app = FastAPI()

    @app.post("/v1/completions")
    async def comp() -> dict:
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    rejected = []
    app.add_middleware(RequestGuard, api_key="s3cret", max_body_bytes=100, on_reject=rejected.append)
    c = TestClient(app)
    assert c.get("/health").status_code == 200  # probes need no key
    r = c.post("/v1/completions", json={})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert c.post("/v1/completions", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.post("/v1/completions", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = c.post("/v1/completions", content=b"x" * 101, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert rejected == ["unauthorized", "unauthorized", "invalid"]


# ---- defect 8: checkpoints -----------------------------------------------------------------------


def _copy(model_dir, tmp_path, name: str):
    dst = tmp_path / name
    shutil.copytree(model_dir("llama"), dst)
    return dst


def test_truncated_or_corrupted_checkpoint_is_a_load_error_naming_the_file(model_dir, tmp_path):
    for name, damage in [("truncated", lambda b: b[: len(b) // 2]), ("corrupted", lambda b: b[:8] + b"#" * 32 + b[40:])]:
        d = _copy(model_dir, tmp_path, name)
        f = safetensors_files(d)[0]
        f.write_bytes(damage(f.read_bytes()))
        with pytest.raises(ModelLoadError, match=f"{f.name}.* corrupted or truncated"):
            check_safetensors_headers(safetensors_files(d))


def test_zero_sizes_in_config_are_load_errors(model_dir, tmp_path):
    for key in ("max_position_embeddings", "vocab_size", "num_hidden_layers"):
        d = _copy(model_dir, tmp_path, key)
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = 0
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=f"{key} must be a positive integer"):
            load_model_arch(d)


# ---- defect 6: a dying worker's last words are kept ----------------------------------------------


def test_reply_read_together_with_the_close_is_kept():
    """The worker sends its error and exits; both arrive in one read. The reason must survive."""
    ours, theirs = socket.socketpair()
    conn, other = Connection(ours.detach()), Connection(theirs.detach())
    other.send(Reply(0, 0, False, error="Traceback ...\nModelLoadError: bad shard", error_type="ModelLoadError"))
    other.close()
    time.sleep(0.05)
    pool = WorkerPool.__new__(WorkerPool)
    pool.conns, pool.procs, pool.pending, pool._failed_calls = [conn], [], [], set()
    msgs = pool._drain(0)
    assert len(msgs) == 1 and "bad shard" in msgs[0].error
    with pytest.raises(WorkerFailure):  # the closed socket is noticed on the next read
        pool.procs = [type("P", (), {"pid": 1, "wait": lambda self, t: 0, "poll": lambda self: 0})()]
        pool._drain(0)


def test_late_replies_to_a_failed_call_are_dropped():
    """Every rank refuses a call (a bad weight payload); the first refusal is raised, and another rank's,
    arriving later, must not be taken for a failure of the next call (or of a step: a worker restart)."""
    import itertools
    import threading
    from types import SimpleNamespace

    from pat_engine.protocol.calls import Stats

    pairs = [socket.socketpair() for _ in range(2)]
    workers = [Connection(theirs.detach()) for _, theirs in pairs]
    pool = WorkerPool.__new__(WorkerPool)
    pool.conns = [Connection(ours.detach()) for ours, _ in pairs]
    alive = type("P", (), {"pid": 1, "poll": lambda self: None})()
    pool.procs, pool.pending, pool._failed_calls, pool.world = [alive, alive], [], set(), 2
    pool._call_ids, pool.config = itertools.count(1), SimpleNamespace(step_timeout_s=10)

    def serve() -> None:
        first = [w.recv() for w in workers]
        refusal = "Traceback ...\nModelLoadError: shape (3, 3) != expected (256, 128)"
        workers[0].send(Reply(first[0].call_id, 0, False, error=refusal, error_type="ModelLoadError"))
        time.sleep(0.3)  # the other rank's refusal arrives after the first has been raised
        workers[1].send(Reply(first[1].call_id, 1, False, error=refusal, error_type="ModelLoadError"))
        for r, w in enumerate(workers):
            w.send(Reply(w.recv().call_id, r, True, value=r))

    thread = threading.Thread(target=serve)
    thread.start()
    with pytest.raises(WorkerFailure) as refused:
        pool.ask(Stats())
    assert refused.value.error_type == "ModelLoadError" and refused.value.rank == 0
    time.sleep(0.5)
    assert pool.ask(Stats()) == [0, 1]
    thread.join(5)
    assert pool.poll(0.2) == []


# ---- poison isolation, restart budget, timeline --------------------------------------------------


def _seq(i: int, n_out: int = 0) -> Sequence:
    s = Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=50), SamplingSpec(0.0, -1, 1.0, 0, False), (), 64)
    s.output_ids = [7] * n_out
    return s


def test_quarantine_fails_the_repeat_offender_alone():
    q = Quarantine()
    a, b, c = _seq(0, 5), _seq(1, 5), _seq(2, 5)  # b is the poison
    poison, held = q.on_crash([a, b, c])
    assert poison == [] and held == [a, b, c]
    q.park(held)
    assert q.next_to_admit() is a and q.next_to_admit() is None  # one at a time
    a.output_ids.append(7)  # a got past its crash point: cleared, next one in
    assert q.next_to_admit() is b and q.strikes(a.seq_id) == 0
    poison, held = q.on_crash([b, _seq(3, 9)])  # b crashes again, with an innocent newcomer
    assert poison == [b] and [s.seq_id for s in held] == [3]
    q.park(held)
    assert q.next_to_admit() is c


def test_restart_budget_is_a_rate():
    now = [0.0]
    budget = RestartBudget(2, 60.0, clock=lambda: now[0])
    assert budget.take() and budget.take() and not budget.take()
    now[0] = 61.0
    assert budget.recent() == 0 and budget.take()


def test_timeline_is_bounded():
    tl = Timeline(max_events=5)
    for i in range(100):
        tl.add_point("TP1xDP2", i, 1.0)
    d = tl.to_dict()
    assert len(d["points"]) == 5 and d["points"][-1]["active"] == 99


def test_engine_config_checks_failure_settings():
    with pytest.raises(InvalidRequestError, match="step_timeout_s"):
        EngineConfig("m", step_timeout_s=0)
    with pytest.raises(InvalidRequestError, match="restart_window_s"):
        EngineConfig("m", restart_window_s=float("nan"))


def test_a_peer_failure_is_blamed_on_the_rank_that_died():
    """A rank exits mid-collective; its peer's gloo error ("Connection reset by peer") is read before the
    dead rank's closed socket. The failure raised names the rank that died, not the one that saw it go."""
    pairs = [socket.socketpair() for _ in range(2)]
    workers = [Connection(theirs.detach()) for _, theirs in pairs]
    pool = WorkerPool.__new__(WorkerPool)
    pool.conns = [Connection(ours.detach()) for ours, _ in pairs]
    dies_at = time.monotonic() + 0.2  # rank 1's death is seen a little after rank 0's reply
    dead = type("P", (), {"pid": 2, "returncode": 17, "poll": lambda self: 17 if time.monotonic() > dies_at else None})()
    alive = type("P", (), {"pid": 1, "poll": lambda self: None})()
    pool.procs, pool.pending, pool._failed_calls, pool.world = [alive, dead], [], set(), 2
    gloo = "Traceback ...\nRuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    workers[0].send(Reply(-5, 0, False, error=gloo))
    with pytest.raises(WorkerFailure, match="rank 1") as failure:
        pool.poll(1.0)
    assert failure.value.rank == 1
    workers[0].send(Reply(-6, 0, False, error="Traceback ...\nIndexError: poisoned step"))
    (reply,) = pool.poll(1.0)  # a failure of the rank's own: handed on as it is
    assert reply.rank == 0 and "poisoned" in reply.error
