"""`GET /metrics`: the server's counters in Prometheus' text format (prometheus_client), the names
after vLLM's where one exists: requests, queue depth, batch size, hit / degraded / miss counts,
usable vs logical tokens, recovery latency per state kind, validation failures per layer,
admission refusals, time to first token and inter-token latency.

The cache's own counters (engine/metrics.py) are read at scrape time by a collector, so there is
one source of truth for them; what only the server sees (latencies, outcomes of requests) is
recorded here when a request ends.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from engine.engine import Generation
from engine.scheduler import Scheduler

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = registry = CollectorRegistry()
        self.scheduler = scheduler
        self.requests = Counter("hcw_requests", "requests answered, by endpoint and status", ["endpoint", "status"],
                                registry=registry)
        self.lookups = Counter("hcw_cache_lookups", "prompts looked up in the prefix cache, by outcome "
                               "(hit, degraded, recomputed, miss, off)", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("hcw_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("hcw_generation_tokens", "tokens generated", registry=registry)
        self.logical_tokens = Counter("hcw_logical_hit_tokens", "prompt tokens the prefix index matched",
                                      registry=registry)
        self.usable_tokens = Counter("hcw_usable_hit_tokens", "prompt tokens reused after validation "
                                     "(OpenAI's cached_tokens)", registry=registry)
        self.admission_refusals = Counter("hcw_admission_refusals", "reuses refused by the admission cap "
                                          "(rule 1) and recomputed instead", registry=registry)
        self.ttft = Histogram("hcw_time_to_first_token_seconds", "submit to first token", registry=registry,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("hcw_inter_token_latency_seconds", "between two tokens of one request",
                             registry=registry, buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram("hcw_request_queue_time_seconds", "submit to admission", registry=registry,
                                    buckets=LATENCY_BUCKETS)
        Gauge("hcw_num_requests_waiting", "requests queued for a slot", registry=registry) \
            .set_function(lambda: scheduler.queue_depth)
        Gauge("hcw_num_requests_running", "requests in the running batch", registry=registry) \
            .set_function(lambda: scheduler.batch_size)
        self.batch_size = Histogram("hcw_batch_size", "requests advanced by one decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        registry.register(_CacheCollector(scheduler))

    def finished(self, endpoint: str, result: Generation, token_times: list[float], submitted: float,
                 queue_s: float) -> None:
        self.requests.labels(endpoint, "ok").inc()
        lookup = result.lookup
        self.lookups.labels(lookup.outcome if lookup else "off").inc()
        t = result.timings
        self.prompt_tokens.inc(t.prompt_n)
        self.generation_tokens.inc(t.predicted_n)
        if lookup is not None:
            self.logical_tokens.inc(lookup.plan.logical_tokens)
            self.usable_tokens.inc(lookup.plan.usable_tokens)
            if "admission cap" in lookup.replan_reason:
                self.admission_refusals.inc()
        self.queue_time.observe(queue_s)
        if token_times:
            self.ttft.observe(token_times[0] - submitted)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.observe(b - a)

    def failed(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector:
    """The cache's counters at scrape time (copies: the engine's thread may be writing them)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        cache = self.scheduler.engine.cache
        steps = CounterMetricFamily("hcw_decode_steps", "decode steps run (each advances the whole batch)")
        steps.add_metric([], self.scheduler.steps)
        yield steps
        if cache is None:
            return
        m = cache.metrics
        failures = CounterMetricFamily("hcw_validation_failures", "cache hits given up, by validation layer",
                                       labels=["layer"])
        for layer, n in dict(m.validation_failures).items():
            failures.add_metric([str(layer)], n)
        yield failures
        recoveries = CounterMetricFamily("hcw_recoveries", "missing states recovered, by state kind",
                                         labels=["kind"])
        for kind, n in dict(m.recoveries).items():
            recoveries.add_metric([str(kind)], n)
        yield recoveries
        latency = HistogramMetricFamily("hcw_recovery_seconds", "time to recover a missing state, by state kind",
                                        labels=["kind"])
        for kind, h in dict(m.recovery_ms).items():
            if not h.counts:
                continue
            running, buckets = 0, []
            for bound, count in zip(h.bounds, list(h.counts)):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1000), running))
            latency.add_metric([str(kind)], buckets, h.total / 1000)
        yield latency
        shadow = CounterMetricFamily("hcw_shadow_mismatches", "sampled hits that disagreed with a cold prefill")
        shadow.add_metric([], m.shadow_mismatches)
        yield shadow
        spills = CounterMetricFamily("hcw_disk_spills", "cached segments moved to the disk tier")
        spills.add_metric([], m.spills)
        yield spills
