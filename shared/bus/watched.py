"""A call to one chosen worker that gives up as soon as that worker is gone.

A request delivered to a process that then dies gets no answer: without this the caller would wait out
its whole timeout. While the call runs, the directory watches the instance (NATS's own evidence that
nobody serves it any more); if it goes, the call fails at once with ``gone`` set, and the caller sends
the work elsewhere.
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass

from shared.aio import cancel_until_done
from shared.bus.calls import ServiceCallError, call
from shared.bus.directory import Directory


@dataclass(frozen=True)
class Target:
    """Where a piece of work goes: one instance's own subject, or a queue group (``instance`` empty)."""

    subject: str
    instance: str = ""


class WorkerGone(ServiceCallError):
    def __init__(self, what: str):
        super().__init__(503, f"the {what} went away")


async def call_watched(nc, directory: Directory, target: Target, payload: bytes, timeout: float, what: str) -> bytes:
    request = asyncio.ensure_future(call(nc, target.subject, payload, timeout, what))
    if not target.instance:
        return await request  # a queue group picked someone: nobody in particular to watch
    with directory.watching(target.instance) as gone:
        watcher = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({request, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not request.done():  # the worker is gone, or our caller gave up (a client left)
                await cancel_until_done(request, timeout=5.0)  # nats-py's request can swallow one cancel
        if not request.done() or request.cancelled():
            raise WorkerGone(what)
        return request.result()
