"""Batches images from any number of requests into one variable-length ViT forward.

Items are either patches made on CPU, or raw pixels that ``prepare`` turns into patches on the tower's
device right before the forward (GPU preprocessing: only the 8-bit pixels cross to the GPU, an eighth of
the bytes of the float32 patches, which repeat every pixel for both temporal frames).

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
  whole request's first token, while the decode rows it delays lose one step's worth of time. A
  request's images come as one job each, a data-plane pull apart, so a gap that took only what was
  queued at its start left the rest of the request for the next gap, a whole engine step (up to 8,192
  tokens, ~230 ms) later. One batch per gap fell further behind (H200 run 1: 388 ms of queueing per
  image at 0.8 req/s, image-heavy); everything queued at the gap's start, 418 ms (run 2). The gap's
  batch also waits up to ``sibling_wait_s`` for its requests' images still being pulled, as the
  vision thread's does: with the engine idle, ten 448² images otherwise went in three or four
  launch-bound forwards as they landed (unloaded, 23 ms of queueing per image and 33 ms per forward
  against 29 ms for all ten in one); the decode rows the wait holds back lose at most that long.
  With ``overlap`` (the aggregated worker's ``--vit-overlap``), an image need not wait for the engine step in
  progress either: once the step's kernels are queued, instead of blocking on its tokens, the engine
  thread looks for queued images until the step ends on the GPU (``launch``, from the sampler's
  ``before_sync``) and launches their forward on a high-priority CUDA stream of its own, whose kernels
  the GPU schedules ahead of the step's. The completion hooks run right after the step
  (``after_step``), so a prompt encoded in place enters the next one, which the engine's stream orders
  after the forward. A batch goes mid-step once its requests' images are all queued, or once it has
  waited ``sibling_wait_s``; while the engine is busy, neither a step nor a gap waits for the rest.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from services.encoder.metrics import BatchSizes, RateMeter, StageTimes
from shared.aio import settle
from shared.kernels import sdpa
from shared.logging import get_logger
from shared.model.geometry import Grid, grid_tokens
from shared.model.vision import VisionTower

log = get_logger(__name__)

STEP_BUDGET_S = 0.25  # ViT seconds one gap between engine steps may take (two 1080p batches of four)
SIBLING_POLL_S = 0.001  # how often a batch waiting for a request's images looks whether they are still coming
LAUNCH_POLL_S = 0.0005  # during an engine step (overlap): how often the engine thread looks for new images


@dataclass
class _Item:
    source: torch.Tensor  # patches [N, patch_dim], or pixels [H, W, 3] uint8 (video: [T, H, W, 3]) to prepare
    grid: Grid
    future: asyncio.Future
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None  # pixels on the device → patches
    group: str = ""  # the request it belongs to: a batch waits for the request's other images (thread mode)
    on_done: Callable[[torch.Tensor], None] | None = None  # called with the embeddings in the forwarding thread
    queued_at: float = field(default_factory=time.monotonic)
    ready: torch.cuda.Event | None = None  # a source on the GPU: made on the queuing thread's stream up to here

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def _timing_event() -> torch.cuda.Event:
    """An event recorded now on the current stream, for ``elapsed_time``."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass
class _Launched:
    """A forward launched during an engine step: its outputs are valid once ``end`` has passed on the GPU
    (no events on CPU, where the forward ran to its end in ``launch``)."""

    batch: list[_Item]
    outputs: list[torch.Tensor]
    started: float
    begin: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def finished(self, block: bool) -> bool:
        if self.end is None:
            return True
        if block:
            self.end.synchronize()
            return True
        return self.end.query()

    def seconds(self) -> float:
        return self.begin.elapsed_time(self.end) / 1e3 if self.end is not None else time.monotonic() - self.started


