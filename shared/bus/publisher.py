"""Publishing from the engine thread's callbacks, in order, and remembering cancelled requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.client import Client

from shared.aio import cancel_until_done
from shared.bus.subjects import Subjects
from shared.logging import get_logger
from shared.messages.control import cancelled_request

log = get_logger(__name__)


class Publisher:
    """Publishes from synchronous callbacks (engine outputs) in order, through one watched task."""

    def __init__(self, nc: Client):
        self.nc = nc
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="publisher")
        self.failures = 0

    def publish(self, subject: str, payload: bytes) -> None:
        self._queue.put_nowait((subject, payload))

    async def _run(self) -> None:
        while True:
            subject, payload = await self._queue.get()
            try:
                await self.nc.publish(subject, payload)
            except Exception as err:  # connection lost: the stream's reader times out and reports it
                self.failures += 1
                log.warning("publish.failed", subject=subject, error=str(err))
            finally:
                self._queue.task_done()

    async def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (unless the bus is gone), then stop."""
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self._queue.join(), timeout)
            except asyncio.TimeoutError:
                log.warning("publish.unsent", messages=self._queue.qsize())
        if not await cancel_until_done(self._task, timeout=timeout):  # a cancel mid-publish can be swallowed
            log.warning("publish.would_not_stop")


class CancelRegistry:
    """Request ids cancelled recently, so work for them that arrives late is dropped, not started."""

    def __init__(self, ttl: float = 120.0, limit: int = 100_000):
        self.ttl = ttl
        self.limit = limit
        self._seen: dict[str, float] = {}

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._seen[request_id] = now
        if len(self._seen) > self.limit:
            cutoff = now - self.ttl
            self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seen


async def listen_for_cancels(nc: Client, subjects: Subjects, on_cancel: Callable[[str], None]):
    """Call ``on_cancel(request_id)`` (on the event loop) for every ``Cancel`` broadcast; returns the
    subscription."""

    async def handle(msg) -> None:
        request_id = cancelled_request(msg.data)
        if request_id is not None:
            on_cancel(request_id)

    return await nc.subscribe(subjects.cancel, cb=handle)
