"""An encoder's work: decoded pixels in, embeddings held on the data plane for prefill to pull.

``Encoder`` is what the encoder service serves, and what the aggregated worker runs beside its engine
(``vision``: the tower and its preprocessing, whose forwards run in the aggregated worker's engine
thread). It answers three requests:

1. ``encode`` (the queue group, and this instance's own subject for routed images): pull the pixels
   (a video job: its sampled frames, resized within the video processor's budget),
   find the embeddings cheapest first (``EmbeddingSource``: cache, a concurrent job, a peer encoder,
   the ViT), publish a one-pull handle, reply with it and the patch grid;
2. ``fetch``: lend an image this encoder holds to another encoder;
3. a ``Cancel`` broadcast: the request's jobs here stop (an encoding other requests share goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack

import torch

from services.encoder.cache import Embedding, EmbeddingCache
from services.encoder.embeddings import EmbeddingSource
from services.encoder.fingerprint import encoder_fingerprint
from services.encoder.metrics import StageTimes
from services.encoder.peers import PeerEncoders
from services.encoder.settings import EncoderSettings
from services.encoder.vision import VisionEncoder
from shared.bus.publisher import listen_for_cancels
from shared.bus.service_api import Endpoint, Request
from shared.bus.subjects import QUEUE, Subjects
from shared.dataplane.handle import TensorHandle
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.embedding_index import EmbeddingIndex, embedding_key
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.encode import EmbeddingFetch, EmbeddingLoan, EncodeJob, EncodeResult, VideoSampling, VideoTiming

log = get_logger(__name__)

MIN_CONTENT_HASH = 16  # characters: shorter "hashes" would make unrelated images share cache entries
PEER_FETCH_TIMEOUT_S = 5.0  # to ask another encoder for an image it holds (and again to pull it), else encode here


class Encoder:
    def __init__(self, settings: EncoderSettings, subjects: Subjects, instance: str, plane: DataPlane):
        self.settings = settings
        self.subjects = subjects
        self.instance = instance
        self.plane = plane
        self.cache = EmbeddingCache(settings.encoder_cache_mb << 20)
        self.vision = VisionEncoder(settings)
        self.embeddings: EmbeddingSource | None = None
        self.fingerprint = ""
        self.times = StageTimes(("pull", "encode"))
        self.jobs: dict[str, set[asyncio.Task]] = {}  # request id → its encode jobs running here
        self.arriving: Counter[str] = Counter()  # request id → its jobs here not yet queued for the ViT
        self._encode_endpoints: list[Endpoint] = []

    async def start(self, nc, resources: AsyncExitStack, own_thread: bool = True) -> None:
        """Load the tower and start batching; ``own_thread=False``: the caller's engine loop runs the
        forwards (``attach`` it there). Everything taken is released through ``resources``."""
        s = self.settings
        path = s.model_path()
        await self.vision.start(path, resources, lambda request_id: self.arriving.get(request_id, 0), own_thread)
        self.fingerprint = await asyncio.to_thread(encoder_fingerprint, path, s.load_format, str(s.torch_dtype()),
                                                   self.vision.preprocess_mode)
        index = None
        if s.encoder_cache_mb > 0:  # shared through JetStream where the server has it
            index = EmbeddingIndex(nc, self.subjects.prefix)
            await index.open()
        peers = PeerEncoders(nc, self.subjects, self.plane, PEER_FETCH_TIMEOUT_S)
        self.embeddings = EmbeddingSource(self.cache, index, peers, self.instance)
        resources.push_async_callback(self.embeddings.close)
        subscription = await listen_for_cancels(nc, self.subjects, self.cancel)
        resources.push_async_callback(subscription.unsubscribe)

    def endpoints(self) -> list[Endpoint]:
        limit = self.settings.max_concurrent_jobs
        self._encode_endpoints = [
            Endpoint("encode", self.subjects.encode, QUEUE["encoder"], self.handle_encode, limit),
            # this instance's own subject: the frontend routes images here for cache affinity and spread
            Endpoint("encode-direct", self.subjects.encode_on(self.instance), QUEUE["encoder"], self.handle_encode,
                     limit),
        ]
        fetch = Endpoint("fetch", self.subjects.encode_fetch(self.instance), QUEUE["encoder"], self.handle_fetch,
                         limit)
        return [*self._encode_endpoints, fetch]

    def metadata(self) -> dict[str, str]:
        # The frontend builds index keys with it, to find which encoder holds an image.
        return {"cache_fingerprint": self.fingerprint, "preprocess": self.vision.preprocess_mode}

    # -- 1. encode --------------------------------------------------------------------------------
    async def handle_encode(self, request: Request) -> bytes:
        job = unpack(EncodeJob, request.data)
        self.check_pixels(job.image, job.video, job.content_hash)
        # a video's content hash covers its frames and sampling: the key names the embeddings and the timing
        key = embedding_key(job.content_hash, self.fingerprint)
        with self._job(job.request_id), Arrival(self.arriving, job.request_id) as arrival:
            embedding, origin = await self.embeddings.obtain(key, lambda: self._encode(job, arrival))
        return pack(EncodeResult(embedding=self._publish(embedding), grid=embedding.grid, encoder_id=self.instance,
                                 cached=origin != "computed", timing=self._timing(job)))

    def check_pixels(self, image: TensorHandle, video: VideoSampling | None, content_hash: str) -> None:
        """An image's (or a clip's sampled frames') pixels as a job or a prompt names them, before pulling."""
        self.vision.check_pixels(image, video)
        if len(content_hash) < MIN_CONTENT_HASH:
            raise ServiceError(400, f"content_hash must be a hash of the image ({MIN_CONTENT_HASH}+ characters)")

    def _timing(self, job: EncodeJob) -> VideoTiming | None:
        return None if job.video is None else self.vision.video_timing(job.video)

    async def pull_pixels(self, image: TensorHandle) -> torch.Tensor:
        try:
            return await self.plane.pull(image)
        except DataPlaneError as err:
            raise ServiceError(502 if err.code != "expired" else 504, f"could not fetch the image: {err.message}")

    async def _encode(self, job: EncodeJob, arrival: "Arrival") -> Embedding:
        started = time.monotonic()
        pixels = await self.pull_pixels(job.image)
        self.times.add("pull", time.monotonic() - started)
        return await self.encode_pixels(pixels, job.video, arrival)

    async def encode_pixels(self, pixels: torch.Tensor, video: VideoSampling | None, arrival: "Arrival",
                            on_done: Callable[[torch.Tensor], None] | None = None) -> Embedding:
        """Pulled pixels through preprocessing and the ViT (``on_done``: see ``VisionBatcher.encode``)."""
        started = time.monotonic()
        tensor, grid = await self.vision.encode(pixels, video, arrival.request_id, arrival.queued, on_done)
        self.times.add("encode", time.monotonic() - started)
        return Embedding(tensor, grid)

    def _publish(self, embedding: Embedding, lease: float | None = None) -> TensorHandle:
        """A new one-pull handle: the cache keeps the tensor, so every job gets its own handle to it."""
        try:  # (the batcher synchronized)
            return self.plane.publish(embedding.tensor, consumers=1, lease=lease, complete=True)
        except DataPlaneError as err:  # full: consumers are not pulling; refuse rather than grow
            raise ServiceError(503, f"encoder busy: {err.message}")

    @contextlib.contextmanager
    def _job(self, request_id: str):
        """The running task encodes for ``request_id``: a cancel of the request cancels it."""
        task = asyncio.current_task()
        self.jobs.setdefault(request_id, set()).add(task)
        try:
            yield
        finally:
            tasks = self.jobs.get(request_id, set())
            tasks.discard(task)
            if not tasks:
                self.jobs.pop(request_id, None)

    def spawn_job(self, request_id: str, work: Coroutine) -> asyncio.Task:
        """``work`` in a task of its own, as one of the request's jobs here (a cancel cancels it)."""

        async def job():
            with self._job(request_id):
                return await work

        return asyncio.create_task(job(), name=f"encode-{request_id}")

    # -- 2. fetch ---------------------------------------------------------------------------------
    async def handle_fetch(self, request: Request) -> bytes:
        """Another encoder borrows an image's embeddings this one holds (or is encoding right now)."""
        fetch = unpack(EmbeddingFetch, request.data)
        embedding = await self.embeddings.lend(fetch.key)
        if embedding is None:
            raise ServiceError(404, "this encoder does not hold that image")
        # the borrower pulls within its own timeout of this answer, or never (it gave up, or died): a loan
        # lapses then, so a draining encoder does not wait out a whole lease for it
        loan = self._publish(embedding, lease=2 * PEER_FETCH_TIMEOUT_S)
        return pack(EmbeddingLoan(embedding=loan, grid=embedding.grid))

    # -- 3. cancel --------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """The request is gone: stop its jobs here (what finishes still lands in the cache)."""
        for task in list(self.jobs.pop(request_id, ())):
            task.cancel()

    def stats(self) -> dict:
        e, c = self.embeddings, self.cache
        return {
            **self.vision.stats(),
            "jobs_arriving": sum(self.arriving.values()),  # jobs received, not yet queued for the ViT
            **self.times.stats("job_"),  # pulling pixels; preprocessing + ViT as the job saw it
            "in_flight": sum(e.in_flight for e in self._encode_endpoints),
            "bytes_held": self.plane.store.bytes_held,  # data plane: embeddings waiting for their pull
            **{k: v for k, v in self.plane.stats().items() if k.startswith("pull_serve_")},  # pulls from its pool
            "pulls_mapped": self.plane.store.mapped,  # of them, pulled over CUDA IPC (a consumer on this GPU)
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


class Arrival:
    """One encode job in ``Encoder.arriving`` until its image is queued for the ViT or the job ends
    otherwise (a cache hit, a joined encoding, a failure, a cancel): counted out exactly once (also as
    a context manager's exit)."""

    def __init__(self, arriving: Counter, request_id: str):
        self.arriving, self.request_id = arriving, request_id
        self.counted = True
        arriving[request_id] += 1

    def done(self) -> None:
        if self.counted:
            self.counted = False
            self.arriving[self.request_id] -= 1
            if self.arriving[self.request_id] <= 0:
                del self.arriving[self.request_id]

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.done()

    def queued(self, future: asyncio.Future) -> asyncio.Future:
        """The image is in the batcher's queue (``future`` its embeddings): it no longer counts as arriving."""
        self.done()
        return future
