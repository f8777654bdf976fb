"""Runs an engine in its own thread, fed by the service's asyncio loop.

The asyncio side never touches the engine: it submits commands (``call``), which run between steps
in the engine thread, and receives each step's outputs through ``on_outputs`` on the event loop.
Device work and host syncs happen only in this thread, so the event loop stays free for NATS and the
data plane. Other device work of the process (the aggregated worker's ViT) can be ``attach``ed: it runs
in this thread too, between two engine steps, so the two never contend for the device or the
interpreter. When that work finishes a request's images, the request's prompt comes back through the
frontend a few milliseconds later, and a step started meanwhile leaves it waiting for that step's whole
length after its images were done. With ``handoff_s`` set the loop hands off: the decode rows first get
the token the ViT held back (a decode-only step, while the prompt travels), then it waits what is left
of ``handoff_s`` for the prompt, which joins the next step. Waiting at once instead, before that decode
step, joined the ViT's pause and the prompt's prefill into one gap between two tokens (H200, Dynamo's
10-image shape: ITL p99 77 → 114 ms). Measured on an H200 without compile stalls, the hand-off gained
nothing (docs/benchmarks.md), so the aggregated worker leaves it off by default.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable

from shared.engine.engine import Engine, StepOutput
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
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._side = None  # has_work() / step(): other device work run between engine steps
        self.handoff_s = 0.0
        self.steps = 0
        self.handoffs = 0  # waits for prompts whose images the side work had just finished
        self.handoffs_missed = 0  # of them, those that ended at handoff_s with a prompt still missing
        self.handoff_seconds = 0.0

    def attach(self, side, handoff_s: float = 0.0) -> None:
        """Run ``side.step()`` between engine steps whenever ``side.has_work()``; it returns the requests
        whose images it finished, and the next engine step waits up to ``handoff_s`` for their prompts.
        ``side.wake`` is set to wake this thread when new side work arrives while the engine idles. Call
        before ``start``."""
        self._side = side
        self.handoff_s = handoff_s
        side.wake = self.wake

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

    def _has_side_work(self) -> bool:
        return self._side is not None and self._side.has_work()

    def _run(self) -> None:
        while not self._stop:
            self._run_commands(block=not (self.engine.has_work() or self._has_side_work()))
            if self._stop:
                continue
            if self._has_side_work():
                finished = self._side.step()  # fails its own items, never the engine
                if finished and self.handoff_s > 0 and self.engine.has_work():
                    self._hand_off(finished)
            if self.engine.has_work():
                self._step()

    def _step(self, decode_only: bool = False) -> None:
        try:
            outputs = self.engine.step(self.on_layer_done, decode_only)
            self.steps += bool(outputs) or not decode_only  # a decode-only step with no rows did nothing
        except Exception as err:  # a failed step fails its requests, never the worker
            log.exception("engine.step_failed")
            self._fail_everything(f"engine step failed: {type(err).__name__}")
            return
        if outputs:
            self.loop.call_soon_threadsafe(self.on_outputs, outputs)

    def _hand_off(self, request_ids: list[str]) -> None:
        """The decode rows' token first, while the prompts of ``request_ids`` travel; then wait for them."""
        deadline = time.monotonic() + self.handoff_s
        self._step(decode_only=True)
        self._await_prompts(request_ids, deadline)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:  # None: stop
            self._execute(item)
            item = self._next_command()

    def _await_prompts(self, request_ids: list[str], deadline: float) -> None:
        """Run commands until the engine holds each of these requests' prompts, or until ``deadline`` (a
        request cancelled meanwhile, or whose prompt went to another worker, costs that wait)."""
        started = time.monotonic()
        missing = {r for r in request_ids if not self.engine.holds(r)}
        while missing and not self._stop:
            left = deadline - time.monotonic()
            try:
                item = self._commands.get(timeout=left) if left > 0 else None
            except queue.Empty:
                item = None
            if item is None:
                break
            self._execute(item)
            missing = {r for r in missing if not self.engine.holds(r)}
        self.handoffs += 1
        self.handoffs_missed += bool(missing)
        self.handoff_seconds += time.monotonic() - started

    def _execute(self, item) -> None:
        if item is _WAKE:  # it only ended a wait
            return
        fn, future = item
        try:
            result, error = fn(self.engine), None
        except Exception as err:
            result, error = None, err
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

