"""One chat request through the stack: images → encoders, prompt → prefill, tokens ← stream.

``ChatPipeline.start`` does everything that can fail with a clean HTTP status (validation, media,
encoding, prefill admission) before a single byte is streamed; ``Generation.events`` then yields text
and ends with a finish or raises an ``ApiError``. Leaving the iteration early (client gone, stop
string) broadcasts a cancel that every stage honours.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import torch

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.errors import ApiError
from services.frontend.liveness import LiveWorkers
from services.frontend.media import DecodedImage, MediaLoader
from services.frontend.prompt import Prompt, PromptBuilder, image_urls
from services.frontend.protocol import ChatCompletionRequest
from services.frontend.routing import EncoderDirectory, assign
from shared.bus import ServiceCallError, Subjects, call
from shared.dataplane.plane import DataPlane
from shared.engine.sampling import SamplingParams
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import Cancel
from shared.messages.encode import EncodeJob, EncodeResult
from shared.messages.prefill import ImageSlot, PrefillAccepted, PrefillJob
from shared.messages.stream import TokenEvent

log = get_logger(__name__)


@dataclass
class TextDelta:
    text: str


@dataclass
class Finished:
    reason: str
    prompt_tokens: int
    completion_tokens: int


class ChatPipeline:
    def __init__(self, nc, subjects: Subjects, plane: DataPlane, media: MediaLoader, builder: PromptBuilder,
                 tokenizer, settings, max_model_len: int, encoders: EncoderDirectory, workers: LiveWorkers):
        self.nc = nc
        self.subjects = subjects
        self.plane = plane
        self.media = media
        self.builder = builder
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_model_len = max_model_len
        self.encoders = encoders
        self.workers = workers
        self.encoded_images = 0

    async def start(self, request: ChatCompletionRequest) -> "Generation":
        if not self.nc.is_connected:
            raise ApiError(503, "the message bus is unavailable")
        urls = image_urls(request.messages)
        if len(urls) > self.settings.max_images_per_request:
            raise ApiError(400, f"too many images: {len(urls)} (at most {self.settings.max_images_per_request})",
                           "messages")
        arrived = time.time()
        images = await self.media.load_all(urls)
        loaded = time.time()
        prompt = self.builder.build(request.messages, [(i.height, i.width) for i in images])
        sampling = self.sampling(request, len(prompt.token_ids))
        request_id = uuid.uuid4().hex
        try:
            results = await self.encode_images(request_id, images) if images else []
            generation = Generation(self, request_id, prompt, request.stop_list(), images, sampling, arrived)
            if images:
                generation.stages.update(media=loaded - arrived, encode=time.time() - loaded)
            await generation.submit(self.prefill_job(request_id, prompt, results, sampling, generation.subject))
        except asyncio.CancelledError:  # the client left before the answer started: drop its work everywhere
            await asyncio.shield(self.cancel(request_id, "client gone"))
            raise
        return generation

    def sampling(self, request: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len}",
                           "messages")
        asked = request.max_completion_tokens or request.max_tokens
        if asked is not None and asked > min(room, self.settings.max_output_tokens):
            raise ApiError(400, f"max_tokens={asked} is too large: the prompt leaves room for {room} tokens "
                                f"(and at most {self.settings.max_output_tokens} are allowed)", "max_tokens")
        return SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=max(request.top_k, 0),
            max_tokens=asked or min(room, self.settings.default_max_tokens), ignore_eos=request.ignore_eos,
            seed=request.seed,
        )

    async def encode_images(self, request_id: str, images: list[DecodedImage]) -> list[EncodeResult]:
        lease = self.settings.encode_timeout * self.settings.encode_attempts + 30
        handles = [self.plane.publish(torch.from_numpy(i.pixels), consumers=None, lease=lease) for i in images]
        try:
            jobs = [EncodeJob(request_id=request_id, image=h, content_hash=i.content_hash)
                    for h, i in zip(handles, images)]
            hashes = [i.content_hash for i in images]
            targets = assign(hashes, self.encoders.encoders, self.subjects, await self.encoders.holders(hashes),
                             self.settings.encoder_load_margin)
            return list(await asyncio.gather(*(self._encode_one(job, t) for job, t in zip(jobs, targets))))
        finally:
            for handle in handles:
                self.plane.release(handle)

    async def _encode_one(self, job: EncodeJob, subject: str) -> EncodeResult:
        """Try the routed encoder; on failure (or if it vanished) any encoder of the queue group."""
        attempts = self.settings.encode_attempts
        for attempt in range(1, attempts + 1):
            try:
                reply = await self._call_watching(subject, pack(job))
                self.encoded_images += 1
                return unpack(EncodeResult, reply)
            except ServiceCallError as err:
                direct = subject != self.subjects.encode
                subject = self.subjects.encode
                retry = err.status >= 500 and (direct or not err.no_responders) and attempt < attempts
                log.warning("encode.failed", request_id=job.request_id, status=err.status, retry=retry)
                if not retry:
                    raise ApiError(err.status, "image encoding failed: " + err.message) from None
        raise AssertionError("unreachable")

    async def _call_watching(self, subject: str, payload: bytes) -> bytes:
        """An encode call that gives up early if the encoder it went to disappears (killed, host lost):
        the image is retried elsewhere at once instead of after the whole encode timeout."""
        request = asyncio.ensure_future(call(self.nc, subject, payload, self.settings.encode_timeout, "encoder"))
        if subject == self.subjects.encode:
            return await request  # the queue group picked someone: nothing to watch
        instance, since = subject.rsplit(".", 1)[-1], time.monotonic()
        while True:
            done, _ = await asyncio.wait({request}, timeout=0.5)
            if done:
                return request.result()
            if self.workers.gone(instance, since):
                request.cancel()
                raise ServiceCallError(503, "the encoder went away")

    def prefill_job(self, request_id: str, prompt: Prompt, results: list[EncodeResult], sampling: SamplingParams,
                    subject: str) -> PrefillJob:
        slots = []
        for offset, grid, result in zip(prompt.image_offsets, prompt.image_grids, results):
            if tuple(result.grid) != tuple(grid):
                raise ApiError(500, "the encoder and the frontend disagree on an image's size")
            slots.append(ImageSlot(offset=offset, grid=grid, embedding=result.embedding))
        return PrefillJob(request_id=request_id, token_ids=prompt.token_ids, images=slots, sampling=sampling,
                          stream=subject)

    async def cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel, pack(Cancel(request_id=request_id, reason=reason)))
        except Exception:  # NATS gone: the stages' own timeouts and leases clean up
            log.warning("cancel.publish_failed", request_id=request_id)


class Generation:
    """A request admitted by prefill; iterate ``events`` for its text.

    Tokens arrive as indexed events on the request's own subject and are put back in order (duplicates
    ignored). If the worker producing them vanishes, or a hand-off fails with a server error, the
    request is resumed on other workers from its prompt plus the tokens already received
    (``output_offset``), at most ``resume_attempts`` times; the client sees one uninterrupted stream.
    """

    def __init__(self, pipeline: ChatPipeline, request_id: str, prompt: Prompt, stop: list[str],
                 images: list[DecodedImage], sampling: SamplingParams, arrived: float):
        self.pipeline = pipeline
        self.request_id = request_id
        self.attempt_id = request_id  # the id the current attempt runs under on the workers
        self.prompt = prompt
        self.images = images
        self.sampling = sampling
        self.prompt_tokens = len(prompt.token_ids)
        self.subject = pipeline.subjects.stream(request_id)
        self.detok = IncrementalDetokenizer(pipeline.tokenizer, stop)
        self.generated: list[int] = []
        self.created = arrived  # the request's arrival (wall clock): TTFT and E2E count from here
        self.first_token_at: float | None = None
        # seconds per stage: media (fetch, decode), encode (every image), first_token (prefill submitted →
        # first token: prefill queue, prefill, KV hand-off, first decode step)
        self.stages: dict[str, float] = {}
        self._submitted = 0.0
        self.resumes = 0
        self._worker = ""
        self._worker_since = 0.0
        self._sub = None
        self._done = False  # the stream ended normally
        self._cut_short = False  # a stop string ended it while the model was still generating

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    async def submit(self, job: PrefillJob) -> None:
        nc = self.pipeline.nc
        if self._sub is None:
            self._sub = await nc.subscribe(self.subject)  # before the job: no token can be missed
        self._submitted = time.time()
        try:
            reply = await call(nc, self.pipeline.subjects.prefill, pack(job), self.pipeline.settings.prefill_timeout,
                               "prefill worker")
            self._watch(unpack(PrefillAccepted, reply).prefill_id)
        except ServiceCallError as err:
            if err.status == 504:
                await self.pipeline.cancel(job.request_id, "prefill timeout")
            if self.resumes == 0:
                await self._close()
            raise ApiError(err.status, err.message) from None

    def _watch(self, worker: str) -> None:
        if worker and worker != self._worker:
            self._worker, self._worker_since = worker, time.monotonic()

    async def events(self) -> AsyncIterator[TextDelta | Finished]:
        settings = self.pipeline.settings
        pending: dict[int, TokenEvent] = {}
        last_progress = time.monotonic()
        try:
            while True:
                limit = settings.first_token_timeout if self.first_token_at is None else settings.token_timeout
                try:
                    msg = await self._sub.next_msg(timeout=0.5)
                except asyncio.TimeoutError:
                    if not self.pipeline.nc.is_connected:
                        raise ApiError(503, "the message bus is unavailable") from None
                    if time.monotonic() - last_progress > limit:
                        raise ApiError(504, "the model stopped producing tokens in time") from None
                    if self._worker and self.pipeline.workers.gone(self._worker, self._worker_since):
                        await self._resume(f"worker {self._worker} vanished")
                        last_progress = time.monotonic()
                    continue
                event = unpack(TokenEvent, msg.data)
                if event.request_id != self.attempt_id:
                    continue  # a superseded attempt's late words
                if event.error is not None:
                    if event.error.status < 500:
                        raise ApiError(event.error.status, event.error.message)
                    await self._resume(event.error.message)
                    last_progress = time.monotonic()
                    continue
                self._watch(event.worker)
                if event.index >= len(self.generated):
                    pending[event.index] = event
                while len(self.generated) in pending:
                    last_progress = time.monotonic()
                    for output in self._consume(pending.pop(len(self.generated))):
                        yield output
                    if self._done:
                        return
        finally:
            await self._close()
            if not self._done or self._cut_short:
                await self.pipeline.cancel(self.attempt_id, "stop string" if self._cut_short else "request ended early")

    async def _resume(self, reason: str) -> None:
        """Continue on other workers from the prompt plus every token received so far."""
        if self.resumes >= self.pipeline.settings.resume_attempts:
            raise ApiError(503, "the model workers serving this request failed")
        self.resumes += 1
        log.warning("request.resume", request_id=self.request_id, reason=reason, tokens=len(self.generated))
        await self.pipeline.cancel(self.attempt_id, "resumed elsewhere")
        self.attempt_id = f"{self.request_id}.{self.resumes}"
        self._worker = ""
        remaining = self.sampling.max_tokens - len(self.generated)
        prompt = Prompt(self.prompt.token_ids + self.generated, self.prompt.image_offsets, self.prompt.image_grids)
        results = await self.pipeline.encode_images(self.attempt_id, self.images) if self.images else []
        sampling = msgspec.structs.replace(self.sampling, max_tokens=remaining)
        job = self.pipeline.prefill_job(self.attempt_id, prompt, results, sampling, self.subject)
        await self.submit(msgspec.structs.replace(job, output_offset=len(self.generated)))

    def _consume(self, event: TokenEvent) -> list[TextDelta | Finished]:
        if self.first_token_at is None:
            self.first_token_at = time.time()
            self.stages["first_token"] = self.first_token_at - self._submitted
        self.generated += event.token_ids
        out: list[TextDelta | Finished] = []
        text = self.detok.push(event.token_ids)
        if self.detok.stopped or event.finish_reason is not None:
            text += self.detok.finish()
        if text:
            out.append(TextDelta(text))
        if self.detok.stopped or event.finish_reason is not None:
            self._cut_short = self.detok.stopped and event.finish_reason is None
            self._done = True
            reason = "stop" if self.detok.stopped else event.finish_reason
            out.append(Finished(reason, self.prompt_tokens, self.completion_tokens))
        return out

    async def _close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:
                pass
