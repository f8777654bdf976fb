"""Which encoder/prefill/decode instances are alive, as the NATS service API lists them (refreshed each second).

A request's tokens come from one worker at a time; if that worker disappears from two consecutive
listings taken after the request started depending on it, the worker is gone (killed, crashed, host
lost) and the request is resumed elsewhere instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from shared.bus import Subjects, service_stats
from shared.logging import get_logger

log = get_logger(__name__)

WATCHED = ("epd-encoder", "epd-prefill", "epd-decode", "epd-aggregated")


class LiveWorkers:
    def __init__(self, nc, subjects: Subjects, interval: float = 1.0):
        self.nc = nc
        self.subjects = subjects
        self.interval = interval
        self._listings: deque[tuple[float, set[str]]] = deque(maxlen=4)  # (taken at, instances)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever(), name="live-workers")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def gone(self, instance: str, since: float) -> bool:
        """Absent from the last two listings taken after ``since`` (time.monotonic())."""
        recent = [ids for taken, ids in self._listings if taken > since]
        return len(recent) >= 2 and all(instance not in ids for ids in recent[-2:])

    async def refresh(self) -> None:
        taken = time.monotonic()
        found: set[str] = set()
        for name in WATCHED:
            for stats in await service_stats(self.nc, name, wait=0.2):
                meta = stats.get("metadata") or {}
                if meta.get("prefix") == self.subjects.prefix and meta.get("instance"):
                    found.add(meta["instance"])
        self._listings.append((taken, found))

    async def _refresh_forever(self) -> None:
        while True:
            try:
                if self.nc.is_connected:
                    await self.refresh()
            except Exception as err:  # liveness is a shortcut; the token timeout still bounds every wait
                log.warning("live_workers.refresh_failed", error=str(err))
            await asyncio.sleep(self.interval)
