"""The NATS service API (``$SRV`` PING / INFO / STATS, as ``nats micro ls|info|stats`` read it), served
by our own endpoints so that what it reports is true.

nats-py's ``nats.micro`` serves a subscription's requests one after another and counts a request as done
when its handler returns; our handlers hand each request to a task (a worker serves many at once), so its
counters would read zero errors and zero processing time, its stop unsubscribes (dropping requests NATS
already delivered), and it cannot stop one endpoint alone. Here:

- an ``Endpoint`` runs each request in a task of its own, at most ``limit`` at once (the bound is the
  service's backpressure: the next delivery waits in NATS), and counts requests, errors and processing
  time over the whole task;
- errors become the service API's error headers (``ServiceError`` → its status, a malformed message →
  400, anything else → 500 "internal error", logged);
- ``leave`` drains the subscription: the server stops routing to it, and what it already delivered is
  still answered;
- a ``Registration`` answers the ``$SRV`` subjects with the instance id as the service id, so a worker is
  pinged at ``$SRV.PING.<name>.<instance>``, and it subscribes them only after the endpoints: listed
  means served.

The response documents are nats.micro's own dataclasses, so any NATS tooling parses them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.service import EndpointInfo, EndpointStats, ServiceInfo, ServicePing, ServiceStats

from shared.bus.calls import error_headers
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import ProtocolError

log = get_logger(__name__)

LEAVE_TIMEOUT = 10.0  # seconds a drained subscription may take to hand over what was delivered


class Request:
    """One delivered request. A handler returns the reply's bytes, or answers itself (a stream of
    replies) and returns None; ``error_extra`` headers go on an error reply sent on its behalf."""

    def __init__(self, msg: Msg, nc: Client):
        self.msg = msg
        self.nc = nc
        self.data = msg.data
        self.headers = msg.headers or {}
        self.error_extra: dict[str, str] = {}

    async def respond(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        if self.msg.reply:
            await self.nc.publish(self.msg.reply, data, headers=headers)


Handler = Callable[[Request], Awaitable[bytes | None]]
ErrorBody = Callable[[ServiceError], bytes]


class Endpoint:
    def __init__(self, name: str, subject: str, queue: str | None, handler: Handler, limit: int,
                 error_body: ErrorBody = lambda _err: b""):
        self.name = name
        self.subject = subject
        self.queue = queue
        self.handler = handler
        self.error_body = error_body  # the reply's payload beside the error headers
        self.slots = asyncio.Semaphore(limit)
        self.tasks: set[asyncio.Task] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.requests = self.errors = 0
        self.processing_ns = 0
        self.last_error = ""
        self._subscription = None
        self._nc: Client | None = None

    async def start(self, nc: Client) -> None:
        self._nc = nc
        self._subscription = await nc.subscribe(self.subject, queue=self.queue or "", cb=self._admit)

    async def leave(self) -> None:
        """Stop receiving; requests already delivered are still handled."""
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        try:
            await asyncio.wait_for(subscription.drain(), LEAVE_TIMEOUT)
        except Exception:  # bus gone or closing: nothing more can be delivered anyway
            log.warning("endpoint.leave_failed", endpoint=self.name)

    async def drain(self) -> None:
        """Wait until every request taken is answered."""
        await self.idle.wait()

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    async def _admit(self, msg: Msg) -> None:
        await self.slots.acquire()
        task = asyncio.create_task(self._run(Request(msg, self._nc)), name=f"{self.name}-request")
        self.tasks.add(task)
        self.idle.clear()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.slots.release()
        if not self.tasks:
            self.idle.set()

    async def _run(self, request: Request) -> None:
        started = time.perf_counter_ns()
        self.requests += 1
        try:
            reply = await self.handler(request)
            if reply is not None:
                await request.respond(reply)
        except ServiceError as err:
            await self._fail(request, err)
        except ProtocolError as err:
            await self._fail(request, ServiceError(400, str(err)))
        except asyncio.CancelledError:
            await self._fail(request, ServiceError(503, "the request was cancelled or the service is stopping"))
            raise
        except Exception:
            log.exception("endpoint.failed", endpoint=self.name)
            await self._fail(request, ServiceError(500, "internal error"))
        finally:
            self.processing_ns += time.perf_counter_ns() - started

    async def _fail(self, request: Request, err: ServiceError) -> None:
        self.errors += 1
        self.last_error = f"{err.status}: {err.message}"
        try:
            await request.respond(self.error_body(err), {**error_headers(err.status, err.message),
                                                         **request.error_extra})
        except Exception:  # the connection may be gone; the caller times out instead
            log.warning("endpoint.reply_failed", endpoint=self.name)

    def stats(self, data: dict) -> EndpointStats:
        return EndpointStats(name=self.name, subject=self.subject, queue_group=self.queue or "",
                             num_requests=self.requests, num_errors=self.errors, last_error=self.last_error,
                             processing_time=self.processing_ns,
                             average_processing_time=self.processing_ns // max(self.requests, 1), data=data)

    def info(self) -> EndpointInfo:
        return EndpointInfo(name=self.name, subject=self.subject, queue_group=self.queue or "", metadata={})


class Registration:
    """One service instance in the NATS service API: its endpoints and its ``$SRV`` answers."""

    def __init__(self, nc: Client, name: str, instance: str, version: str, description: str,
                 metadata: dict[str, str], stats: Callable[[], dict]):
        self.nc = nc
        self.name = name
        self.instance = instance
        self.version = version
        self.description = description
        self.metadata = metadata
        self.stats_data = stats
        self.endpoints: list[Endpoint] = []
        self.started = datetime.now(timezone.utc).replace(tzinfo=None)
        self._control: list = []

    async def add(self, endpoint: Endpoint) -> None:
        await endpoint.start(self.nc)
        self.endpoints.append(endpoint)

    async def announce(self) -> None:
        """Answer the service API from now on. Listed means served: the server reads one connection's commands
        in order, so it has every endpoint's SUB before the ``$SRV`` ones that list us. (A flush is no barrier
        here: nats-py writes its PING ahead of commands still pending.)"""
        handlers = {"PING": self._ping, "INFO": self._info, "STATS": self._stats}
        for verb, handler in handlers.items():
            for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{self.name}", f"$SRV.{verb}.{self.name}.{self.instance}"):
                self._control.append(await self.nc.subscribe(subject, cb=handler))
        await self.nc.flush()

    async def leave(self, names: set[str] | None = None) -> None:
        """Leave the queue groups of the endpoints ``names`` (None: all); the service stays listed."""
        await asyncio.gather(*(e.leave() for e in self.endpoints if names is None or e.name in names))

    async def drain(self) -> None:
        await asyncio.gather(*(e.drain() for e in self.endpoints))

    async def withdraw(self) -> None:
        """No longer listed (the last step of a stop)."""
        for subscription in self._control:
            try:
                await subscription.unsubscribe()
            except Exception:  # the bus is gone: the server forgot us already
                pass
        self._control.clear()

    def snapshot(self) -> ServiceStats:
        data = self.stats_data()
        return ServiceStats(id=self.instance, name=self.name, version=self.version, metadata=self.metadata,
                            started=self.started, endpoints=[e.stats(data) for e in self.endpoints])

    async def _ping(self, msg: Msg) -> None:
        ping = ServicePing(id=self.instance, name=self.name, version=self.version, metadata=self.metadata)
        await msg.respond(json.dumps(ping.to_dict()).encode())

    async def _info(self, msg: Msg) -> None:
        info = ServiceInfo(id=self.instance, name=self.name, version=self.version, description=self.description,
                           metadata=self.metadata, endpoints=[e.info() for e in self.endpoints])
        await msg.respond(json.dumps(info.to_dict()).encode())

    async def _stats(self, msg: Msg) -> None:
        await msg.respond(json.dumps(self.snapshot().to_dict()).encode())
