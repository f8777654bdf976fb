"""Prometheus metrics of the frontend, plus the figures of every service gathered over NATS."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.bus.calls import endpoint_data

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontendMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("epd_requests", "finished requests by outcome", ["outcome"], registry=self.registry)
        self.ttft = Histogram("epd_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("epd_request_seconds", "request latency, admission to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stage = Histogram("epd_stage_seconds", "time per stage: media (fetch and decode a request's images), "
                               "encode (all its images), first_token (prefill submitted to first token)",
                               ["stage"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("epd_prompt_tokens", "prompt tokens of finished requests", registry=self.registry)
        self.completion_tokens = Counter("epd_completion_tokens", "generated tokens", registry=self.registry)
        self.in_flight = Gauge("epd_requests_in_flight", "requests admitted and not finished", registry=self.registry)
        self.service_stat = Gauge("epd_service_stat", "figures each service instance reports in its NATS stats",
                                  ["service", "instance", "stat"], registry=self.registry)
        self.ignored_fields = Counter("epd_requests_with_ignored_fields", "requests that carried unknown top-level "
                                      "fields, which were ignored (their names are logged)", registry=self.registry)
        self.workers = Gauge("epd_workers", "service instances of this stack the NATS service API lists, by kind",
                             ["kind"], registry=self.registry)

    def observe(self, generation) -> None:
        """Once per generation, when it closes (finished, failed or abandoned)."""
        timing = generation.timing
        self.requests.labels(outcome=generation.outcome or "abandoned").inc()
        if timing.first_token_at is not None:
            self.ttft.observe(timing.first_token_at - timing.arrived)
        self.e2e.observe(time.time() - timing.arrived)
        for stage, seconds in timing.stages.items():
            self.stage.labels(stage=stage).observe(seconds)
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.completion_tokens.inc(generation.completion_tokens)

    def record_services(self, listing: list[dict], counts: dict[str, int]) -> None:
        """``listing``: the stack's NATS service API STATS answers; numeric ``data`` fields become gauges."""
        self.service_stat.clear()
        self.workers.clear()
        for kind, n in counts.items():
            self.workers.labels(kind=kind).set(n)
        for stats in listing:
            name, instance = stats.get("name", ""), stats.get("id", "")
            for key, value in endpoint_data(stats).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.service_stat.labels(service=name, instance=instance, stat=key).set(value)
