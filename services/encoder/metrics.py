"""Figures the encoder reports in its NATS stats: batch sizes by bucket and a recent rate.

Both are written by the vision thread and read from the event loop, so each holds a lock.
"""

from __future__ import annotations

import threading
import time


class BatchSizes:
    """Batches counted by size in power-of-two buckets, cumulative like a Prometheus histogram:
    ``batch_size_le_4`` is the number of batches of at most 4 images."""

    def __init__(self, max_images: int):
        self.bounds = [1]
        while self.bounds[-1] < max_images:
            self.bounds.append(self.bounds[-1] * 2)
        self._counts = [0] * len(self.bounds)
        self._lock = threading.Lock()

    def observe(self, images: int) -> None:
        with self._lock:
            for i, bound in enumerate(self.bounds):
                if images <= bound:
                    self._counts[i] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {f"batch_size_le_{b}": c for b, c in zip(self.bounds, self._counts)}


class RateMeter:
    """Events per second over the last ``window`` seconds (whole seconds, so it needs no timer)."""

    def __init__(self, window: int = 10, clock=time.monotonic):
        self.window = window
        self.clock = clock
        self._per_second: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, count: int = 1) -> None:
        now = int(self.clock())
        with self._lock:
            self._per_second[now] = self._per_second.get(now, 0) + count
            if len(self._per_second) > self.window + 1:
                self._prune(now)

    def rate(self) -> float:
        now = int(self.clock())
        with self._lock:
            self._prune(now)
            return sum(self._per_second.values()) / self.window

    def _prune(self, now: int) -> None:
        for second in [s for s in self._per_second if s <= now - self.window]:
            del self._per_second[second]


class StageTimes:
    """Seconds spent per stage, cumulative (``<stage>_seconds_total`` and ``<stage>_count``, as a
    Prometheus summary without quantiles): a reader takes differences between two readings."""

    def __init__(self, stages: tuple[str, ...]):
        self._seconds = dict.fromkeys(stages, 0.0)
        self._counts = dict.fromkeys(stages, 0)
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._seconds[stage] += seconds * count  # each of ``count`` items spent ``seconds`` here
            self._counts[stage] += count

    def stats(self, prefix: str = "") -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {}
            for stage, seconds in self._seconds.items():
                out[f"{prefix}{stage}_seconds_total"] = round(seconds, 6)
                out[f"{prefix}{stage}_count"] = self._counts[stage]
            return out
