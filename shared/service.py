"""The lifecycle every service shares: start → ready → drain → stop.

A service connects to NATS (as its role, replies on the role's own inbox), runs ``setup`` (models,
engine threads, data plane: each resource registers its own release in ``self.resources`` as it is
taken, so a setup that fails half-way is unwound, and a stop releases everything in reverse order),
subscribes its endpoints, and only then answers the NATS service API: listed means ready. On SIGTERM
or SIGINT it leaves its intake queue groups (requests NATS already delivered are still answered),
waits for in-flight work (``drain``, bounded by ``--drain-seconds``), withdraws from the service API
and releases its resources.
"""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import signal
import sys
from contextlib import AsyncExitStack

from nats.aio.client import Client

from shared import __version__
from shared.aio import cancel_until_done
from shared.bus.connection import connect
from shared.bus.directory import service_name
from shared.bus.service_api import Endpoint, Registration
from shared.bus.subjects import Subjects
from shared.health import start_health
from shared.logging import configure_logging, get_logger

log = get_logger(__name__)

STATES = ("starting", "ready", "draining", "stopped")


class Service:
    """Subclasses set ``kind`` and ``description``, implement ``setup`` and ``endpoints``; ``intake_endpoints``,
    ``drain``, ``stats`` and ``metadata`` are optional."""

    kind = "service"
    description = ""
    intake_endpoints: set[str] | None = None  # endpoints left first on SIGTERM; None: all of them
    uses_torch = True  # computes with torch (its threads are set at start); the frontend never loads it

    def __init__(self, settings):
        self.settings = settings
        self.subjects = Subjects(settings.subject_prefix)
        self.instance = f"{self.kind}-{secrets.token_hex(6)}"  # the kind first: pingable from the id alone
        self.nc: Client | None = None
        self.registration: Registration | None = None
        self.resources = AsyncExitStack()
        self.stopping = asyncio.Event()
        self.state = "starting"

    # -- what a service provides ------------------------------------------------------------------
    async def setup(self) -> None:
        """Load models, start workers and the data plane: everything needed before taking work."""
        raise NotImplementedError

    def endpoints(self) -> list[Endpoint]:
        return []

    async def on_ready(self) -> None:
        """Work that starts once the service is listed (pulling durable jobs, say)."""

    async def drain(self) -> None:
        """Wait until in-flight work is done (called after leaving the intake queue groups)."""
        await self.registration.drain()

    def stats(self) -> dict:
        """Service-specific figures, served in the NATS service API's stats (``data`` of each endpoint)."""
        return {}

    def metadata(self) -> dict[str, str]:
        meta = {"instance": self.instance, "prefix": self.subjects.prefix, "pid": str(os.getpid())}
        plane = getattr(self, "plane", None)
        if plane is not None and plane.address:
            meta["data"] = plane.address  # where this instance's data plane listens (operators, tests)
        return meta

    async def open_plane(self) -> None:
        """Start this service's data plane (``self.plane``); it stops with the other resources."""
        await self.plane.start()
        self.resources.push_async_callback(self.plane.stop)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.nc is not None and self.nc.is_connected

    def readiness(self) -> str:
        """What the health endpoint's ``/ready`` reports: the state, except that a ready service whose
        NATS connection is down is ``disconnected``."""
        if self.state == "ready" and not self.ready:
            return "disconnected"
        return self.state

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.settings, f"epd-{self.instance}", self.kind)
        self.resources.push_async_callback(self._close_bus)
        await self.setup()
        self.registration = Registration(self.nc, service_name(self.kind), self.instance, __version__,
                                         self.description, self.metadata(), self._listed_stats)
        for endpoint in self.endpoints():
            await self.registration.add(endpoint)
        await self.registration.announce()
        self.state = "ready"
        await self.on_ready()
        log.info("service.ready", kind=self.kind, instance=self.instance, **gpu_memory_taken())

    async def stop(self) -> None:
        self.state = "draining"
        if self.registration is not None:
            await self.registration.leave(self.intake_endpoints)  # no new work reaches this instance
            # Without a bus nothing in flight can finish (no replies, no tokens out): do not wait long.
            grace = self.settings.drain_seconds if self.nc.is_connected else min(1.0, self.settings.drain_seconds)
            try:
                await asyncio.wait_for(self.drain(), grace)
            except asyncio.TimeoutError:
                log.warning("service.drain_timeout", seconds=grace)
            await self.registration.leave()
            await self.registration.withdraw()
        await self.resources.aclose()
        self.state = "stopped"
        log.info("service.stopped", kind=self.kind, instance=self.instance)

    def _listed_stats(self) -> dict:
        # "draining": routers stop choosing this instance before its listing disappears
        return {**self.stats(), "draining": int(self.state == "draining")}

    async def _close_bus(self) -> None:
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        try:  # flush what is pending; a bus that is gone (or reconnecting forever) must not hold the exit
            if not nc.is_connected:
                raise ConnectionError("not connected")
            await asyncio.wait_for(nc.drain(), 5.0)
        except Exception:
            try:
                await nc.close()
            except Exception:  # the socket is already gone: nothing left to close cleanly
                pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # held by `epd up` until now: see processes.py
        health = await start_health(self.settings, self.readiness)  # first and last: /live while models load
        try:
            started = await self._start_unless_stopped()
        except BaseException:
            await self.resources.aclose()  # a setup that failed half-way releases what it took
            raise
        if started:
            await self.stopping.wait()
            log.info("service.draining", kind=self.kind, instance=self.instance)
            await self.stop()
        else:  # told to stop before it was ready (waiting for NATS, loading a model): nothing to drain
            log.info("service.stopped_while_starting", kind=self.kind, instance=self.instance)
            await self.resources.aclose()
            self.state = "stopped"
        if health is not None:
            await health.stop()
        await _end_leftover_tasks()

    async def _start_unless_stopped(self) -> bool:
        """``start()``, abandoned when SIGTERM/SIGINT comes first: a service that cannot reach NATS retries
        the connection forever, and must still obey a stop. False when it was stopped before it started."""
        starting = asyncio.create_task(self.start(), name="start")
        stopped = asyncio.create_task(self.stopping.wait(), name="stop-signal")
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():
            # a start that will not end (a swallowed cancel) is left to _end_leftover_tasks: the stop must not wait
            if not await cancel_until_done(starting, timeout=3.0):
                log.warning("service.start_would_not_end", kind=self.kind, instance=self.instance)
            return False
        starting.result()  # raises why the start failed
        return True


