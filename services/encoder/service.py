"""The encoder: vision tower only. Pulls decoded pixels, batches images across requests through the
ViT, holds the embeddings for prefill to pull, and answers with their handle and the patch grid.

Embeddings are cached (``EmbeddingSource``): a repeated image skips the ViT here, is borrowed from the
encoder that holds it elsewhere in the stack, and concurrent jobs for one image share one encoding.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from services.encoder.batcher import VisionBatcher
from services.encoder.cache import Embedding, EmbeddingCache
from services.encoder.embeddings import EmbeddingSource
from services.encoder.fingerprint import encoder_fingerprint
from services.encoder.peers import PeerEncoders, fetch_subject
from services.encoder.settings import EncoderSettings
from shared.bus import QUEUE, ConcurrentEndpoint, HandlerError
from shared.dataplane.handle import TensorHandle
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.embedding_index import EmbeddingIndex, embedding_key
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import cancelled_request
from shared.messages.encode import EmbeddingFetch, EmbeddingLoan, EncodeJob, EncodeResult
from shared.model.config import ModelConfig
from shared.model.loader import load_vision_tower
from shared.model.processor import ImagePreprocessor, TorchImagePreprocessor, preprocess_mode
from shared.service import ServiceBase

log = get_logger(__name__)

MIN_CONTENT_HASH = 16  # characters: shorter "hashes" would make unrelated images share cache entries


class EncoderService(ServiceBase):
    kind = "encoder"
    description = "Vision encoder: pixels in, embedding handles out"

    def __init__(self, settings: EncoderSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.endpoint = ConcurrentEndpoint("encode", self.handle_encode, settings.max_concurrent_jobs)
        self.fetch_endpoint = ConcurrentEndpoint("fetch", self.handle_fetch, settings.max_concurrent_jobs)
        self.pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        self.batcher: VisionBatcher | None = None
        self.cache = EmbeddingCache(settings.encoder_cache_mb << 20)
        self.embeddings: EmbeddingSource | None = None
        self.fingerprint = ""
        self.jobs: dict[str, set[asyncio.Task]] = {}  # request id → its encode jobs running here

    async def setup(self, nc) -> None:
        s = self.settings
        path = s.model_path()
        config = ModelConfig.from_checkpoint(path)
        tower = await asyncio.to_thread(load_vision_tower, path, config, s.torch_device(), s.torch_dtype(),
                                        s.load_format)
        self.preprocess_mode = preprocess_mode(s.preprocess, s.torch_device())
        self.on_device = None  # the torch preprocessor, run by the batcher in the vision thread
        if self.preprocess_mode == "torch":
            self.on_device = TorchImagePreprocessor(path, s.torch_dtype())
        else:
            self.preprocess = ImagePreprocessor(path)
        self.fingerprint = await asyncio.to_thread(encoder_fingerprint, path, s.load_format, str(s.torch_dtype()),
                                                   self.preprocess_mode)
        self.batcher = VisionBatcher(tower, asyncio.get_running_loop(), s.max_batch_images, s.max_batch_patches,
                                     prepare=self.on_device)
        self.batcher.start()
        await self.plane.start()
        index = None
        if s.cache_index and s.encoder_cache_mb > 0:
            index = EmbeddingIndex(nc, self.subjects.prefix, ttl=s.cache_index_ttl)
            await index.open()
        peers = PeerEncoders(nc, self.subjects, self.plane, s.peer_fetch_timeout)
        self.embeddings = EmbeddingSource(self.cache, index, peers, self.instance)
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)

    def metadata(self) -> dict[str, str]:
        # The frontend builds index keys with it, to find which encoder holds an image.
        return {**super().metadata(), "cache_fingerprint": self.fingerprint, "preprocess": self.preprocess_mode}

    async def serve(self, service) -> None:
        await self.endpoint.add_to(service, self.subjects.encode, QUEUE["encoder"])
        # this instance's own subject: the frontend routes images here for cache affinity and spread
        await self.endpoint.add_to(service, self.subjects.encode_on(self.instance), QUEUE["encoder"],
                                   name="encode-direct")
        await self.fetch_endpoint.add_to(service, fetch_subject(self.subjects, self.instance), QUEUE["encoder"])

    async def handle_encode(self, data: bytes) -> bytes:
        job = unpack(EncodeJob, data)
        self._check(job)
        key = embedding_key(job.content_hash, self.fingerprint)
        task = asyncio.current_task()
        self.jobs.setdefault(job.request_id, set()).add(task)
        try:
            embedding, origin = await self.embeddings.obtain(key, lambda: self._encode(job.image))
        finally:
            tasks = self.jobs.get(job.request_id, set())
            tasks.discard(task)
            if not tasks:
                self.jobs.pop(job.request_id, None)
        handle = self._publish(embedding)
        return pack(EncodeResult(embedding=handle, grid=embedding.grid, encoder_id=self.instance,
                                   cached=origin != "computed"))

    async def on_cancel(self, msg) -> None:
        """The request is gone: stop its jobs here (an encoding other requests share goes on, and what
        finishes still lands in the cache)."""
        request_id = cancelled_request(msg.data)
        if request_id is None:
            return
        for task in list(self.jobs.pop(request_id, ())):
            task.cancel()

    async def handle_fetch(self, data: bytes) -> bytes:
        """Another encoder borrows an image's embeddings this one holds (or is encoding right now)."""
        request = unpack(EmbeddingFetch, data)
        embedding = await self.embeddings.lend(request.key)
        if embedding is None:
            raise HandlerError(404, "this encoder does not hold that image")
        return pack(EmbeddingLoan(embedding=self._publish(embedding), grid=embedding.grid))

    def _check(self, job: EncodeJob) -> None:
        image = job.image
        if image.dtype != "uint8" or len(image.shape) != 3 or image.shape[2] != 3:
            raise HandlerError(400, "image must be uint8 pixels of shape [height, width, 3]")
        if image.shape[0] * image.shape[1] > self.settings.max_image_pixels:
            raise HandlerError(400, "image has too many pixels")
        if len(job.content_hash) < MIN_CONTENT_HASH:
            raise HandlerError(400, f"content_hash must be a hash of the image ({MIN_CONTENT_HASH}+ characters)")

    async def _encode(self, image: TensorHandle) -> Embedding:
        try:
            pixels = await self.plane.pull(image)
        except DataPlaneError as err:
            raise HandlerError(502 if err.code != "expired" else 504, f"could not fetch the image: {err.message}")
        if self.on_device is not None:  # preprocessed on the tower's device, in the vision thread
            grid = self.on_device.grid(pixels.shape[0], pixels.shape[1])
            return Embedding(await self.batcher.encode(pixels, grid), grid)
        loop = asyncio.get_running_loop()
        patches, grid = await loop.run_in_executor(self.pool, self.preprocess, pixels.numpy())
        return Embedding(await self.batcher.encode(torch.from_numpy(patches), grid), grid)

    def _publish(self, embedding: Embedding) -> TensorHandle:
        """A new one-pull handle: the cache keeps the tensor, so every job gets its own handle to it."""
        try:
            return self.plane.publish(embedding.tensor, consumers=1)
        except DataPlaneError as err:  # full: consumers are not pulling; refuse rather than grow
            raise HandlerError(503, f"encoder busy: {err.message}")

    async def drain(self) -> None:
        await asyncio.gather(self.endpoint.drain(), self.fetch_endpoint.drain())

    async def close(self) -> None:
        if self.embeddings:
            await self.embeddings.close()
        if self.batcher:
            await asyncio.to_thread(self.batcher.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)
        await self.plane.stop()

    def stats(self) -> dict:
        b, e, c = self.batcher, self.embeddings, self.cache
        return {
            "instance": self.instance,
            "images": b.images if b else 0,  # images through the ViT (cache hits are not)
            "images_per_s": b.images_rate.rate() if b else 0.0,  # through the ViT, last 10 s
            "batches": b.batches if b else 0,
            "patches": b.patches if b else 0,
            **(b.batch_sizes.stats() if b else {}),
            "queue_depth": b.queued if b else 0,
            "in_flight": len(self.endpoint.tasks),
            "errors": self.endpoint.errors,
            "bytes_held": self.plane.store.bytes_held,  # data plane: embeddings waiting for their pull
            "cache_hits": c.hits,
            "cache_misses": c.misses,
            "cache_evictions": c.evictions,
            "cache_entries": len(c),
            "cache_bytes": c.bytes_held,
            "cache_capacity_bytes": c.max_bytes,
            "cache_joined": e.joined if e else 0,  # served by a concurrent job's encoding of the same image
            "cache_borrowed": e.peers.borrowed if e else 0,  # pulled from the encoder holding it
            "cache_lent": e.lent if e else 0,  # given to encoders that asked
            "cache_borrow_failures": e.peers.failures if e else 0,
            "index_errors": e.index.errors if e and e.index else 0,
        }
