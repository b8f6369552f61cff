"""sglang-router (the Rust wheel) in front of two pat-serve processes on loopback, ports from the OS.

Requests are routed to both; a worker is added and another removed through the router's API while load
runs, and none is lost; aborts and weight updates are fanned out to every worker as slime does (it lists
the router's workers, then posts to each: ``slime/rollout/sglang_rollout.py``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts server and worker processes

try:
    import sglang_router  # noqa: F401
    from local_cluster import PatServeProcess, SGLangRouter
except ImportError as exc:  # pragma: no cover - depends on the optional wheel
    pytest.skip(f"sglang-router is not installed (pip install sglang-router==0.3.2): {exc}", allow_module_level=True)


def finished_count(url: str) -> float:
    """Requests this pat-serve finished (every reason), from its Prometheus counter."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pat:request_success_total{"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    model = model_dir("llama")
    with PatServeProcess(model, 1, 1, "float32") as a, PatServeProcess(model, 1, 1, "float32") as b:
        with SGLangRouter([a.url, b.url]) as router:
            yield router, a, b


def gen(url: str, prompt: list[int], max_new: int, **sp) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **sp}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_is_routed_to_both(cluster):
    router, a, b = cluster
    before = [finished_count(a.url), finished_count(b.url)]
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: gen(router.url, p, 6), prompts))
    direct = [gen(a.url, p, 6) for p in prompts]
    assert [o["output_ids"] for o in outs] == [d["output_ids"] for d in direct]
    served = [finished_count(a.url) - before[0] - len(prompts), finished_count(b.url) - before[1]]
    assert sum(served) == len(prompts) and min(served) > 0, served


def test_add_and_remove_workers_under_load(cluster, model_dir):
    router, a, b = cluster
    results: list = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            try:
                results.append(gen(router.url, [7, i % 50 + 1], 4)["meta_info"]["finish_reason"]["type"])
            except Exception as exc:  # a lost request: recorded, then asserted on
                results.append(repr(exc))
            i += 1

    with PatServeProcess(model_dir("llama"), 1, 1, "float32") as c:
        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(2)
            router.add_worker(c.url)
            deadline = time.monotonic() + 60
            while finished_count(c.url) == 0:  # the new worker takes requests
                assert time.monotonic() < deadline, "the added worker got no request"
                time.sleep(0.2)
            router.remove_worker(c.url)
            assert c.url not in [w["url"] for w in router.workers()]
            time.sleep(2)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
    assert results and all(r == "length" for r in results), [r for r in results if r != "length"][:3]


def test_abort_and_weight_updates_fanned_out_like_slime(cluster, model_dir):
    router, a, b = cluster
    urls = [w["url"] for w in router.workers()]
    assert sorted(urls) == sorted([a.url, b.url])
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(gen, router.url, [3, i + 1], 400, ignore_eos=True) for i in range(4)]
        deadline = time.monotonic() + 60
        while sum(httpx.get(u + "/v1/loads", timeout=10).json()["aggregate"]["num_reqs"] for u in urls) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        for u in urls:  # slime's abort(): every worker the router lists gets abort_all
            assert httpx.post(u + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
        outs = [f.result() for f in futs]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(o["output_ids"]) < 400 for o in outs)
    for u in urls:  # slime's weight sync: pause, flush, update with a version, continue, on every engine
        assert httpx.post(u + "/pause_generation", json={}, timeout=30).status_code == 200
        assert httpx.get(u + "/flush_cache", timeout=30).status_code == 200
        r = httpx.post(u + "/update_weights_from_disk", json={"model_path": model_dir("llama"),
                                                              "weight_version": "rollout-3"}, timeout=120)
        assert r.json()["success"], r.text
        assert httpx.post(u + "/continue_generation", json={}, timeout=30).status_code == 200
    assert {httpx.get(u + "/get_weight_version", timeout=10).json()["weight_version"] for u in urls} == {"rollout-3"}
    assert gen(router.url, [5, 6], 3)["meta_info"]["weight_version"] == "rollout-3"
