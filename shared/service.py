"""The lifecycle every service shares: start → ready → drain → stop.

A service connects to NATS, registers with the NATS service API (``nats.micro``: name, version,
endpoints, stats; ``nats micro ls`` lists every instance), serves its queue group, and on SIGTERM or
SIGINT leaves the queue group first (no new work), lets in-flight work finish, then exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import nats.micro
from nats.aio.client import Client
from nats.micro.service import Service

from shared import __version__
from shared.bus import Subjects, connect, leave_endpoints
from shared.health import READY, start_health
from shared.logging import configure_logging, get_logger

log = get_logger(__name__)


class ServiceBase:
    """Subclasses set ``kind`` and ``description`` and implement ``setup``; ``drain``/``close``/``stats`` optional."""

    kind = "service"
    description = ""

    def __init__(self, settings):
        self.settings = settings
        self.subjects = Subjects(settings.subject_prefix)
        self.instance = uuid.uuid4().hex[:12]
        self.nc: Client | None = None
        self.service: Service | None = None
        self.stopping = asyncio.Event()
        self.state = "starting"  # → ready → draining → stopped; what GET /ready reports (shared.health)

    async def setup(self, nc: Client) -> None:
        """Load models, start workers and the data plane: everything needed before taking work."""
        raise NotImplementedError

    async def serve(self, service: Service) -> None:
        """Add the endpoints (join the queue groups). Called once setup is done, so a listed service is ready."""

    async def stop_intake(self) -> None:
        """Stop taking new work: by default leave every queue group (requests already delivered here are
        still handled). A service whose in-flight work still needs some endpoints (decode: KV chunks and
        starts) leaves only its intake."""
        await leave_endpoints(self.service)

    async def drain(self) -> None:
        """Wait for in-flight work; called after ``stop_intake``."""

    async def close(self) -> None:
        """Release resources (engine threads, data plane)."""

    def stats(self) -> dict:
        """Service-specific figures, served in the NATS service API's stats (``data`` of each endpoint)."""
        return {}

    def metadata(self) -> dict[str, str]:
        meta = {"instance": self.instance, "prefix": self.subjects.prefix, "pid": str(os.getpid())}
        plane = getattr(self, "plane", None)
        if plane is not None and plane.address:
            meta["data"] = plane.address  # where this instance's data plane listens (operators, tests)
        return meta

    async def start(self) -> None:
        self.nc = await connect(self.settings, f"epd-{self.kind}-{self.instance}")
        await self.setup(self.nc)
        self.service = await nats.micro.add_service(
            self.nc, name=f"epd-{self.kind}", version=__version__, description=self.description,
            metadata=self.metadata(), stats_handler=lambda _endpoint: self.stats(),
        )
        await self.serve(self.service)
        await self.nc.flush()
        self.state = READY
        log.info("service.ready", kind=self.kind, instance=self.instance, service_id=self.service.id)

    async def stop(self) -> None:
        self.state = "draining"
        if self.service is not None:
            await self.stop_intake()  # no new work reaches this instance
        # Without a bus nothing in flight can finish (no replies, no tokens out): do not wait long for it.
        grace = self.settings.drain_seconds if self.nc is not None and self.nc.is_connected else 1.0
        try:
            await asyncio.wait_for(self.drain(), min(grace, self.settings.drain_seconds))
        except asyncio.TimeoutError:
            log.warning("service.drain_timeout", seconds=grace)
        if self.service is not None:
            await self.service.stop()
        await self.close()
        if self.nc is not None and not self.nc.is_closed:
            try:  # flush what is pending; a bus that is gone (or reconnecting forever) must not hold the exit
                if not self.nc.is_connected:
                    raise ConnectionError("not connected")
                await asyncio.wait_for(self.nc.drain(), 5.0)
            except Exception:
                try:
                    await self.nc.close()
                except Exception:  # the socket is already gone: nothing left to close cleanly
                    pass
        self.state = "stopped"
        log.info("service.stopped", kind=self.kind, instance=self.instance)

    def readiness(self) -> str:
        """``state``, except that a ready service whose NATS connection is down is ``disconnected``."""
        if self.state == READY and not (self.nc is not None and self.nc.is_connected):
            return "disconnected"
        return self.state

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        health = await start_health(self.settings, self.readiness)  # first and last: /live during model loading
        await self.start()
        await self.stopping.wait()
        log.info("service.draining", kind=self.kind, instance=self.instance)
        await self.stop()
        if health is not None:
            await health.stop()
        await _end_leftover_tasks()


async def _end_leftover_tasks(timeout: float = 2.0) -> None:
    """Cancel what is still running after a stop (library background tasks, e.g. a NATS client that was
    reconnecting when the bus vanished) and exit even if one of them will not end: a stopped service
    must not linger."""
    current = asyncio.current_task()
    leftovers = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in leftovers:
        task.cancel()
    _, pending = await asyncio.wait(leftovers, timeout=timeout) if leftovers else (set(), set())
    if pending:
        log.warning("service.tasks_would_not_end", tasks=sorted(t.get_name() for t in pending))
        import sys

        sys.stderr.flush()
        os._exit(0)


def run_service(service_cls, settings) -> None:
    configure_logging(settings.log_level, settings.log_format, f"epd-{service_cls.kind}")
    asyncio.run(service_cls(settings).run())


def service_main(service_cls, settings_cls, argv: list[str] | None = None) -> None:
    """Entry point of ``python -m services.<kind>`` and ``epd <kind>``: flags → settings → run."""
    import sys

    from shared.settings import parse_settings

    args = sys.argv[1:] if argv is None else argv
    run_service(service_cls, parse_settings(settings_cls, args, f"epd {service_cls.kind}"))
