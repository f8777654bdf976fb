"""Prometheus metrics of the frontend, plus the figures of every service gathered over NATS.

Two families: ``epd_*`` (ours) and vLLM's names for what exists here, so dashboards and tools built for
vLLM read this stack unchanged (label ``model_name``). Latencies are measured at the frontend (what a
client sees); running, waiting, KV-cache use and prefix-cache figures are summed over the language-model
workers' NATS stats at scrape time.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.bus.calls import endpoint_data

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# vLLM's buckets, so its dashboards' quantiles mean the same here
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
LANGUAGE_KINDS = ("epd-prefill", "epd-decode", "epd-language", "epd-aggregated")


class FrontendMetrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.requests = Counter("epd_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("epd_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("epd_request_seconds", "request latency, admission to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("epd_stage_seconds", "time per stage: media (fetch and decode a request's images), "
                               "encode (all its images, by the encoders), first_token (prefill submitted to first token; "
                               "a worker that encodes in place: its images' encoding too)",
                               ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("epd_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("epd_completion_tokens", "generated tokens", registry=r)
        self.in_flight = Gauge("epd_requests_in_flight", "requests admitted and not finished", registry=r)
        self.service_stat = Gauge("epd_service_stat", "figures each service instance reports in its NATS stats",
                                  ["service", "instance", "stat"], registry=r)
        self.ignored_fields = Counter("epd_requests_with_ignored_fields", "requests that carried unknown top-level "
                                      "fields, which were ignored (their names are logged)", registry=r)
        self.workers = Gauge("epd_workers", "service instances of this stack the NATS service API lists, by kind",
                             ["kind"], registry=r)
        self._vllm_histograms(r)
        self.listing: list[dict] = []
        r.register(WorkerFigures(self))

    def _vllm_histograms(self, r: CollectorRegistry) -> None:
        label = ["model_name"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "time to first token", label,
                                   buckets=_TTFT_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "time between consecutive output tokens",
                                  label, buckets=_TOKEN_BUCKETS, registry=r)
        self.vllm_tpot = Histogram("vllm:request_time_per_output_token_seconds", "per request: (end - first "
                                   "token) / (output tokens - 1)", label, buckets=_TOKEN_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "request latency, arrival to last token",
                                  label, buckets=_E2E_BUCKETS, registry=r)
        self.vllm_prompt = Counter("vllm:prompt_tokens", "prompt tokens of finished requests", label, registry=r)
        self.vllm_generation = Counter("vllm:generation_tokens", "generated tokens", label, registry=r)

    def observe(self, generation) -> None:
        """Once per generation, when it closes (finished, failed or abandoned)."""
        timing, name = generation.timing, self.model_name
        now = time.time()
        self.requests.labels(outcome=generation.outcome or "abandoned").inc()
        if timing.first_token_at is not None:
            self.ttft.observe(timing.first_token_at - timing.arrived)
            self.vllm_ttft.labels(name).observe(timing.first_token_at - timing.arrived)
        self.e2e.observe(now - timing.arrived)
        self.vllm_e2e.labels(name).observe(now - timing.arrived)
        for stage, seconds in timing.stages.items():
            self.stage.labels(stage=stage).observe(seconds)
        ticks = timing.token_times
        for earlier, later in zip(ticks, ticks[1:]):
            self.vllm_itl.labels(name).observe(later - earlier)
        if len(ticks) > 1:
            self.vllm_tpot.labels(name).observe((ticks[-1] - ticks[0]) / (len(ticks) - 1))
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.completion_tokens.inc(generation.completion_tokens)
        self.vllm_prompt.labels(name).inc(generation.prompt_tokens)
        self.vllm_generation.labels(name).inc(generation.completion_tokens)

    def record_services(self, listing: list[dict], counts: dict[str, int]) -> None:
        """``listing``: the stack's NATS service API STATS answers; numeric ``data`` fields become gauges."""
        self.listing = listing
        self.service_stat.clear()
        self.workers.clear()
        for kind, n in counts.items():
            self.workers.labels(kind=kind).set(n)
        for stats in listing:
            name, instance = stats.get("name", ""), stats.get("id", "")
            for key, value in endpoint_data(stats).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.service_stat.labels(service=name, instance=instance, stat=key).set(value)


class WorkerFigures:
    """vLLM's gauges and counters from the language-model workers' latest stats, computed at scrape time."""

    def __init__(self, metrics: FrontendMetrics):
        self.metrics = metrics

    def collect(self):
        workers = [endpoint_data(s) for s in self.metrics.listing if s.get("name") in LANGUAGE_KINDS]
        total = lambda key: sum(w.get(key, 0) or 0 for w in workers)  # noqa: E731
        name = [self.metrics.model_name]
        used, blocks = total("kv_blocks_used"), total("kv_blocks_total")
        for family, metric, help_text, value in (
                (GaugeMetricFamily, "vllm:num_requests_running", "requests in the model workers' engines, past "
                 "their queue", total("running") - total("waiting")),
                (GaugeMetricFamily, "vllm:num_requests_waiting", "requests waiting for their prefill", total("waiting")),
                (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache blocks in use, 0 to 1, over all workers",
                 used / blocks if blocks else 0.0)):
            out = family(metric, help_text, labels=["model_name"])
            out.add_metric(name, value)
            yield out
        if any("cached_prompt_tokens" in w for w in workers):  # workers with prefix caching
            for metric, key, help_text in (("vllm:prefix_cache_queries", "prompt_tokens", "prompt tokens looked up"),
                                           ("vllm:prefix_cache_hits", "cached_prompt_tokens", "prompt tokens found")):
                out = CounterMetricFamily(metric, help_text, labels=["model_name"])
                out.add_metric(name, total(key))
                yield out
