"""Runs an engine in its own thread, fed by the service's asyncio loop.

The asyncio side never touches the engine: it submits commands (``call``), which run between steps
in the engine thread, and receives each step's outputs through ``on_outputs`` on the event loop.
Device work and host syncs happen only in this thread, so the event loop stays free for NATS and the
data plane. Other device work of the process (the aggregated worker's ViT) can be ``attach``ed: it runs
in this thread too, between two engine steps, so the two never contend for the device or the
interpreter. What that work finishes can reach the engine in the same gap (``post`` from this thread
runs at once): the aggregated worker's prompts encoded in place enter the engine before its next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections.abc import Callable

from shared.engine.engine import Engine, StepOutput
from shared.engine.scheduler import BACKLOG_S
from shared.aio import settle
from shared.logging import get_logger

log = get_logger(__name__)

_WAKE = object()  # a command that only ends the idle wait


class EngineLoop:
    def __init__(self, engine: Engine, on_outputs: Callable[[list[StepOutput]], None],
                 on_failure: Callable[[list[str], str], None], loop: asyncio.AbstractEventLoop,
                 on_layer_done: Callable | None = None):
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_failure = on_failure
        self.on_layer_done = on_layer_done
        self.loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        # the creator's context (the service's name that every log line carries) in the thread too
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), name="engine",
                                        daemon=True)
        self._side = None  # has_work() / step(): other device work run between engine steps
        self.steps = 0

    def attach(self, side) -> None:
        """Run ``side.step(budget_s)`` between engine steps whenever ``side.has_work()`` (``budget_s``:
        seconds it may take, None: its own limit — also once ``side.waited_s()``, the wait of what a cut
        held back, passes ``BACKLOG_S``; it fails its own items, never the engine). ``side.wake``
        is set to wake this thread when new side work arrives while the engine idles, and
        ``side.queued_tokens()`` is what the scheduler's budget counts as prompt tokens on their way
        (``Scheduler.upstream``). Call before ``start``."""
        self._side = side
        side.wake = self.wake
        self.engine.scheduler.upstream = side.queued_tokens

    def wake(self) -> None:
        """Any thread: end the engine thread's idle wait now."""
        self._commands.put(_WAKE)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[Engine], object]) -> asyncio.Future:
        """Run ``fn(engine)`` in the engine thread between steps; the future gets its result."""
        future = self.loop.create_future()
        self._commands.put((fn, future))
        return future

    def post(self, fn: Callable[[Engine], None]) -> None:
        """Any thread: run ``fn(engine)`` in the engine thread — at once when called there (the side
        work's completion hooks), else between two steps, in order with ``call``'s commands. Nobody
        waits for it: ``fn`` reports its own failures."""
        if threading.current_thread() is self._thread:
            fn(self.engine)
        else:
            self._commands.put((fn, None))

    def _has_side_work(self) -> bool:
        return self._side is not None and self._side.has_work()

    def _run(self) -> None:
        while not self._stop:
            self._run_commands(block=not (self.engine.has_work() or self._has_side_work()))
            if self._stop:
                continue
            spent = 0.0  # the decoding sequences' next token waits for the side work too
            if self._has_side_work():
                began = time.monotonic()
                # while sequences decode, the side's forwards get what the time budget leaves of their next
                # token, unless the budget yields or an image a cut held back is as late as a late prompt
                late = self._side.waited_s() > BACKLOG_S
                self._side.step(budget_s=None if late else self.engine.scheduler.gap_budget_s())
                spent = time.monotonic() - began
            if self.engine.has_work():
                self._step(spent)

    def _step(self, spent_s: float) -> None:
        try:
            outputs = self.engine.step(self.on_layer_done, spent_s)
            self.steps += 1
        except Exception as err:  # a failed step fails its requests, never the worker
            log.exception("engine.step_failed")
            self._fail_everything(f"engine step failed: {type(err).__name__}")
            return
        if outputs:
            self.loop.call_soon_threadsafe(self.on_outputs, outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:  # None: stop
            self._execute(item)
            item = self._next_command()

    def _execute(self, item) -> None:
        if item is _WAKE:  # it only ended a wait
            return
        fn, future = item
        try:
            result, error = fn(self.engine), None
        except Exception as err:
            if future is None:  # posted: nobody to hand the error to
                log.exception("engine.posted_failed")
                return
            result, error = None, err
        if future is not None:
            self.loop.call_soon_threadsafe(settle, future, result, error)

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _fail_everything(self, message: str) -> None:
        ids = self.engine.request_ids()
        for request_id in ids:
            self.engine.abort(request_id)
        self.loop.call_soon_threadsafe(self.on_failure, ids, message)

