"""Small asyncio helpers for handing results from worker threads back to the event loop."""

from __future__ import annotations

import asyncio


def settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter already gave up; call on the event loop's thread."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
