"""Small asyncio helpers: results handed back from worker threads, tracked background tasks, and a cancel
that is not lost."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from shared.logging import get_logger

log = get_logger(__name__)


def settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter already gave up; call on the event loop's thread."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def cancel_until_done(*tasks: asyncio.Task, timeout: float, every: float = 0.5) -> bool:
    """Cancel ``tasks`` and wait at most ``timeout`` seconds for them to end, cancelling those still running
    every ``every`` seconds: one cancellation can be swallowed. nats-py swallows them: its clean-up after a
    refused connection and its flush both catch ``CancelledError`` (its connect loop then retries forever,
    reproduced: ~1 in 10 cancels landing within 3 ms of the first attempt; a loop around ``publish`` goes
    on to its next message). ``every`` leaves a task's own clean-up on a cancel (a reply, a nak) time to
    finish before the next cancel would interrupt it. True when all ended; their results and errors are the
    caller's to read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    running = {t for t in tasks if not t.done()}
    while running and loop.time() < deadline:
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=min(every, max(0.0, deadline - loop.time())))
        running = {t for t in running if not t.done()}
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error while being cancelled is not "never retrieved"
    return not running


class TaskSet:
    """Background tasks a component starts and must not lose: each is tracked until it ends, a failure
    is logged once with the set's name (an ``expected`` exception type is the caller's business and is
    not), and ``drain``/``cancel`` end them all. ``idle`` is set whenever no task runs."""

    def __init__(self, name: str, expected: tuple[type[BaseException], ...] = ()):
        self.name = name
        self.expected = expected
        self.tasks: set[asyncio.Task] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.failures = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def spawn(self, work: Coroutine, name: str | None = None) -> asyncio.Task:
        task = asyncio.create_task(work, name=name or self.name)
        self.tasks.add(task)
        self.idle.clear()
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self.idle.set()
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, self.expected):
            self.failures += 1
            log.error("task.failed", tasks=self.name, error=repr(error))

    async def drain(self) -> None:
        """Wait for every task running now and every one they start meanwhile."""
        await self.idle.wait()

    async def cancel(self, timeout: float = 5.0) -> None:
        """End every task; one that outlives ``timeout`` seconds of cancels is logged and left behind."""
        if not await cancel_until_done(*self.tasks, timeout=timeout):
            log.warning("task.would_not_end", tasks=self.name, running=len(self.tasks))
