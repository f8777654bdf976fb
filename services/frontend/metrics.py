"""Prometheus metrics of the frontend, plus the figures of every service gathered over NATS."""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    def observe(self, generation, reason: str) -> None:
        self.requests.labels(outcome=reason).inc()
        if generation.first_token_at is not None:
            self.ttft.observe(generation.first_token_at - generation.created)
        self.e2e.observe(time.time() - generation.created)
        for stage, seconds in generation.stages.items():
            self.stage.labels(stage=stage).observe(seconds)
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.completion_tokens.inc(generation.completion_tokens)

    def failed(self, status: int) -> None:
        self.requests.labels(outcome=f"error_{status}").inc()

    def record_service_stats(self, replies: list[bytes]) -> None:
        """``replies``: NATS service API STATS answers (JSON); numeric ``data`` fields become gauges."""
        self.service_stat.clear()
        for raw in replies:
            try:
                stats = json.loads(raw)
            except ValueError:
                continue
            name = stats.get("name", "")
            if not name.startswith("epd-"):
                continue
            for endpoint in stats.get("endpoints") or []:
                for key, value in (endpoint.get("data") or {}).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.service_stat.labels(service=name, instance=stats.get("id", ""), stat=key).set(value)


class Admission:
    """Requests in flight, bounded: a full frontend answers 429 at once instead of queueing."""

    def __init__(self, limit: int, gauge: Gauge):
        self.limit = limit
        self.count = 0
        self.gauge = gauge

    def try_acquire(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        self.gauge.set(self.count)
        return True

    def release(self) -> None:
        self.count -= 1
        self.gauge.set(self.count)
