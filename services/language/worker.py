"""What every language-model service runs: one ``LanguageWorker``.

It owns the engine (built for the service's role, stepped by its own thread through ``EngineLoop``), the
requests it is responsible for, and what happens to them:

- tokens: each engine output of a tracked request becomes a ``TokenEvent`` on the request's stream
  subject (in order, through one ``Publisher``), naming the worker responsible for what follows;
- cancels: a ``Cancel`` broadcast drops the request from the engine and from here (late work for it is
  refused for a while: ``CancelRegistry``);
- failures: a failed engine step ends each of its requests with an error event, never a silent drop;
- drain: ``drained()`` returns once no tracked request is left;
- images that came without embeddings (their KV in this worker's prefix cache): the engine starts such
  a prompt at once, or it is refused with ``EMBEDDINGS_GONE`` (the frontend then sends every image).

Roles differ only in what they do with a request's outputs and end, which the service passes when it
tracks the request (``Tracked``): decode and joined workers stream every token; prefill hands off after
the first. Prefill, decode, language and aggregated are thin compositions of this and their intake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from shared.bus.publisher import CancelRegistry, Publisher, listen_for_cancels
from shared.bus.subjects import Subjects
from shared.engine.builder import build_engine
from shared.engine.engine import StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.scheduler import PrefixUnavailable
from shared.engine.sequence import Sequence
from shared.engine.warmup import warm_steps, warm_thread
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import pack
from shared.messages.prefill import EMBEDDINGS_GONE
from shared.messages.stream import TokenEvent, TokenLogprob, error_event

log = get_logger(__name__)


@dataclass
class Tracked:
    """A request this worker is responsible for."""

    stream: str  # subject its events go to
    responsible: str  # instance named in its token events (the frontend watches that one)
    on_output: Callable[[StepOutput], None] | None = None  # instead of publishing each token (prefill)
    on_end: Callable[[str], None] | None = None  # once it leaves this worker, with the reason
    choices: int = 1  # choices still generating here: the request leaves when the last finishes


class LanguageWorker:
    def __init__(self, settings, role: str, subjects: Subjects, instance: str, on_layer_done=None):
        self.settings = settings
        self.role = role
        self.subjects = subjects
        self.instance = instance
        self.on_layer_done = on_layer_done
        self.requests: dict[str, Tracked] = {}
        self.cancelled = CancelRegistry()
        self.on_cancel: list[Callable[[str], None]] = []  # the service's own bookkeeping (reservations)
        self.engine = None
        self.config = None
        self.loop: EngineLoop | None = None
        self.publisher: Publisher | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.tokens = 0
        self.failed = 0
        self.images_cached = 0  # image inputs of queued prompts that came without embeddings (KV cached here)
        self.prefix_refused = 0  # prompts with such images refused (their KV not cached, or no room at once)
        self.attention_plans = 0  # planned in the engine thread at start (shared.kernels.sdpa)

    async def start(self, nc, resources: AsyncExitStack, side=None) -> None:
        """Build the engine (in a thread: loading takes a while) and start stepping it; ``side``: other
        device work to run between engine steps (the aggregated worker's ViT batcher)."""
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, self.role)
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop(),
                               on_layer_done=self.on_layer_done)
        if side is not None:
            self.loop.attach(side)
        self.loop.start()
        resources.push_async_callback(asyncio.to_thread, self.loop.stop)
        # the engine thread's own library state (cuDNN's attention plans), before any request; then the
        # serving's step shapes (the step-time model's first fit where it has a budget), on what was just warmed
        self.attention_plans = await self.loop.call(warm_thread)
        if side is not None:  # the ViT's forwards run in this thread too
            await self.loop.call(lambda _engine: side.warm())
        await self.loop.call(warm_steps)
        self.publisher = Publisher(nc)
        resources.push_async_callback(self.publisher.close)
        subscription = await listen_for_cancels(nc, self.subjects, self.cancel)
        resources.push_async_callback(subscription.unsubscribe)

    # -- requests ---------------------------------------------------------------------------------
    def track(self, request_id: str, tracked: Tracked) -> None:
        self.requests[request_id] = tracked
        self._idle.clear()

    def end(self, request_id: str, reason: str) -> Tracked | None:
        """The request leaves this worker (finished, handed off, cancelled, failed)."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None and tracked.on_end is not None:
            tracked.on_end(reason)
        if not self.requests:
            self._idle.set()
        return tracked

    async def add_prompt(self, seq: Sequence, tracked: Tracked) -> float:
        """Track ``seq`` and queue its prompt; a prompt the engine refuses is a 400. Returns when (monotonic)
        the engine thread took it: after the step it was running then."""

        def add(engine) -> float:
            engine.add_prompt(seq)
            return time.monotonic()

        self.track(seq.request_id, tracked)
        try:
            taken = await self.loop.call(add)
        except (ValueError, PrefixUnavailable) as err:
            self.end(seq.request_id, "refused")
            raise self._refusal(err) from None
        self.images_cached += sum(1 for image in seq.images if image.embeds is None)
        return taken

    def check_cached(self, seq: Sequence) -> None:
        """For a prompt queued later (the aggregated worker's, once its other images are encoded): refused
        now if the prefix cache does not hold its images without embeddings (a read from the event loop;
        checked again when it is queued)."""
        try:
            self.engine.scheduler.cached_prefix(seq)
        except PrefixUnavailable as err:
            raise self._refusal(err) from None
        self.images_cached += sum(1 for image in seq.images if image.embeds is None)

    def _refusal(self, err: Exception) -> ServiceError:
        if isinstance(err, PrefixUnavailable):
            self.prefix_refused += 1
            return ServiceError(EMBEDDINGS_GONE, "images sent without their embeddings cannot start here now: "
                                                 "send their embeddings")
        return ServiceError(400, str(err))

    async def drained(self) -> None:
        await self._idle.wait()

    # -- engine → streams (event loop) ------------------------------------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None:
                continue  # cancelled while the step ran
            if tracked.on_output is not None:
                tracked.on_output(out)
                continue
            self.publish_token(out, tracked)
            if out.finish_reason is not None:
                self.finish_choice(out.request_id, out.finish_reason)

    def publish_token(self, out: StepOutput, tracked: Tracked) -> None:
        self.tokens += 1
        lp = out.logprobs
        logprobs = None if lp is None else [TokenLogprob(lp.logprob, lp.top_ids, lp.top_logprobs)]
        event = TokenEvent(request_id=out.request_id, index=out.index, token_ids=[out.token], choice=out.seq.choice,
                           logprobs=logprobs, finish_reason=out.finish_reason, worker=tracked.responsible,
                           cached_tokens=out.cached_tokens)
        self.publisher.publish(tracked.stream, pack(event))

    def finish_choice(self, request_id: str, reason: str) -> None:
        """One of the request's choices finished here; the request ends with its last."""
        tracked = self.requests.get(request_id)
        if tracked is not None:
            tracked.choices -= 1
            if tracked.choices <= 0:
                self.end(request_id, reason)

    def fail(self, request_id: str, status: int, message: str) -> None:
        """End the request with an error event (the frontend resumes it elsewhere on a 5xx)."""
        tracked = self.end(request_id, "failed")
        if tracked is not None:
            self.failed += 1
            self.publisher.publish(tracked.stream, pack(error_event(request_id, status, message, self.instance)))

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            self.fail(request_id, 500, f"{self.role} failed")

    # -- cancels ----------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """Every worker hears every cancel; the engine ignores ids it does not hold."""
        self.cancelled.add(request_id)
        self.end(request_id, "cancelled")
        for hook in self.on_cancel:
            hook(request_id)
        self.loop.call(lambda engine: engine.abort(request_id))  # its blocks (or reservation), now

    def refuse_cancelled(self, request_id: str) -> None:
        if request_id in self.cancelled:
            raise ServiceError(499, "request was cancelled")

    def stats(self) -> dict:
        # running: every request this worker holds (the routers' load); waiting: those of them still
        # queued in the engine for their prefill (vllm:num_requests_waiting)
        waiting = len(self.engine.scheduler.waiting) if self.engine else 0
        step_times = self.engine.step_times.stats() if self.engine and self.engine.step_times else {}
        return {**(self.engine.block_stats() if self.engine else {}),
                **(self.engine.timing_stats() if self.engine else {}), **step_times, "running": len(self.requests),
                "waiting": waiting,
                "tokens": self.tokens, "requests_failed": self.failed, "attention_plans": self.attention_plans,
                "images_cached": self.images_cached, "prefix_refused": self.prefix_refused}
