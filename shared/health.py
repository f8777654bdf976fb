"""The health endpoint of a service: ``GET /live`` and ``GET /ready``, for Kubernetes probes and compose.

- ``/live``: 200 ``{"status": "alive"}`` whenever the process's event loop answers, from the first line of
  start-up (model loading included) to the last of the drain. A loop that is blocked or dead answers
  nothing, and the probe's timeout restarts the container.
- ``/ready``: 200 ``{"status": "ready"}`` only while the service is registered, taking work and connected
  to NATS; 503 with the state otherwise (``starting``, ``draining``, ``stopped``, ``disconnected``), so
  a load balancer sends nothing to a process that would not serve it.
- anything else: 404.

Plain HTTP/1.1 over asyncio streams, one request per connection. A request whose head exceeds
``MAX_REQUEST_BYTES`` or that does not arrive within ``READ_TIMEOUT`` seconds is dropped: the port may
be reachable by more than the kubelet, so nothing a client sends can hold memory or a task for long.
Listens where the data plane does: loopback unless told otherwise (``--data-host 0.0.0.0`` in a pod, where
the kubelet probes the pod's IP).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from shared.logging import get_logger

log = get_logger(__name__)

MAX_REQUEST_BYTES = 4096  # request line plus headers; a probe sends ~100
READ_TIMEOUT = 5.0  # seconds for the whole request head
READY = "ready"

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}


class HealthServer:
    """``state`` is asked on every ``/ready``: it returns ``"ready"`` or the word that says why not."""

    def __init__(self, host: str, port: int, state: Callable[[], str]):
        self.host = host
        self.port = port  # 0: any free port; the bound one after start()
        self.state = state
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, self.host, self.port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health.listening", url=f"http://{self.host}:{self.port}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def route(self, method: str, path: str) -> tuple[int, str]:
        """(HTTP status, the ``status`` word of the body) for one request."""
        path = path.split("?", 1)[0]
        if method != "GET":
            return 404, "not found"
        if path == "/live":
            return 200, "alive"
        if path == "/ready":
            state = self.state()
            return (200 if state == READY else 503), state
        return 404, "not found"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            status, word = self.route(parts[0], parts[1]) if len(parts) == 3 else (400, "bad request")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()  # too slow, too long or gone: no answer owed
            return
        body = json.dumps({"status": word}).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def start_health(settings, state: Callable[[], str]) -> HealthServer | None:
    """The health server ``settings`` ask for (``health_port``), started on the interface the data plane listens
    on (probes come from where peers do: loopback alone by default, the pod's IP in a pod); None when off."""
    if not settings.health_port:
        return None
    host = "127.0.0.1" if settings.data_host.startswith("ipc://") else settings.data_host
    server = HealthServer(host, settings.health_port, state)
    await server.start()
    return server
