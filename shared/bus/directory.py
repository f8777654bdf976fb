"""Which service instances of a stack exist and what they report: one poller of the NATS service API.

Every instance answers ``$SRV.STATS`` with its metadata (instance id, subject prefix, pid, addresses)
and its own figures (load, cache fingerprint, …). One ``Directory`` per process polls it every
``interval`` seconds; the frontend routes from it, its metrics export it, ``/health`` and ``epd up``
read readiness from it. Whoever needs a kind that is not listed (a worker restarting, a tier scaling up
from zero) ``wait_for``s it: woken by each listing, never polling on its own.

Liveness is asked of NATS itself, not of a listing: ``watching(instance)`` gives an event set once
the instance is gone. One loop pings every watched instance (however many requests wait on it) at its
own service API subject, and only NATS's "no responders" — nobody subscribed any more: the process's
connection is closed, or the service stopped — counts as evidence, twice, a reconnect apart. A slow
worker answers late, and late is not dead: waits stay bounded by the callers' own timeouts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from nats.aio.client import Client

from shared.aio import cancel_until_done
from shared.bus.calls import endpoint_data, ping, service_stats
from shared.logging import get_logger

log = get_logger(__name__)

GONE_CONFIRM_SECONDS = 1.0  # a second "nobody subscribed" this much later: longer than a reconnect
PING_INTERVAL = 0.5


def service_name(kind: str) -> str:
    return f"epd-{kind}"


def kind_of(instance: str) -> str:
    """Instance ids are ``<kind>-<random>``, so a worker named in a token event can be pinged."""
    return instance.rsplit("-", 1)[0]


@dataclass
class _Watch:
    holders: int = 0
    absent_since: float | None = None  # first "no responders" of the current run
    gone: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Instance:
    kind: str  # encoder, prefill, decode, language, aggregated, frontend
    instance: str
    metadata: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)  # the service's own figures (endpoint data)


class Directory:
    def __init__(self, nc: Client, prefix: str, interval: float = 1.0, wait: float = 0.3):
        self.nc = nc
        self.prefix = prefix
        self.interval = interval
        self.wait = wait
        self.instances: list[Instance] = []
        self.raw: list[dict] = []  # the last STATS answers of this stack, for metrics
        self.refreshed = asyncio.Event()  # set after the first listing
        self.seen: set[str] = set()  # every kind listed since this directory started: the stack's layout
        self._listing = asyncio.Event()  # set, then replaced, at every listing: wakes the ``wait_for``s
        self._watched: dict[str, _Watch] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self, listing: bool = True) -> None:
        """Poll the listing and ping watched instances; ``listing=False``: only the pings (a worker
        that watches others and routes nothing)."""
        self._tasks = [asyncio.create_task(self._ping_forever(), name="liveness")]
        if listing:
            self._tasks.append(asyncio.create_task(self._refresh_forever(), name="directory"))

    async def stop(self) -> None:
        await cancel_until_done(*self._tasks, timeout=5.0)  # their NATS requests can swallow one cancel

    def of(self, *kinds: str) -> list[Instance]:
        """Listed instances of ``kinds`` that take new work (not draining)."""
        return [i for i in self.instances if i.kind in kinds and not i.data.get("draining")]

    def counts(self) -> dict[str, int]:
        return _counts(self.raw)

    async def wait_for(self, kinds: tuple[str, ...], timeout: float,
                       accept: Callable[[Instance], bool] = lambda _: True) -> list[Instance]:
        """``of(*kinds)`` that ``accept``, waiting up to ``timeout`` seconds for a listing that shows one
        (empty if none did)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (found := [i for i in self.of(*kinds) if accept(i)]) and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._listing.wait(), left)
            except asyncio.TimeoutError:
                pass
        return found

    async def refresh(self, enough: Callable[[dict[str, int]], bool] | None = None) -> list[Instance]:
        """List this stack's instances (every answer within ``wait``); ``enough``: stop listening once the
        counts by kind so far satisfy it (``epd up`` waiting for the instances it started)."""
        check = None if enough is None else (lambda stats: enough(_counts(self._mine(stats))))
        mine = self._mine(await service_stats(self.nc, wait=self.wait, enough=check))
        self.raw = mine
        self.instances = sorted((Instance(s["name"][4:], s.get("id", ""), s.get("metadata") or {}, endpoint_data(s))
                                 for s in mine), key=lambda i: i.instance)
        self.seen.update(i.kind for i in self.instances)
        self.refreshed.set()
        listing, self._listing = self._listing, asyncio.Event()
        listing.set()
        return self.instances

    def _mine(self, stats: list[dict]) -> list[dict]:
        return [s for s in stats
                if (s.get("metadata") or {}).get("prefix") == self.prefix and str(s.get("name", "")).startswith("epd-")]

    def watch(self, instance: str) -> asyncio.Event:
        """An event set once ``instance`` is gone; ``unwatch`` it when no longer waiting on it."""
        watch = self._watched.get(instance)
        if watch is None:
            watch = self._watched[instance] = _Watch()
        watch.holders += 1
        return watch.gone

    def unwatch(self, instance: str) -> None:
        watch = self._watched.get(instance)
        if watch is not None:
            watch.holders -= 1
            if watch.holders <= 0:
                del self._watched[instance]

    @contextmanager
    def watching(self, instance: str):
        """``watch`` for as long as the block runs."""
        try:
            yield self.watch(instance)
        finally:
            self.unwatch(instance)

    async def _ping_forever(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL)
            watched = [(i, w) for i, w in self._watched.items() if not w.gone.is_set()]
            if watched and self.nc.is_connected:
                await asyncio.gather(*(self._check(i, w) for i, w in watched), return_exceptions=True)

    async def _check(self, instance: str, watch: "_Watch") -> None:
        answered = await ping(self.nc, service_name(kind_of(instance)), instance, self.wait)
        now = time.monotonic()
        if answered is not False:
            watch.absent_since = None
        elif watch.absent_since is None:
            watch.absent_since = now
        elif now - watch.absent_since >= GONE_CONFIRM_SECONDS:
            log.warning("directory.instance_gone", instance=instance)
            watch.gone.set()

    async def _refresh_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                if self.nc.is_connected:
                    await self.refresh()
            except Exception as err:  # discovery is an optimization: callers fall back to queue groups
                log.warning("directory.refresh_failed", error=str(err))
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def _counts(stats: list[dict]) -> dict[str, int]:
    """Instances by kind in STATS answers of ``epd-<kind>`` services."""
    found: dict[str, int] = {}
    for s in stats:
        kind = s["name"][4:]
        found[kind] = found.get(kind, 0) + 1
    return found
