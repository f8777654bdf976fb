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


async def cancel_until_done(task: asyncio.Task, timeout: float, every: float = 0.1) -> bool:
    """Cancel ``task`` and wait at most ``timeout`` seconds for it to end, cancelling again every ``every``
    seconds: one cancellation can be swallowed. nats-py's connect loop is such a task: its clean-up after a
    refused connection catches ``CancelledError`` while it awaits its own tasks, and then retries forever
    (reproduced: ~1 in 10 cancels landing within 3 ms of the first attempt). True when it ended."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=min(every, max(0.0, deadline - loop.time())))
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: a start that failed while it was being cancelled is not an error to log
    return task.done()


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

    async def cancel(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
