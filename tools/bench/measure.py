"""One measurement against a running stack: an ``epd bench`` run, plus where its time went and what the
stack logged about it.

Around the run: the frontend's ``/metrics`` (stage means; the encoders' own split, ``scrape.py``), read
before and once settled after, and the stack's counted log events (resumed requests, retried encode
jobs, workers that died). Readings chain: the one after a measurement is the one before the next, so
nothing happens in between that a measurement would be charged for.
"""

from __future__ import annotations

from tools.bench import scrape
from tools.bench.client import RequestResult
from tools.bench.metrics import request_itl_p99
from tools.bench.runner import bench
from tools.bench.settings import BenchSettings
from tools.bench.stack import StackProcess


class StackMeter:
    def __init__(self, stack: StackProcess):
        self.stack = stack
        self.reading = scrape.Reading()

    async def start(self) -> None:
        self.reading = await scrape.read(self.stack.api)

    async def measure(self, settings: BenchSettings, details: bool = True) -> dict:
        """``epd bench``'s results; with ``details``, plus ``stages_ms`` (frontend, per request),
        ``encoder_ms`` (per image), ``events`` and ``resumed`` over this run, and per request its own p99
        inter-token gap and gap count in place of the gaps (which would make a sweep's JSON huge)."""
        events, compiled = self.stack.counts(), len(self.stack.compiles)
        before = self.reading
        run = await bench(settings)
        ok = [r for r in run["requests"] if r["ok"]]
        encoded = sum(r["images"] + r["videos"] for r in ok)  # the encoders count a clip as one ViT item
        self.reading = await scrape.settled(self.stack.api, before.images_encoded + encoded,
                                            before.requests_seen + len(ok))
        if not details:
            return run
        run["stages_ms"], run["encoder_ms"] = scrape.stage_means(before, self.reading)
        after = self.stack.counts()
        run["events"] = {name: after[name] - events[name] for name in after}
        run["resumed"] = run["events"]["request.resume"]
        run["compiles"] = self.stack.compiles[compiled:]  # Triton compiles during the run (kernel, ms)
        for r in run["requests"]:
            r["itl_p99"], r["itl_count"] = request_itl_p99(as_result(r)), len(r.pop("itl"))
        return run


def as_result(record: dict) -> RequestResult:
    """A request's record (``RequestResult.record()``, gaps possibly dropped) as a ``RequestResult``."""
    return RequestResult(**{k: record[k] for k in RequestResult.__dataclass_fields__ if k in record})
