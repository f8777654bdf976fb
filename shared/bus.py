"""NATS helpers: subjects, connecting, calling a service, and serving an endpoint concurrently."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import Service

from shared.logging import get_logger
from shared.messages import ProtocolError

log = get_logger(__name__)


@dataclass(frozen=True)
class Subjects:
    """Every subject of one stack; the prefix lets several stacks share a NATS server."""

    prefix: str = "epd"

    @property
    def encode(self) -> str:
        return f"{self.prefix}.encode"

    def encode_on(self, instance_id: str) -> str:
        return f"{self.prefix}.encode.{instance_id}"

    @property
    def prefill(self) -> str:
        return f"{self.prefix}.prefill"

    @property
    def decode(self) -> str:
        """Where prefill asks any decode worker for a KV reservation (queue group)."""
        return f"{self.prefix}.decode"

    def decode_kv(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.kv"

    def decode_start(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.start"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    @property
    def chat(self) -> str:
        return f"{self.prefix}.chat"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}.jobs.submit"

    def results(self, job_id: str) -> str:
        return f"{self.prefix}.results.{job_id}"


QUEUE = {"encoder": "encoder", "prefill": "prefill", "decode": "decode", "frontend": "frontend"}


class ServiceCallError(Exception):
    """A service answered with an error, nobody answered, or nobody answered in time."""

    def __init__(self, status: int, message: str, no_responders: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.no_responders = no_responders  # nobody subscribed: retrying the same subject will not help


async def connect(settings, name: str) -> Client:
    client: list[Client] = []

    def closing() -> bool:
        return bool(client) and (client[0].is_draining or client[0].is_closed)

    async def on_error(err: Exception) -> None:
        log.warning("nats.error", error=str(err))

    async def on_disconnect() -> None:
        if not closing():
            log.warning("nats.disconnected")

    async def on_reconnect() -> None:
        log.info("nats.reconnected")

    nc = await nats.connect(
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **settings.nats_options(),
    )
    client.append(nc)
    return nc


async def call(nc: Client, subject: str, payload: bytes, timeout: float, what: str) -> bytes:
    """Request/reply with errors made explicit: 503 when no one serves ``subject``, 504 on timeout."""
    if not nc.is_connected:
        raise ServiceCallError(503, "the message bus is unavailable")
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except NoRespondersError:
        raise ServiceCallError(503, f"no {what} is available", no_responders=True) from None
    except NatsTimeout:
        if not nc.is_connected:  # the bus went away while we waited: not the service's fault
            raise ServiceCallError(503, "the message bus is unavailable") from None
        raise ServiceCallError(504, f"the {what} did not answer within {timeout:g}s") from None
    headers = msg.headers or {}
    if ERROR_CODE_HEADER in headers:
        try:
            status = int(headers[ERROR_CODE_HEADER])
        except ValueError:
            status = 500
        raise ServiceCallError(status, headers.get(ERROR_HEADER, f"{what} failed"))
    return msg.data


class HandlerError(Exception):
    """Raised by a handler to answer with ``status`` and a message the client may see."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ConcurrentEndpoint:
    """A queue-group endpoint whose requests run concurrently, up to ``limit`` at once.

    nats-py runs one subscription's callbacks one after another, so a handler that awaited its work
    would serialize every request of this process. Here the callback only waits for a free slot
    (backpressure) and starts a tracked task; ``drain`` waits for the tasks that are running.
    """

    def __init__(self, name: str, handler: Callable[[bytes], Awaitable[bytes]], limit: int):
        self.name = name
        self.handler = handler
        self.slots = asyncio.Semaphore(limit)
        self.tasks: set[asyncio.Task] = set()
        self.errors = 0
        self.last_error = ""

    async def add_to(self, service: Service, subject: str, queue: str, name: str | None = None) -> None:
        await service.add_endpoint(name=name or self.name, subject=subject, queue_group=queue, handler=self._admit)

    async def _admit(self, request: Request) -> None:
        await self.slots.acquire()
        task = asyncio.create_task(self._run(request), name=f"{self.name}-request")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, request: Request) -> None:
        try:
            reply = await self.handler(request.data)
            await request.respond(reply)
        except HandlerError as err:
            await self._fail(request, err.status, err.message)
        except ProtocolError as err:
            await self._fail(request, 400, str(err))
        except asyncio.CancelledError:
            await self._fail(request, 503, "the request was cancelled or the service is shutting down")
            raise
        except Exception:
            log.exception("endpoint.failed", endpoint=self.name)
            await self._fail(request, 500, "internal error")
        finally:
            self.slots.release()

    async def _fail(self, request: Request, status: int, message: str) -> None:
        self.errors += 1
        self.last_error = message
        try:
            await request.respond_error(str(status), message)
        except Exception:  # the connection may be gone; the caller times out instead
            log.warning("endpoint.reply_failed", endpoint=self.name)

    async def drain(self) -> None:
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


async def leave_endpoints(service: Service, names: set[str] | None = None) -> None:
    """Leave the queue groups of a running nats.micro service's endpoints (``names``; None: all) without
    losing a request: each subscription is drained — the server stops routing to it, and the requests
    it already delivered here are still handled. (The library's own stop unsubscribes, which drops
    them: their callers would wait for their whole timeout. It also only stops every endpoint at once.)
    The service's own API subjects (ping, info, stats) stay until ``service.stop()``."""
    for endpoint in list(service._endpoints):
        if names is not None and endpoint._name not in names:
            continue
        subscription, endpoint._subscription = endpoint._subscription, None
        service._endpoints.remove(endpoint)
        if subscription is None:
            continue
        try:
            await asyncio.wait_for(subscription.drain(), 10)
        except Exception:  # bus gone or closing: nothing more can be delivered anyway
            log.warning("endpoint.drain_failed", endpoint=endpoint._name)


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

    async def close(self) -> None:
        while not self._queue.empty() and not self.nc.is_closed:
            await asyncio.sleep(0.01)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class CancelRegistry:
    """Request ids cancelled recently, so work for them that arrives late is dropped, not started."""

    def __init__(self, ttl: float = 120.0, limit: int = 100_000):
        self.ttl = ttl
        self.limit = limit
        self._seen: dict[str, float] = {}

    def add(self, request_id: str) -> None:
        now = asyncio.get_running_loop().time()
        self._seen[request_id] = now
        if len(self._seen) > self.limit:
            cutoff = now - self.ttl
            self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seen


async def gather_replies(nc: Client, subject: str, wait: float = 0.25, payload: bytes = b"") -> list[bytes]:
    """Every answer to one request within ``wait`` seconds (the NATS service API's discovery pattern)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    replies: list[bytes] = []
    try:
        await nc.publish(subject, payload, reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except asyncio.TimeoutError:
                break
            if msg.data:  # an empty status message means nobody is subscribed
                replies.append(msg.data)
    finally:
        await sub.unsubscribe()
    return replies


async def service_stats(nc: Client, service: str | None = None, wait: float = 0.25) -> list[dict]:
    """STATS of every instance of ``service`` (e.g. ``epd-encoder``), or of every service."""
    import json

    subject = "$SRV.STATS" + (f".{service}" if service else "")
    return [json.loads(r) for r in await gather_replies(nc, subject, wait)]


def endpoint_data(stats: dict) -> dict:
    """A service's own figures in a STATS answer (the ``data`` of its endpoints; every endpoint has the same)."""
    return next((e.get("data") or {} for e in stats.get("endpoints") or [] if e.get("data")), {})
