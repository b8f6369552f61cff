"""Prometheus metrics of one server instance (its own registry, so servers can run side by side).

Names follow vLLM's (``vllm:`` becomes ``pat:``) so existing dashboards map
over; the layout and switch metrics are pat-engine's own. Layout and switch
values are read from the engine when scraped, so they never drift from it.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pat_engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# switch cost components as the engine's SwitchEvent.costs names them
_COST_PARTS = {"groups": "groups_s", "weights": "weights_s", "kv": "kv_s", "rebuild": "rebuild_s", "graphs": "graphs_s"}


class _EngineCollector(Collector):
    """Current layout and switch history, read from the engine at scrape time."""

    def __init__(self, engine: Any, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        labels = ["model_name"]
        layout = self.engine.layout
        cache = self.engine.prefix_cache_stats()
        for name, value, doc in (("pat:layout_tp", layout.tp, "current tensor-parallel degree"),
                                 ("pat:layout_dp", layout.dp, "current data-parallel degree"),
                                 ("pat:prefix_cache_hit_rate", cache["hit_rate"],
                                  "prompt tokens found in cached KV blocks at admission / prompt tokens looked up"),
                                 ("pat:prefix_cache_cached_blocks", cache["cached_blocks"],
                                  "unreferenced KV blocks kept for later prefix hits (all DP groups)"),
                                 ("pat:kv_blocks_used", cache["used_blocks"], "KV blocks in use (all DP groups)")):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        switches = self.engine.switches
        count = CounterMetricFamily("pat:layout_switches", "layout switches (ok=false: refused or failed)",
                                    labels=labels + ["ok"])
        seconds = CounterMetricFamily("pat:layout_switch_seconds", "time spent switching, by component",
                                      labels=labels + ["component"])
        moved = CounterMetricFamily("pat:layout_switch_bytes", "bytes sent between ranks by switches",
                                    labels=labels + ["kind"])
        for ok in (True, False):
            count.add_metric([self.model_name, str(ok).lower()], sum(1 for s in switches if s.ok is ok))
        seconds.add_metric([self.model_name, "total"], sum(s.seconds for s in switches))
        for part, key in _COST_PARTS.items():
            seconds.add_metric([self.model_name, part], sum(float(s.costs.get(key, 0.0)) for s in switches))
        for kind in ("weight", "kv"):
            moved.add_metric([self.model_name, kind], sum(int(s.costs.get(f"{kind}_bytes_sent", 0)) for s in switches))
        yield from (count, seconds, moved)


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]
        self.running = Gauge("pat:num_requests_running", "requests accepted by this server and not finished",
                             labels, registry=reg)
        self.prompt_tokens = Counter("pat:prompt_tokens", "prompt tokens of finished requests", labels, registry=reg)
        self.generation_tokens = Counter("pat:generation_tokens", "generated tokens of finished requests",
                                         labels, registry=reg)
        self.success = Counter("pat:request_success", "finished requests by finish reason",
                               labels + ["finished_reason"], registry=reg)
        self.rejected = Counter("pat:requests_rejected", "requests refused before reaching the engine",
                                labels + ["reason"], registry=reg)
        self.e2e = Histogram("pat:e2e_request_latency_seconds", "arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.ttft = Histogram("pat:time_to_first_token_seconds", "arrival to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("pat:inter_token_latency_seconds",
                             "time between a request's consecutive tokens: the engine's decode step latency as "
                             "requests see it", labels, buckets=_STEP_BUCKETS, registry=reg)
        self.registry.register(_EngineCollector(engine, model_name))
        self.running.labels(model_name).set(0)

    def observe_step(self, seconds: float, new_tokens: int) -> None:
        if new_tokens > 0:
            per_token = seconds / new_tokens
            for _ in range(new_tokens):
                self.itl.labels(self.model_name).observe(per_token)

    def observe_finished(self, out: RequestOutput) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(len(out.token_ids))
        self.success.labels(m, out.finish_reason or "unknown").inc()
        arrival, first, finish = (out.metrics.get(k) for k in ("arrival_time", "first_token_time", "finish_time"))
        if arrival is not None and finish is not None:
            self.e2e.labels(m).observe(max(0.0, finish - arrival))
        if arrival is not None and first is not None:
            self.ttft.labels(m).observe(max(0.0, first - arrival))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
