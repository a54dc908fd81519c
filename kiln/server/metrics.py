"""Prometheus metrics (prometheus-client), in a registry owned by the app, not a global.
Request-level series are updated as outputs flow; engine-level gauges are read at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.engine.llm_engine import LLMEngine
from kiln.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, num_waiting) -> None:
        self.engine, self.num_waiting = engine, num_waiting

    def collect(self):
        st = self.engine.stats()
        gauges = {
            "kiln_num_requests_running": ("sequences running", st.num_running),
            "kiln_num_requests_waiting": ("requests waiting", self.num_waiting()),
            "kiln_kv_cache_usage_ratio": ("fraction of KV blocks in use", st.kv_cache_usage),
            "kiln_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache",
                st.prefix_cache_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        c = CounterMetricFamily("kiln_num_preemptions", "sequences preempted by recompute")
        c.add_metric([], st.num_preemptions)
        yield c
        steps = CounterMetricFamily("kiln_steps", "engine steps by runtime mode", labels=["mode"])
        for mode, n in st.graphs.get("steps", {}).items():
            steps.add_metric([mode], n)
        yield steps
        for name, key, doc in (
            ("kiln_graph_misses", "graph_misses", "steps run eagerly though a graph was planned"),
            ("kiln_recompilations", "recompilations", "torch.compile recompilations after warm-up"),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], st.graphs.get(key, 0))
            yield c
        if st.spec_decode is not None:
            yield from _spec_decode_metrics(st.spec_decode)


def _spec_decode_metrics(spec: dict):
    """vLLM's spec_decode series, as kiln_ counters."""
    for name, key, doc in (
        ("kiln_spec_decode_num_drafts", "num_drafts", "sequence-steps that verified drafts"),
        ("kiln_spec_decode_num_draft_tokens", "num_draft_tokens", "draft tokens verified"),
        ("kiln_spec_decode_num_accepted_tokens", "num_accepted_tokens", "draft tokens accepted"),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], spec[key])
        yield c
    per_pos = CounterMetricFamily(
        "kiln_spec_decode_num_accepted_tokens_per_pos",
        "draft tokens accepted, by position in the draft",
        labels=["position"],
    )
    for position, n in enumerate(spec["accepted_per_position"]):
        per_pos.add_metric([str(position)], n)
    yield per_pos
    for name, key, doc in (
        ("kiln_spec_decode_draft_seconds", "draft_s", "time spent proposing drafts"),
        ("kiln_spec_decode_verify_seconds", "verify_s", "time of the steps that verified drafts"),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], spec[key])
        yield c
    g = GaugeMetricFamily("kiln_spec_decode_acceptance_rate", "accepted / verified draft tokens")
    g.add_metric([], spec["acceptance_rate"])
    yield g


class ServerMetrics:
    def __init__(self, engine: LLMEngine, num_waiting) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kiln_requests", "finished requests by status", ["status"], registry=r
        )
        self.http_responses = Counter(
            "kiln_http_requests",
            "HTTP responses by route, method and status code",
            ["handler", "method", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("kiln_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kiln_inter_token_latency_seconds",
            "time between tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine, num_waiting))

    def observe(self, out: RequestOutput) -> None:
        """Called by the engine loop with every output; counts each request once, at its end."""
        if not out.finished:
            return
        status = "aborted" if any(c.finish_reason == "abort" for c in out.outputs) else "ok"
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_completion_tokens)
        for c in out.outputs:
            m = c.metrics
            if m is None:
                continue
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            for gap in m.inter_token_latencies:
                self.itl.observe(gap)