class VisionBatcher:
    def __init__(self, tower: VisionTower, loop: asyncio.AbstractEventLoop, max_images: int, max_patches: int,
                 prepare: Callable[[torch.Tensor], torch.Tensor] | None = None, sibling_wait_s: float = 0.0,
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
        self._held: list[_Item] = []  # taken from the queue, not yet forwarded: they start the next batch
        self._thread: threading.Thread | None = None
        self.stream: torch.cuda.Stream | None = None  # the vision thread's own (``start``), or ``overlap``'s
        self.overlapping = False  # ``overlap``: forwards also launched during engine steps
        self._launched: list[_Launched] = []  # during the step in progress: hooks wait for ``after_step``
        self._settling: list[_Launched] = []  # hooks done, futures waiting for the GPU to finish
        self.wake: Callable[[], None] = lambda: None  # the engine loop's, once attached to one
        self.batches = 0
        self.cudnn_shapes = 0  # batch shapes the forwarding thread moved to cuDNN's attention (``sdpa.recurring``)
        self.waited = 0  # batches that waited for a request's other images
        self.launched = 0  # batches launched during an engine step (overlap)
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
        return self.queued > 0 or bool(self._settling)

    def overlap(self, high_priority: bool = True) -> None:
        """Engine-thread mode: launch forwards during engine steps too (``launch``), on a CUDA stream of
        their own, by default with a higher priority than the engine's (on CPU the forward runs there and
        then)."""
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device, priority=-1 if high_priority else 0)
        self.overlapping = True

    def start(self, own_stream: bool = False) -> None:
        """Run forwards in a thread of this batcher's own; ``own_stream``: on a CUDA stream of its own too,
        so they overlap an engine's steps in the same process (on the default stream they would queue
        behind them)."""
        if own_stream and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        self._thread = threading.Thread(target=self._run, name="vision", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)

    def encode(self, source: torch.Tensor, grid: Grid, prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
               group: str = "", on_done: Callable[[torch.Tensor], None] | None = None) -> asyncio.Future:
        """Queue one image or video clip (its patches, or its pixels with the batcher's ``prepare`` or its
        own); the future resolves to its embeddings ``[tokens, out_dim]``. A clip's temporal patches
        attend within their frame (Qwen2.5-VL: within windows of it), like any image of the batch.
        ``group``: the request's id, whose other images a batch may wait for. ``on_done``: called with
        the embeddings in the thread that ran the forward, before the future settles on the event loop
        (the aggregated worker places them into a waiting prompt there, between two engine steps)."""
        future = self.loop.create_future()
        ready = None
        if source.is_cuda:  # a forward on another stream reads it only after what made it
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put(_Item(source, grid, future, prepare or self.prepare, group, on_done, ready=ready))
        self.wake()
        return future

    def step(self, budget_s: float = STEP_BUDGET_S, wait: bool = True) -> None:
        """Batches until nothing is queued, also what arrives meanwhile (the engine thread, between its
        steps), or until ``budget_s`` of ViT time is spent: the rest waits one engine step. Then the
        futures of forwards launched during steps that have finished. ``wait``: the engine is idle —
        wait for those, and for a batch's images still on their way; with ``overlap`` and the engine
        busy, such a batch is held for a launch during the next step instead of holding the engine."""
        deadline = time.monotonic() + budget_s
        hold = self.overlapping and not wait
        while (batch := self._collect(block=False, wait=not hold)):
            if hold and self._holding(batch):
                self._held[:0] = batch
                break
            self._forward_and_settle(batch)
            if time.monotonic() >= deadline:
                break
        self._settle_launched(block=wait)

    # -- during an engine step (overlap) ------------------------------------------------------------------
    def launch(self) -> None:
        """The engine thread, its step's kernels queued: until the step ends on the GPU, launch the forward
        of whatever is queued or arrives meanwhile (looking every ``LAUNCH_POLL_S``), except a batch whose
        requests still have images coming (``_holding``: until they are here, for at most
        ``sibling_wait_s``). On CPU the step has ended already: what is queued goes, once."""
        if not self.overlapping:
            return
        if self.stream is None:
            self._launch_queued()
            return
        step_done = torch.cuda.Event()
        step_done.record()  # on the engine's stream, after the step's kernels
        while True:
            self._launch_queued()
            if step_done.query():
                return
            try:
                item = self._queue.get(timeout=LAUNCH_POLL_S)
            except queue.Empty:
                continue
            self._held.append(item)

    def _launch_queued(self) -> None:
        while self.queued:
            batch = self._collect(block=False, wait=False)
            if not batch:
                return
            if self._holding(batch):
                self._held[:0] = batch
                return
            self._launch(batch)

    def _launch(self, batch: list[_Item]) -> None:
        started = self._starting(batch)
        try:
            if self.stream is None:
                self._launched.append(_Launched(batch, self._forward(batch), started))
            else:
                with torch.cuda.stream(self.stream):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    outputs = self._forward(batch)
                    end.record()
                self._launched.append(_Launched(batch, outputs, started, begin, end))
            self.launched += 1
        except Exception as err:  # its own images fail, never the engine's step
            self._failed(batch, err)

    def after_step(self) -> None:
        """The engine thread, its step done: what the engine queues from now on runs after the forwards
        launched during the step, and their completion hooks run (a prompt encoded in place enters)."""
        if not self._launched:
            return
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for launched in self._launched:
            self._hand_over(launched.batch, launched.outputs)
        self._settling.extend(self._launched)
        self._launched.clear()
        self._settle_launched(block=False)

    def _settle_launched(self, block: bool) -> None:
        """Settle the futures of launched forwards that have finished on the GPU (``block``: wait for all)."""
        while self._settling and self._settling[0].finished(block):
            launched = self._settling.pop(0)
            self.times.add("forward", launched.seconds(), count=len(launched.batch))
            if launched.end is not None:
                self.times.add("forward_gpu", launched.seconds(), count=len(launched.batch))
            for item, out in zip(launched.batch, launched.outputs):
                self.loop.call_soon_threadsafe(settle, item.future, out, None)

    # -- a forward, waited for ----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)  # this thread's current stream from now on
        while (batch := self._collect(block=True)) is not None:
            self._forward_and_settle(batch)

    def _forward_and_settle(self, batch: list[_Item]) -> None:
        started = self._starting(batch)
        timed = self.device.type == "cuda"
        try:
            with torch.cuda.stream(self.stream) if self.overlapping and self.stream is not None else nullcontext():
                begin = _timing_event() if timed else None
                outputs = self._forward(batch)
                queued = time.monotonic()
                if timed:
                    end = _timing_event()
                    end.synchronize()  # complete before anyone reads them
        except Exception as err:
            self._failed(batch, err)
            return
        self.times.add("forward", time.monotonic() - started, count=len(batch))
        if timed:  # host-bound when the launch takes the forward's time; else the GPU span says how long
            self.times.add("forward_launch", queued - started, count=len(batch))
            self.times.add("forward_gpu", begin.elapsed_time(end) / 1e3, count=len(batch))
        self._hand_over(batch, outputs)
        for item, out in zip(batch, outputs):
            self.loop.call_soon_threadsafe(settle, item.future, out, None)

    def _starting(self, batch: list[_Item]) -> float:
        started = time.monotonic()
        for item in batch:
            self.times.add("queue", started - item.queued_at)
        return started

    def _failed(self, batch: list[_Item], err: Exception) -> None:
        log.exception("vision.batch_failed", images=len(batch))
        for item in batch:
            self.loop.call_soon_threadsafe(settle, item.future, None, err)

    def _hand_over(self, batch: list[_Item], outputs: list[torch.Tensor]) -> None:
        """Outputs made on this batcher's stream are read on the default stream (the engine's): keep their
        memory from this stream's next allocations until what the default stream queued on them is done;
        then each item's completion hook."""
        self.cudnn_shapes = sdpa.promoted()  # this thread's (its plans are its own)
        if self.stream is not None:
            for out in outputs:
                out.record_stream(torch.cuda.default_stream(self.device))
        for item, out in zip(batch, outputs):
            if item.on_done is not None:
                try:
                    item.on_done(out)
                except Exception:  # the hook's own failure: the future still settles, and reports it there
                    log.exception("vision.on_done_failed")

    def _collect(self, block: bool, wait: bool = True) -> list[_Item] | None:
        """The next batch: up to ``max_images`` and ``max_patches``, what was held back first; None once
        stopped (thread mode). ``wait``: for the batch's requests' images still on their way."""
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
        if wait and self.sibling_wait_s > 0 and not self._held and self._siblings_coming(batch):
            self.waited += 1
            self._fill(batch, time.monotonic() + self.sibling_wait_s)
        return batch

    def _fill(self, batch: list[_Item], deadline: float | None) -> None:
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

    def _fits(self, batch: list[_Item], patches: int, item: _Item) -> bool:
        """Whether ``item`` joins ``batch`` (``patches`` so far): within ``max_patches``, and past
        ``mix_patches`` only as one more image of the one request the batch holds. A GPU's forward past its
        graphs (``mix_patches``: ``EPD_VIT_GRAPH_PATCHES``) runs eagerly, waiting on the host, and gains
        nothing from its size, so two requests' images that do not fit one graph go in two forwards through
        theirs (the first request done first), while a request's own images still ride one forward, as
        the floor measures them."""
        total = patches + item.patches
        if total > self.max_patches:
            return False
        if self.mix_patches is None or total <= self.mix_patches:
            return True
        return bool(item.group) and all(other.group == item.group for other in batch)

    def _holding(self, batch: list[_Item]) -> bool:
        """Overlap: keep ``batch`` back for its requests' images still coming, for at most ``sibling_wait_s``
        from its first item's queuing (as a waiting forward would; a pull that hangs must not hold the
        other requests' images with it)."""
        oldest = min(item.queued_at for item in batch)
        return time.monotonic() - oldest < self.sibling_wait_s and self._siblings_coming(batch)

    def _siblings_coming(self, batch: list[_Item]) -> bool:
        return any(self.pending(group) > 0 for group in {item.group for item in batch if item.group})

    def _patches(self, batch: list[_Item]) -> list[torch.Tensor]:
        """Each item's patches on the device; pixels of one size that one batching ``prepare`` takes
        (``TorchImagePreprocessor``) cross to the device and are prepared together, in one chain of kernels
        instead of one an image (ten 448² images: ~100 launches fewer a forward)."""
        out, i = [], 0
        while i < len(batch):
            item, j = batch[i], i + 1
            if item.prepare is None:
                out.append(item.source.to(self.device, self.dtype, non_blocking=True))
                i = j
                continue
            if getattr(item.prepare, "batches", False):
                while (j < len(batch) and batch[j].prepare is item.prepare
                       and batch[j].source.shape == item.source.shape and batch[j].source.device == item.source.device):
                    j += 1
            out.append(item.prepare(self._together([b.source for b in batch[i:j]])).to(self.dtype))
            i = j
        return out

    def _together(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """Pixels of one size on the device: one image as it is, several stacked ``[n, H, W, 3]``. Host
        pixels (an encoder's pulls) go each straight into its slice of the device's stack: a stack on the
        host would copy them once more, in a parallel region that a busy host stalls (an E/PD encoder under
        a Dynamo-1024 load: 77-86 ms a forward, against 5 for the whole launch one image at a time)."""
        first = sources[0]
        if len(sources) == 1:
            return first.to(self.device)
        if first.device == self.device:
            return torch.stack(sources)
        stacked = torch.empty((len(sources), *first.shape), dtype=first.dtype, device=self.device)
        for slot, source in zip(stacked, sources):
            slot.copy_(source, non_blocking=True)  # pageable: back once staged; pinned: queued
        return stacked

    @torch.inference_mode()
    def _forward(self, batch: list[_Item]) -> list[torch.Tensor]:
        for item in batch:
            if item.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(item.ready)
        started = time.monotonic()
        patches = torch.cat(self._patches(batch))
        self.times.add("forward_prep", time.monotonic() - started, count=len(batch))  # host: pixels in, prepared
        grids = [item.grid for item in batch]
        embeds = self.tower(patches, grids)
        self.batches += 1
        self.images += len(batch)
        self.patches += patches.shape[0]
        self.batch_sizes.observe(len(batch))
        self.images_rate.add(len(batch))
        return list(embeds.split([grid_tokens(g, self.tower.config.merge_size) for g in grids]))
