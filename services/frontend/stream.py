"""One request's tokens as they arrive: subscribed before the job is submitted, put back in order,
stale attempts dropped, bounded in time, and the responsible worker watched.

Workers publish indexed ``TokenEvent``s on the request's own subject; NATS may deliver them out of
order, twice (a resumed attempt), or not at all (a worker that died). ``tokens()`` yields the current
attempt's tokens exactly once each, in index order within each choice, and raises:

- ``WorkerLost`` when the worker named in the events is gone (``Directory.watching``) or reports a
  server error: the request can continue elsewhere;
- ``ServiceError`` 504 when no token comes in time, 503 when the bus is gone, or a worker's own 4xx.

Messages are decoded as they arrive (the subscription's callback) into an inbox the consumer reads
without a task per token (nats-py's ``next_msg`` made two tasks and a uuid for every message), and
``ready`` says whether the next token is already there, so the HTTP side can write what is at hand at
once (``services.frontend.app``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from shared.bus.directory import Directory
from shared.errors import ServiceError
from shared.messages import ProtocolError, unpack
from shared.messages.stream import TokenEvent

POLL = 0.5  # seconds between checks of the bus, the timeouts and the watched worker


class WorkerLost(Exception):
    """The worker producing this request's tokens failed or disappeared; it may be resumed elsewhere."""


class TokenStream:
    def __init__(self, nc, subject: str, directory: Directory, token_timeout: float):
        self.nc = nc
        self.subject = subject
        self.directory = directory
        self.token_timeout = token_timeout  # seconds without progress: to the first token, between two
        self.attempt = ""  # the id the current attempt runs under on the workers
        self.received: dict[int, int] = {}  # choice -> output tokens delivered so far, across attempts
        self._sub = None
        self._inbox: deque[TokenEvent | ProtocolError] = deque()  # arrived, not yet read by ``tokens``
        self._waiter: asyncio.Future | None = None  # ``tokens`` waiting for the next arrival
        self._worker = ""  # the instance watched: named by the latest event, or the one submitted to
        self._gone: asyncio.Event | None = None

    async def open(self) -> None:
        """Subscribe; call before the job that produces the tokens is submitted."""
        self._sub = await self.nc.subscribe(self.subject, cb=self._arrive)

    async def _arrive(self, msg) -> None:
        try:
            self._inbox.append(unpack(TokenEvent, msg.data))
        except ProtocolError as err:  # raised where the consumer reads it
            self._inbox.append(err)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self) -> TokenEvent | None:
        """The next arrival, or None after ``POLL`` seconds without one."""
        if not self._inbox:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(POLL, lambda: waiter.done() or waiter.set_result(None))
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._inbox:
                return None
        item = self._inbox.popleft()
        if isinstance(item, ProtocolError):
            raise item
        return item

    def ready(self) -> bool:
        """Whether ``tokens`` has its next token (or the error that ends it) at hand, with no wait: arrivals
        it would skip (a superseded attempt's, a repeat) are dropped here; one ahead of its turn is not ready."""
        while self._inbox:
            head = self._inbox[0]
            if isinstance(head, ProtocolError):
                return True
            if head.request_id == self.attempt:
                if head.error is not None:
                    return True
                delivered = self.received.get(head.choice, 0)
                if head.index >= delivered:
                    return head.index == delivered
                self._follow(head.worker)  # as ``tokens`` does with a repeat
            self._inbox.popleft()
        return False

    def expect(self, attempt: str, worker: str) -> None:
        """Tokens now come from ``attempt``, first from ``worker`` (each event may name a later one)."""
        self.attempt = attempt
        self._follow(worker)

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        pending: dict[tuple[int, int], TokenEvent] = {}
        last_progress = time.monotonic()
        while True:
            event = await self._next()
            if event is None:
                self._check(time.monotonic() - last_progress, self.token_timeout)
                continue
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
