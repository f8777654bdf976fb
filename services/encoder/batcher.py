"""Batches images from any number of requests into one variable-length ViT forward (their device
inputs: ``vit_inputs``).

Who runs the forwards:
- an encoder process: the batcher's own thread (``start``), blocking on its queue. A request's images
  come as one job each and reach the queue a pixel pull apart, so a forward that took only what was
  queued would run a request's first image alone and the rest in later forwards — and a small
  image's forward is launch-bound (~12 ms for one 448² image on an H200, ~29 ms for ten in one). So
  the batch waits up to ``sibling_wait_s`` for the other images of its requests that the encoder has
  received but not queued yet (``pending``: the encoder counts them), and takes whatever else arrives;
- a process that also runs the language model (aggregated): the engine's thread, which calls ``step``
  between engine steps (``EngineLoop.attach``). One thread then drives the GPU: the ViT waits for at
  most one engine step instead of contending with it for the interpreter and the device. Before each
  engine step it encodes every image queued (in batches bounded by ``max_images`` / ``max_patches``),
  also those that arrive while it does, for up to ``STEP_BUDGET_S``: a queued image holds back its
  whole request's first token, while the decode rows it delays lose one step's worth of time. While
  sequences decode, the engine's time budget bounds the gap instead (``step``'s ``budget_s``: the
  target less their predicted step), each batch cut to what the forward-time model predicts fits
  (``forward_time``), one image at least, unless the budget yields (``Scheduler.yields``: the images
  queued count as prompt tokens on their way, ``queued_tokens``) or an image it held back has waited
  past ``scheduler.BACKLOG_S``. A request's images come as one job each, a data-plane pull apart, so a
  gap that took only what was queued at its start left the rest of the request for the next gap, a
  whole engine step (up to 8,192 tokens, ~230 ms) later. One batch per gap fell further behind (H200
  run 1: 388 ms of queueing per image at 0.8 req/s, image-heavy); everything queued at the gap's start,
  418 ms (run 2). The gap's
  batch also waits up to ``sibling_wait_s`` for its requests' images still being pulled, as the
  vision thread's does: with the engine idle, ten 448² images otherwise went in three or four
  launch-bound forwards as they landed (unloaded, 23 ms of queueing per image and 33 ms per forward
  against 29 ms for all ten in one); the decode rows the wait holds back lose at most that long.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections.abc import Callable

import torch

from services.encoder.forward_time import ForwardTimes
from services.encoder.metrics import BatchSizes, RateMeter, StageTimes
from services.encoder.vit_inputs import Prepare, QueuedImage, device_patches
from shared.aio import settle
from shared.kernels import sdpa
from shared.logging import get_logger
from shared.model.geometry import Grid, grid_tokens
from shared.model.vision import VisionTower

log = get_logger(__name__)

MAX_BATCH_IMAGES = 32  # images in one forward at most (the patches bound it too)
STEP_BUDGET_S = 0.25  # ViT seconds one gap between engine steps may take (two 1080p batches of four)
SIBLING_WAIT_S = 0.005  # how long a forward waits for the rest of a request's images this process has received
SIBLING_POLL_S = 0.001  # how often a batch waiting for a request's images looks whether they are still coming


def _timing_event() -> torch.cuda.Event:
    """An event recorded now on the current stream, for ``elapsed_time``."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class VisionBatcher:
    def __init__(self, tower: VisionTower, loop: asyncio.AbstractEventLoop, max_images: int, max_patches: int,
                 prepare: Prepare | None = None, sibling_wait_s: float = 0.0,
                 pending: Callable[[str], int] = lambda group: 0, mix_patches: int | None = None):
        self.tower = tower
        self.sibling_wait_s = sibling_wait_s
        self.pending = pending  # a request's images received but not queued yet (read from the vision thread)
        self.mix_patches = mix_patches  # past these, a forward holds one request's images only (``_fits``)
        self.prepare = prepare  # pixels on the tower's device → patches; None: items carry patches
        self.loop = loop
        self.max_images = max_images
        self.max_patches = max_patches
        self.device = next(tower.parameters()).device
        self.dtype = next(tower.parameters()).dtype
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[QueuedImage] = []  # taken from the queue, not yet forwarded: they start the next batch
        # language-model tokens of the images queued, and of those forwarded: each counter has one writer
        # (the event loop's ``encode``, the forwarding thread), so their difference reads safely anywhere
        self._tokens_in = self._tokens_out = 0
        self._thread: threading.Thread | None = None
        self.wake: Callable[[], None] = lambda: None  # the engine loop's, once attached to one
        self.forward_times: ForwardTimes | None = None  # the forward-time model (aggregated, with a time budget)
        self._seconds: float | None = None  # what the batch being collected may take (``step``'s budget)
        self.batches = 0
        self.cudnn_shapes = 0  # batch shapes the forwarding thread moved to cuDNN's attention (``sdpa.recurring``)
        self.waited = 0  # batches that waited for a request's other images
        self.images = 0
        self.patches = 0
        self.batch_sizes = BatchSizes(max_images)
        self.images_rate = RateMeter()
        self.times = StageTimes(("queue", "forward", "forward_prep", "forward_launch", "forward_gpu"))

    @property
    def queued(self) -> int:
        """Images waiting for a ViT forward (read from the loop while the vision thread takes them)."""
        return self._queue.qsize() + len(self._held)

    def has_work(self) -> bool:
        return self.queued > 0

    def queued_tokens(self) -> int:
        """Language-model tokens of the images waiting for a forward: prompt tokens on their way to the
        engine (the aggregated worker's scheduler counts them, ``Scheduler.upstream``)."""
        return max(0, self._tokens_in - self._tokens_out)

    def waited_s(self) -> float:
        """How long the image a gap's cut held back (the oldest queued) has waited; 0: none held."""
        return time.monotonic() - self._held[0].queued_at if self._held else 0.0

    def start(self) -> None:
        """Run forwards in a thread of this batcher's own (an encoder process); returns once that thread
        is warmed (``warm``)."""
        warmed = threading.Event()
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run, warmed),
                                        name="vision", daemon=True)  # its log lines name the service too
        self._thread.start()
        warmed.wait()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)

    def encode(self, source: torch.Tensor, grid: Grid, prepare: Prepare | None = None, group: str = "",
               on_done: Callable[[torch.Tensor], None] | None = None) -> asyncio.Future:
        """Queue one image or video clip (its patches, or its pixels with the batcher's ``prepare`` or its
        own); the future resolves to its embeddings ``[tokens, out_dim]``. A clip's temporal patches
        attend within their frame (Qwen2.5-VL: within windows of it), like any image of the batch.
        ``group``: the request's id, whose other images a batch may wait for. ``on_done``: called with
        the embeddings in the thread that ran the forward, before the future settles on the event loop
        (the aggregated worker places them into a waiting prompt there, between two engine steps)."""
        future = self.loop.create_future()
        ready = None
        if source.is_cuda:  # the forward's stream reads it only after what made it
            ready = torch.cuda.Event()
            ready.record()
        self._tokens_in += grid_tokens(grid, self.tower.config.merge_size)
        self._queue.put(QueuedImage(source, grid, future, prepare or self.prepare, group, on_done, ready=ready))
        self.wake()
        return future

    def step(self, budget_s: float | None = None) -> None:
        """Batches until nothing is queued, also what arrives meanwhile (the engine thread, between its
        steps), or until the gap's time is spent: the rest waits one engine step. ``budget_s``: the
        seconds the gap may take while sequences decode (their next token waits for it), each batch cut
        to what ``forward_times`` predicts fits in what is left, one image at least; None: up to
        ``STEP_BUDGET_S``, batches as large as the limits allow."""
        paced = budget_s is not None and self.forward_times is not None
        deadline = time.monotonic() + (STEP_BUDGET_S if budget_s is None else budget_s)
        try:
            while True:
                self._seconds = max(0.0, deadline - time.monotonic()) if paced else None
                if not (batch := self._collect(block=False)):
                    break
                self._forward_and_settle(batch)
                if time.monotonic() >= deadline:
                    break
        finally:
            self._seconds = None

    def warm(self) -> int:
        """What the forwarding thread's libraries build on first use, built now, in that thread (call it
        there): cuDNN's bidirectional attention, whose first plan compiles its kernel. Returns how many plans."""
        if self.device.type != "cuda":
            return 0
        started = time.perf_counter()
        config = self.tower.config
        try:
            plans = sdpa.warm_recurring(self.device, self.dtype, config.num_heads, config.head_dim)
        except Exception:  # serving still works: its first promoted shape pays the plan
            log.exception("vision.warm_failed")
            return 0
        log.info("vision.warmed_thread", attention_plans=plans, ms=round((time.perf_counter() - started) * 1e3))
        return plans

    def _run(self, warmed: threading.Event) -> None:
        try:
            self.warm()
        finally:
            warmed.set()
        while (batch := self._collect(block=True)) is not None:
            self._forward_and_settle(batch)

    # -- a forward, waited for ----------------------------------------------------------------------------
    def _forward_and_settle(self, batch: list[QueuedImage]) -> None:
        started = time.monotonic()
        self._tokens_out += sum(grid_tokens(item.grid, self.tower.config.merge_size) for item in batch)
        for item in batch:
            self.times.add("queue", started - item.queued_at)
        timed = self.device.type == "cuda"
        graphed = self.forward_times is not None and self.forward_times.graphed([item.grid for item in batch])
        try:
            begin = _timing_event() if timed else None
            outputs = self._forward(batch)
            queued = time.monotonic()
            if timed:
                end = _timing_event()
                end.synchronize()  # complete before anyone reads them
        except Exception as err:
            log.exception("vision.batch_failed", images=len(batch))
            for item in batch:
                self.loop.call_soon_threadsafe(settle, item.future, None, err)
            return
        self.times.add("forward", time.monotonic() - started, count=len(batch))
        if self.forward_times is not None:
            self.forward_times.observe([item.grid for item in batch], time.monotonic() - started, graphed)
        if timed:  # host-bound when the launch takes the forward's time; else the GPU span says how long
            self.times.add("forward_launch", queued - started, count=len(batch))
            self.times.add("forward_gpu", begin.elapsed_time(end) / 1e3, count=len(batch))
        self.cudnn_shapes = sdpa.promoted()  # this thread's (its plans are its own)
        for item, out in zip(batch, outputs):
            if item.on_done is not None:
                try:
                    item.on_done(out)
                except Exception:  # the hook's own failure: the future still settles, and reports it there
                    log.exception("vision.on_done_failed")
        for item, out in zip(batch, outputs):
            self.loop.call_soon_threadsafe(settle, item.future, out, None)

    @torch.inference_mode()
    def _forward(self, batch: list[QueuedImage]) -> list[torch.Tensor]:
        for item in batch:
            if item.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(item.ready)
        started = time.monotonic()
        patches = torch.cat(device_patches(batch, self.device, self.dtype))
        self.times.add("forward_prep", time.monotonic() - started, count=len(batch))  # host: pixels in, prepared
        grids = [item.grid for item in batch]
        embeds = self.tower(patches, grids)
        self.batches += 1
        self.images += len(batch)
        self.patches += patches.shape[0]
        self.batch_sizes.observe(len(batch))
        self.images_rate.add(len(batch))
        return list(embeds.split([grid_tokens(g, self.tower.config.merge_size) for g in grids]))

    # -- what goes in one forward -------------------------------------------------------------------------
    def _collect(self, block: bool) -> list[QueuedImage] | None:
        """The next batch: up to ``max_images`` and ``max_patches``, what was held back first, waiting for
        its requests' images still on their way; None once stopped (thread mode)."""
        batch, patches = [], 0
        while self._held and len(batch) < self.max_images and (not batch or self._fits(batch, patches, self._held[0])):
            batch.append(self._held.pop(0))
            patches += batch[-1].patches
        if self._held:
            return batch  # what is still held starts the batch after this one
        if not batch:
            try:
                first = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return []
            if first is None:
                return None
            batch = [first]
        self._fill(batch, None)
        if self.sibling_wait_s > 0 and not self._held and self._siblings_coming(batch):
            self.waited += 1
            self._fill(batch, time.monotonic() + self.sibling_wait_s)
        return batch

    def _fill(self, batch: list[QueuedImage], deadline: float | None) -> None:
        """Add queued items while they fit; with a ``deadline``, also wait for more while any request in
        the batch has images on their way."""
        patches = sum(item.patches for item in batch)
        while len(batch) < self.max_images:
            try:
                if deadline is None:
                    item = self._queue.get_nowait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._siblings_coming(batch):
                        # what was queued meanwhile still rides along (the last sibling is queued before
                        # it stops counting as arriving: it may be in the queue already)
                        return self._fill(batch, None)
                    item = self._queue.get(timeout=min(left, SIBLING_POLL_S))  # a sibling may end as a cache hit
            except queue.Empty:
                if deadline is None:
                    return
                continue
            if item is None:
                self._queue.put(None)
                return
            if not self._fits(batch, patches, item):
                self._held.append(item)  # starts the next batch
                return
            batch.append(item)
            patches += item.patches

    def _fits(self, batch: list[QueuedImage], patches: int, item: QueuedImage) -> bool:
        """Whether ``item`` joins ``batch`` (``patches`` so far): within ``max_patches``, and past
        ``mix_patches`` only as one more image of the one request the batch holds. A GPU's forward past its
        graphs (``mix_patches``: ``vision.GRAPH_PATCHES``) runs eagerly, waiting on the host, and gains
        nothing from its size, so two requests' images that do not fit one graph go in two forwards through
        theirs (the first request done first), while a request's own images still ride one forward, as
        the floor measures them. Within a gap's time budget (``step``), only what is predicted to fit it."""
        total = patches + item.patches
        if total > self.max_patches:
            return False
        if self._seconds is not None and batch and \
                self.forward_times.predict([*(other.grid for other in batch), item.grid]) > self._seconds:
            self.forward_times.cut += 1
            return False
        if self.mix_patches is None or total <= self.mix_patches:
            return True
        return bool(item.group) and all(other.group == item.group for other in batch)

    def _siblings_coming(self, batch: list[QueuedImage]) -> bool:
        return any(self.pending(group) > 0 for group in {item.group for item in batch if item.group})
