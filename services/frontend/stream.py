"""One request's tokens as they arrive: subscribed before the job is submitted, put back in order,
stale attempts dropped, bounded in time, and the responsible worker watched.

Workers publish indexed ``TokenEvent``s on the request's own subject; NATS may deliver them out of
order, twice (a resumed attempt), or not at all (a worker that died). ``tokens()`` yields the current
attempt's tokens exactly once each, in index order within each choice, and raises:

- ``WorkerLost`` when the worker named in the events is gone (``Directory.watching``) or reports a
  server error: the request can continue elsewhere;
- ``ServiceError`` 504 when no token comes in time, 503 when the bus is gone, or a worker's own 4xx.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shared.bus.directory import Directory
from shared.errors import ServiceError
from shared.messages import unpack
from shared.messages.stream import TokenEvent

POLL = 0.5  # seconds between checks of the bus, the timeouts and the watched worker


class WorkerLost(Exception):
    """The worker producing this request's tokens failed or disappeared; it may be resumed elsewhere."""


class TokenStream:
    def __init__(self, nc, subject: str, directory: Directory, first_token_timeout: float, token_timeout: float):
        self.nc = nc
        self.subject = subject
        self.directory = directory
        self.first_token_timeout = first_token_timeout
        self.token_timeout = token_timeout
        self.attempt = ""  # the id the current attempt runs under on the workers
        self.received: dict[int, int] = {}  # choice -> output tokens delivered so far, across attempts
        self._sub = None
        self._worker = ""  # the instance watched: named by the latest event, or the one submitted to
        self._gone: asyncio.Event | None = None

    async def open(self) -> None:
        """Subscribe; call before the job that produces the tokens is submitted."""
        self._sub = await self.nc.subscribe(self.subject)

    def expect(self, attempt: str, worker: str) -> None:
        """Tokens now come from ``attempt``, first from ``worker`` (each event may name a later one)."""
        self.attempt = attempt
        self._follow(worker)

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        pending: dict[tuple[int, int], TokenEvent] = {}
        last_progress = time.monotonic()
        while True:
            limit = self.first_token_timeout if not self.received else self.token_timeout
            try:
                msg = await self._sub.next_msg(timeout=POLL)
            except asyncio.TimeoutError:
                self._check(time.monotonic() - last_progress, limit)
                continue
            event = unpack(TokenEvent, msg.data)
            if event.request_id != self.attempt:
                continue  # a superseded attempt's late words
            if event.error is not None:
                if event.error.status < 500:
                    raise ServiceError(event.error.status, event.error.message)
                raise WorkerLost(event.error.message)
            self._follow(event.worker)
            choice = event.choice
            if event.index >= self.received.get(choice, 0):
                pending[choice, event.index] = event
            while (choice, self.received.get(choice, 0)) in pending:
                event = pending.pop((choice, self.received.get(choice, 0)))
                self.received[choice] = self.received.get(choice, 0) + len(event.token_ids)
                last_progress = time.monotonic()
                yield event

    def _check(self, silent: float, limit: float) -> None:
        if not self.nc.is_connected:
            raise ServiceError(503, "the message bus is unavailable")
        if self._gone is not None and self._gone.is_set():
            raise WorkerLost(f"worker {self._worker} vanished")
        if silent > limit:
            raise ServiceError(504, "the model stopped producing tokens in time")

    def _follow(self, worker: str) -> None:
        if not worker or worker == self._worker:
            return
        self._unwatch()
        self._worker, self._gone = worker, self.directory.watch(worker)

    def _unwatch(self) -> None:
        if self._worker:
            self.directory.unwatch(self._worker)
            self._worker, self._gone = "", None

    async def close(self) -> None:
        self._unwatch()
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is gone: so is the subscription
                pass
