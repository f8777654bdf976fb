"""The encoder: vision tower only. Pulls decoded pixels, batches images across requests through the
ViT, holds the embeddings for prefill to pull, and answers with their handle and the patch grid."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from services.encoder.batcher import VisionBatcher
from services.encoder.settings import EncoderSettings
from shared.bus import QUEUE, ConcurrentEndpoint, HandlerError
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.logging import get_logger
from shared.messages import decode, encode
from shared.messages.encode import EncodeJob, EncodeResult
from shared.model.config import ModelConfig
from shared.model.loader import load_vision_tower
from shared.model.processor import ImagePreprocessor
from shared.service import ServiceBase

log = get_logger(__name__)


class EncoderService(ServiceBase):
    kind = "encoder"
    description = "Vision encoder: pixels in, embedding handles out"

    def __init__(self, settings: EncoderSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.endpoint = ConcurrentEndpoint("encode", self.handle_encode, settings.max_concurrent_jobs)
        self.pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        self.batcher: VisionBatcher | None = None

    async def setup(self, nc) -> None:
        s = self.settings
        path = s.model_path()
        config = ModelConfig.from_checkpoint(path)
        tower = await asyncio.to_thread(load_vision_tower, path, config, s.torch_device(), s.torch_dtype(),
                                        s.load_format)
        self.preprocess = ImagePreprocessor(path)
        self.batcher = VisionBatcher(tower, asyncio.get_running_loop(), s.max_batch_images, s.max_batch_patches)
        self.batcher.start()
        await self.plane.start()

    async def serve(self, service) -> None:
        await self.endpoint.add_to(service, self.subjects.encode, QUEUE["encoder"])
        # this instance's own subject: the frontend routes images here for cache affinity and spread
        await self.endpoint.add_to(service, self.subjects.encode_on(self.instance), QUEUE["encoder"],
                                   name="encode-direct")

    async def handle_encode(self, data: bytes) -> bytes:
        job = decode(EncodeJob, data)
        image = job.image
        if image.dtype != "uint8" or len(image.shape) != 3 or image.shape[2] != 3:
            raise HandlerError(400, "image must be uint8 pixels of shape [height, width, 3]")
        if image.shape[0] * image.shape[1] > self.settings.max_image_pixels:
            raise HandlerError(400, "image has too many pixels")
        try:
            pixels = await self.plane.pull(image)
        except DataPlaneError as err:
            raise HandlerError(502 if err.code != "expired" else 504, f"could not fetch the image: {err.message}")
        loop = asyncio.get_running_loop()
        patches, grid = await loop.run_in_executor(self.pool, self.preprocess, pixels.numpy())
        embeds = await self.batcher.encode(torch.from_numpy(patches), grid)
        handle = self.plane.publish(embeds, consumers=1)
        return encode(EncodeResult(embedding=handle, grid=grid, encoder_id=self.instance))

    async def drain(self) -> None:
        await self.endpoint.drain()

    async def close(self) -> None:
        if self.batcher:
            await asyncio.to_thread(self.batcher.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)
        await self.plane.stop()

    def stats(self) -> dict:
        b = self.batcher
        return {
            "instance": self.instance,
            "images": b.images if b else 0,
            "batches": b.batches if b else 0,
            "patches": b.patches if b else 0,
            "queue_depth": b.queued if b else 0,
            "in_flight": len(self.endpoint.tasks),
            "errors": self.endpoint.errors,
            "bytes_held": self.plane.store.bytes_held,
        }