def _out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """Ours (``MemoryError``) and CUDA's (``torch.OutOfMemoryError``, a ``RuntimeError``) where torch is loaded."""
    torch = sys.modules.get("torch")
    return (MemoryError, torch.OutOfMemoryError) if torch is not None else (MemoryError,)


def _out_of_memory(err: BaseException) -> str:
    """One line for an out-of-memory at start: what ran out, and the setting that gives more."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "--" in first:  # our own message already names the setting
        return first
    return (f"{first.split('. Tried')[0]}: out of GPU memory while starting; on a GPU shared with other processes "
            f"lower their share (epd up plans it from --gpu-memory-utilization), or give this one more")


def gpu_memory_taken() -> dict:
    """What this process holds on its GPU, for the ``service.ready`` line: torch's reserved pool and its
    peak (MiB); nothing when the process never initialized CUDA (the frontend, a CPU stack)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {"gpu_mib": round(torch.cuda.memory_reserved() / 2**20),
            "gpu_peak_mib": round(torch.cuda.max_memory_reserved() / 2**20)}


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
        sys.stderr.flush()
        os._exit(0)


def service_main(service_cls, settings_cls, argv: list[str] | None = None) -> None:
    """Entry point of ``python -m services.<kind>`` and ``epd <kind>``: flags → settings → run."""
    from shared.settings import BadSettings, parse_settings

    args = sys.argv[1:] if argv is None else argv
    prog = f"epd {service_cls.kind}"
    try:
        settings = parse_settings(settings_cls, args, prog)
        if settings.model:
            settings.model_path()  # a checkpoint directory or a preset: said before anything starts
    except ValueError as err:  # BadSettings, or the model's: one line, exit status 2 (``epd`` does the same)
        print(err if isinstance(err, BadSettings) else f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)
    configure_logging(settings.log_level, settings.log_format, f"epd-{service_cls.kind}")
    if service_cls.uses_torch:
        settings.apply_torch_threads()
    try:
        asyncio.run(service_cls(settings).run())
    except _out_of_memory_errors() as err:  # the KV pool's sizing, or CUDA's allocator
        log.error("service.out_of_memory", kind=service_cls.kind, error=_out_of_memory(err))
        sys.exit(1)
    finally:
        # Everything is released by now (or the service failed). What is left is the interpreter's
        # shutdown, whose garbage collections walk every object torch and transformers made: 1-1.5 s
        # of CPU per process. Frozen objects are not walked; the process exits in ~0.3 s.
        gc.freeze()
