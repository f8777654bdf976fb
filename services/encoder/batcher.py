"""Batches images from any number of requests into one variable-length ViT forward, in its own thread.

Items are either patches made on CPU, or raw pixels that ``prepare`` turns into patches on the tower's
device right before the forward (GPU preprocessing: only the 8-bit pixels cross to the GPU, an eighth of
the bytes of the float32 patches, which repeat every pixel for both temporal frames).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.encoder.metrics import BatchSizes, RateMeter
from shared.aio import settle
from shared.logging import get_logger
from shared.model.geometry import Grid, grid_tokens
from shared.model.vision import VisionTower

log = get_logger(__name__)


@dataclass
class _Item:
    source: torch.Tensor  # patches [N, patch_dim], or pixels [H, W, 3] uint8 when the batcher prepares them
    grid: Grid
    future: asyncio.Future

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


class VisionBatcher:
    def __init__(self, tower: VisionTower, loop: asyncio.AbstractEventLoop, max_images: int, max_patches: int,
                 prepare: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.tower = tower
        self.prepare = prepare  # pixels on the tower's device → patches; None: items carry patches
        self.loop = loop
        self.max_images = max_images
        self.max_patches = max_patches
        self.device = next(tower.parameters()).device
        self.dtype = next(tower.parameters()).dtype
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._carry: _Item | None = None
        # A stream of its own: in a process that also runs the language model (aggregated), the ViT's
        # kernels would otherwise queue in one stream behind (and between) the engine's prefill and
        # decode steps; here they run beside them. Results are complete before anyone sees them.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="vision", daemon=True)
        self.batches = 0
        self.images = 0
        self.patches = 0
        self.batch_sizes = BatchSizes(max_images)
        self.images_rate = RateMeter()

    @property
    def queued(self) -> int:
        """Images waiting for a ViT forward (read from the loop while the vision thread takes them)."""
        return self._queue.qsize() + (self._carry is not None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def encode(self, source: torch.Tensor, grid: Grid) -> asyncio.Future:
        """Queue one image (its patches, or its pixels with ``prepare``); the future resolves to its
        embeddings ``[tokens, out_dim]``."""
        future = self.loop.create_future()
        self._queue.put(_Item(source, grid, future))
        return future

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            try:
                if self.stream is None:
                    outputs = self._forward(batch)
                else:
                    with torch.cuda.stream(self.stream):
                        outputs = self._forward(batch)
                    self.stream.synchronize()
            except Exception as err:
                log.exception("vision.batch_failed", images=len(batch))
                for item in batch:
                    self.loop.call_soon_threadsafe(settle, item.future, None, err)
                continue
            for item, out in zip(batch, outputs):
                self.loop.call_soon_threadsafe(settle, item.future, out, None)

    def _collect(self) -> list[_Item] | None:
        first = self._carry or self._queue.get()
        self._carry = None
        if first is None:
            return None
        batch, patches = [first], first.patches
        while len(batch) < self.max_images:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            if patches + item.patches > self.max_patches:
                self._carry = item  # starts the next batch
                break
            batch.append(item)
            patches += item.patches
        return batch

    @torch.inference_mode()
    def _forward(self, batch: list[_Item]) -> list[torch.Tensor]:
        if self.prepare is None:
            patches = torch.cat([item.source for item in batch]).to(self.device, self.dtype, non_blocking=True)
        else:
            patches = torch.cat([self.prepare(item.source.to(self.device)) for item in batch])
        grids = [item.grid for item in batch]
        embeds = self.tower(patches, grids)
        sizes = [grid_tokens(g, self.tower.config.merge_size) for g in grids]
        self.batches += 1
        self.images += len(batch)
        self.patches += patches.shape[0]
        self.batch_sizes.observe(len(batch))
        self.images_rate.add(len(batch))
        return list(embeds.split(sizes))

