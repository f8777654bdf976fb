"""Prompts that come with their images' pixels: the aggregated worker encodes them itself and its engine
thread places the embeddings into the waiting prompt the moment the ViT forward ends.

Through the encoder subjects, a request's images cost the aggregated process these hops after its ViT:
each job's result back to the event loop, a reply to the frontend, the frontend's prefill job back
here, its embeddings pulled, the prompt handed to the engine thread — which meanwhile started an
engine step that the prompt then waits out. On an H200 that was ~35 ms a request more than the same
hops in a process of their own (docs/architecture.md, "The aggregated worker encodes in place"). Here, as in vLLM's engine, the request comes once, with its pixels:

1. ``admit`` (event loop): check the job, pull the pixels (and any embeddings it carries), check that
   the prefix cache still holds its ``cached`` images (else ``EMBEDDINGS_GONE``: the frontend sends
   them; refused on entry instead, the request fails over to a resume that sends every image), park
   the prompt with one part per image still to come, look each image up (``EmbeddingSource``: the cache, a
   concurrent encoding, a peer, else the ViT, in the batcher's queue), and reply accepted;
2. each image's embeddings land in the engine thread: from the batcher's completion hook right after
   the forward that made them (between two engine steps, no event-loop hop), or posted between steps
   when they came otherwise (a cache hit, a joined encoding, a peer); the last one
   adds the prompt to the engine before its next step;
3. a failed encoding fails the request with an error event (the frontend resumes it elsewhere); a
   cancel drops a prompt still parked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from services.encoder.cache import Embedding
from services.encoder.encoder import Arrival, Encoder
from services.encoder.metrics import StageTimes
from services.language.intake import PromptIntake, image_inputs
from services.language.worker import LanguageWorker, Tracked
from shared.aio import TaskSet
from shared.embedding_index import embedding_key
from shared.engine.engine import Engine
from shared.engine.sequence import ImageInput, Sequence
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages.prefill import ImageSlot, PrefillJob

log = get_logger(__name__)


class Parked:
    """A prompt waiting for its images' embeddings. ``fill`` runs in the engine thread only; ``dropped``
    is set on the event loop (a cancel, a failure) before the engine is told to abort the request."""

    def __init__(self, seq: Sequence, parts: list[list[ImageInput] | None], arrived: float,
                 on_added: Callable[[float], None], on_error: Callable[[str], None]):
        self.seq = seq
        self.parts = parts  # per slot: its engine inputs, None until its embeddings land
        self.missing = sum(p is None for p in parts)
        self.arrived = arrived
        self.on_added = on_added  # seconds from arrival to the engine (engine thread)
        self.on_error = on_error
        self.dropped = False

    def fill(self, engine: Engine, index: int, inputs: list[ImageInput]) -> None:
        if self.dropped or self.parts[index] is not None:
            return
        self.parts[index] = inputs
        self.missing -= 1
        if self.missing == 0:
            self.enter(engine)

    def enter(self, engine: Engine) -> None:
        self.seq.images = [i for part in self.parts for i in part]
        try:
            engine.add_prompt(self.seq)
        except Exception as err:  # checked at admission; anything else fails the request, not the thread
            log.exception("in_place.add_failed", request_id=self.seq.request_id)
            self.dropped = True
            self.on_error(f"prompt refused: {type(err).__name__}")
            return
        self.on_added(time.monotonic() - self.arrived)


class InPlacePrompts:
    def __init__(self, encoder: Encoder, worker: LanguageWorker, intake: PromptIntake):
        self.encoder = encoder
        self.worker = worker
        self.intake = intake
        self.parked: dict[str, Parked] = {}
        self.settling = TaskSet("in-place-encodes")
        self.prompts = 0  # admitted with pixels
        self.images = 0  # of their images, those that came as pixels
        self.times = StageTimes(("prompt_encode",))  # arrival → prompt in the engine (all its images embedded)
        worker.on_cancel.append(self.drop)

    # -- 1. admission (event loop) ----------------------------------------------------------------
    async def admit(self, job: PrefillJob, tracked: Tracked) -> None:
        """A job with at least one slot of pixels (the others carry their embeddings: an encoder's, or a
        client's precomputed ones, pulled here beside the pixels)."""
        arrived = time.monotonic()
        self.intake.check(job, pixels=True)
        pixel_slots = [i for i, s in enumerate(job.images) if s.pixels is not None]
        for i in pixel_slots:
            slot = job.images[i]
            self.encoder.check_pixels(slot.pixels, slot.sampling, slot.content_hash)
            self._check_grid(slot)
        # counted as arriving before the pulls: a ViT batch started meanwhile waits for the rest of them
        arrivals = {i: Arrival(self.encoder.arriving, job.request_id) for i in pixel_slots}
        try:
            parked, pixels = await self._park(job, tracked, pixel_slots, arrived)
        except BaseException:
            for arrival in arrivals.values():
                arrival.done()
            raise
        tasks = [self.encoder.spawn_job(job.request_id, self._embed(parked, i, job.images[i], frames, arrivals[i]))
                 for i, frames in zip(pixel_slots, pixels)]
        self.settling.spawn(self._settle(job.request_id, tasks), name=f"in-place-{job.request_id}")

    async def _park(self, job: PrefillJob, tracked: Tracked, pixel_slots: list[int],
                    arrived: float) -> tuple[Parked, list[torch.Tensor]]:
        """Pull what the job names, then park its prompt and track the request (nothing is queued yet):
        the prompt, and the pixels of ``pixel_slots``."""
        pixels, embeds = await asyncio.gather(
            asyncio.gather(*(self.encoder.pull_pixels(job.images[i].pixels) for i in pixel_slots)),
            self.intake.pull_embeddings(job.images))
        request_id = job.request_id
        self.worker.refuse_cancelled(request_id)  # cancelled while its pixels came
        parts = [None if e is None and not s.cached else image_inputs(s, e, self.intake.config)
                 for s, e in zip(job.images, embeds)]
        seq = self.intake.make_sequence(job, [])
        if any(s.cached for s in job.images):  # refused now if their KV is gone already (checked again on entry)
            seq.images, seq.block_hashes = [i for part in parts if part for i in part], self.intake.chain_hashes(job)
            self.worker.check_cached(seq)
        on_error = lambda message: self.worker.loop.loop.call_soon_threadsafe(  # noqa: E731 - engine thread
            self._fail, request_id, 500, message)
        parked = Parked(seq, parts, arrived, lambda seconds: self.times.add("prompt_encode", seconds), on_error)
        self.parked[request_id] = parked
        self.worker.track(request_id, tracked)
        self.prompts += 1
        self.images += len(pixel_slots)
        return parked, list(pixels)

    def _check_grid(self, slot: ImageSlot) -> None:
        shape = slot.pixels.shape
        if tuple(self.encoder.vision.grid(shape, slot.sampling)) != tuple(slot.grid):
            raise ServiceError(400, "an image slot's grid is not the one its pixels are encoded at")
        if slot.sampling is not None:
            timing = self.encoder.vision.video_timing(slot.sampling)
            if abs(timing.second_per_grid - slot.second_per_grid) > 1e-9:
                raise ServiceError(400, "a video slot's temporal spacing is not its sampling's")

    # -- 2. each image's embeddings → the engine thread ---------------------------------------------
    async def _embed(self, parked: Parked, index: int, slot: ImageSlot, pixels: torch.Tensor,
                     arrival: Arrival) -> None:
        config, post = self.intake.config, self.worker.loop.post
        device = self.intake.device

        def place(tensor: torch.Tensor) -> None:  # the forwarding thread: the engine's, between its steps
            post(lambda engine: parked.fill(engine, index, image_inputs(slot, tensor.to(device), config)))

        hooked = False

        async def encode() -> Embedding:
            nonlocal hooked
            hooked = True
            return await self.encoder.encode_pixels(pixels, slot.sampling, arrival, on_done=place)

        try:
            embedding, _ = await self.encoder.embeddings.obtain(
                embedding_key(slot.content_hash, self.encoder.fingerprint), encode)
        finally:
            arrival.done()
        if not hooked:  # the cache, a concurrent encoding or a peer had them
            place(embedding.tensor)

    async def _settle(self, request_id: str, tasks: list[asyncio.Task]) -> None:
        """Wait for the request's encodings; a failed one fails the request (unless it is gone already)."""
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        parked = self.parked.pop(request_id, None)
        if not errors or parked is None or parked.dropped:
            return
        if all(isinstance(e, asyncio.CancelledError) for e in errors):
            return  # a cancel: ``drop`` has ended it
        error = next(e for e in errors if not isinstance(e, asyncio.CancelledError))
        status, message = ((error.status, error.message) if isinstance(error, ServiceError)
                           else (500, f"image encoding failed: {type(error).__name__}"))
        if not isinstance(error, ServiceError):
            log.error("in_place.encode_failed", request_id=request_id, error=repr(error))
        self._fail(request_id, status, message)

    # -- 3. endings (event loop) ------------------------------------------------------------------------
    def _fail(self, request_id: str, status: int, message: str) -> None:
        parked = self.parked.pop(request_id, None)
        if parked is not None:
            parked.dropped = True
        self.worker.fail(request_id, status, message)
        self.worker.loop.call(lambda engine: engine.abort(request_id))  # if it entered meanwhile

    def drop(self, request_id: str) -> None:
        """A cancel (``LanguageWorker.on_cancel``, before the engine is told): a parked prompt never enters."""
        parked = self.parked.pop(request_id, None)
        if parked is not None:
            parked.dropped = True

    def stats(self) -> dict:
        return {"prompts_in_place": self.prompts, "images_in_place": self.images,
                "prompts_parked": len(self.parked), **self.times.stats()}
