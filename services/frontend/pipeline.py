"""The request path at the frontend, top to bottom: media → prompt → encode → prefill → a Generation.

1. ``start``: fetch and decode the images and video clips (bounded pool), render and tokenize the prompt
   with each image's and clip's placeholders expanded (off the event loop; a text completion's prompt is
   tokenized, or taken as token ids), check sampling against the context, the vocabulary and the grammar;
2. subscribe to the request's stream;
3. ``submit`` the prefill job to the intake worker the router picks (the one holding the longest prefix
   of the prompt, images included, unless overloaded; else the least loaded; waiting for one when none is
   listed, see ``workers.py``), watching it: a worker that
   is gone before it accepted gets the job again elsewhere at once, and one that does not accept within
   ``--prefill-timeout`` (alive, but stuck or swamped) has it cancelled and sent elsewhere. An image
   whose every token that worker's prefix cache holds is not sent at all (``slots.cached``; one only
   recognised by its bytes is never decoded). The others go as pixels to a worker that encodes in place
   (aggregated); for any other, they are encoded first (``EncodeFanout``). A client's precomputed
   embeddings (``embeds.py``) skip encoding: published here, they are pulled by the worker as an
   encoder's would be. Embeddings whose holder vanished before prefill pulled them, or a worker that no
   longer holds what it was said to (``EMBEDDINGS_GONE``), and every image is encoded again and sent;
4. hand back the ``Generation`` (tokens, text, finish), which calls ``resume`` if its worker is lost:
   re-encode (cache hits) and send every image, prefill the prompt plus every token already streamed,
   continue numbering from there (``output_offset``), at most ``RESUME_ATTEMPTS`` times.
A request that ends before its answer starts (the client left, an error) cancels its work everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from services.frontend import slots
from services.frontend.embeds import EmbedsReader, ImageEmbeds, prompt_size
from services.frontend.encoding import ENCODE_ATTEMPTS, EncodeFanout
from services.frontend.errors import ApiError
from services.frontend.generation import Generation, OutputOptions, Timing
from services.frontend.media import MediaLoader
from services.frontend.prompt import Prompt, PromptBuilder, VideoShape, media_parts, template_options
from services.frontend.protocol import ChatCompletionRequest
from services.frontend.routing import IntakeRouter
from services.frontend.sampling import SamplingBuilder, structured_constraint
from services.frontend.seen_images import RecognisedImage
from services.frontend.stream import TokenStream
from services.frontend.text_protocol import CompletionRequest
from services.frontend.tools import tool_constraint
from services.frontend.video import DecodedVideo
from services.frontend.workers import StackWorkers
from shared.aio import TaskSet
from shared.bus.calls import ServiceCallError
from shared.bus.directory import Directory, kind_of
from shared.bus.subjects import Subjects
from shared.bus.watched import WorkerGone, call_watched
from shared.dataplane.plane import DataPlane
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import Cancel
from shared.messages.encode import EncodeResult
from shared.messages.prefill import EMBEDDINGS_GONE, ImageSlot, PrefillAccepted, PrefillJob
from shared.messages.sampling import SamplingParams

log = get_logger(__name__)

RESUME_ATTEMPTS = 2  # times a request whose language worker died is resumed on (or sent to) other workers


class Pipeline:
    def __init__(self, nc, subjects: Subjects, plane: DataPlane, directory: Directory, media: MediaLoader,
                 builder: PromptBuilder, tokenizer, settings, sampling: SamplingBuilder, on_finished):
        self.nc = nc
        self.subjects = subjects
        self.directory = directory
        self.media = media
        self.builder = builder
        self.tokenizer = tokenizer
        self.settings = settings
        self.sampling = sampling
        self.max_model_len = sampling.max_model_len
        self.plane = plane  # the request's pixels, for a worker that encodes in place, and given embeddings
        self.embeds = EmbedsReader(builder.config, settings.max_media_bytes)
        self.workers = StackWorkers(directory, settings.worker_wait, media=not settings.text_only)
        self.encoding = EncodeFanout(nc, subjects, plane, directory, self.workers, settings)
        self.intake = IntakeRouter(nc, directory, subjects, settings.prefix_routing)
        self.merge = builder.config.vision.merge_size
        self.images_cached = 0  # images left out of prefill jobs: their target's prefix cache held them
        self.on_finished = on_finished  # metrics, once per generation
        # Rendering and tokenizing off the event loop, one prompt at a time: the tokenizer's
        # split_special_tokens switch is state of the tokenizer, and two threads would mix prompts up.
        self.prompts = ThreadPoolExecutor(1, thread_name_prefix="prompt")
        self.chores = TaskSet("frontend-chores")  # cancels and unsubscribes that must not be lost

    # -- 1. media and prompt ----------------------------------------------------------------------
    async def start(self, request: ChatCompletionRequest | CompletionRequest, slot, request_id: str,
                    prompt_index: int = 0) -> Generation:
        """``prompt_index``: which of a text completion's prompts (each is a generation of its own)."""
        if not self.nc.is_connected:
            raise ApiError(503, "the message bus is unavailable")
        timing = Timing(arrived=time.time())
        images = []
        if isinstance(request, ChatCompletionRequest):
            parts = media_parts(request.messages)
            self._check_counts(parts)
            images = await self.media.load_media(parts, self.embeds)  # images, videos, embeddings, in order
        loaded = time.time()
        prompt, sampling = await asyncio.get_running_loop().run_in_executor(
            self.prompts, self._prepare, request, images, prompt_index)
        stream = TokenStream(self.nc, self.subjects.stream(request_id), self.directory, self.settings.token_timeout)
        output = OutputOptions(request.stop_list(), request.skip_special_tokens is not False,
                               bool(request.include_stop_str_in_output))
        generation = Generation(self, request_id, prompt, images, sampling, output, stream, slot, timing)
        generation.request, generation.prompt_index = request, prompt_index
        try:
            if images:
                timing.stages["media"] = loaded - timing.arrived
            await stream.open()  # before the job: no token can be missed
            await self.submit(generation, request_id, prompt, sampling)
        except asyncio.CancelledError:  # the client left before the answer started
            generation.close("client gone")
            raise
        except BaseException:
            generation.close()
            raise
        return generation

    def _prepare(self, request, images, prompt_index: int) -> tuple[Prompt, SamplingParams]:
        """The prompt and sampling of a request (in a thread: templates, tokenizers, grammars take time)."""
        if isinstance(request, CompletionRequest):
            prompt = Prompt(self.text_prompt(request.prompts()[prompt_index], request.add_special_tokens is not False))
            constraint, param = structured_constraint(request), "prompt"
        else:
            options = template_options(request, request.tools if request.uses_tools() else None)
            stills = [prompt_size(i) for i in images if not isinstance(i, DecodedVideo)]
            prompt = self.builder.build(request.messages, stills, options, self._video_shapes(images))
            constraint, param = structured_constraint(request) or tool_constraint(request), "messages"
        sampling = self.sampling.build(request, len(prompt.token_ids), request.top_logprob_count, constraint, param)
        return prompt, sampling

    def _check_counts(self, parts: list[tuple[str, object]]) -> None:
        s = self.settings
        for kind, limit in s.limit_mm_per_prompt.items():
            count = sum(k.startswith(kind) for k, _ in parts)  # images: image_url and image_embeds parts
            if count and s.text_only:
                raise ApiError(400, f"this server serves text only: {kind} input is not accepted", "messages")
            if count > limit:
                raise ApiError(400, f"too many {kind}s: {count} (at most {limit})", "messages")

    def _video_shapes(self, media: list) -> list[VideoShape]:
        geometry = self.media.video_geometry
        return [VideoShape(v.num_frames, v.height, v.width,
                           geometry.timing(v.sampling.frame_indices, v.sampling.total_frames, v.sampling.source_fps))
                for v in media if isinstance(v, DecodedVideo)]

    def text_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A text completion's prompt as token ids. Unlike chat (where the template is ours and client text
        stays text), the client writes the whole prompt, so special tokens in it are read as such (vLLM)."""
        if isinstance(prompt, list):
            if any(t >= self.sampling.vocab_size for t in prompt):
                raise ApiError(400, f"prompt token ids must be below the vocabulary size {self.sampling.vocab_size}",
                               "prompt")
            return list(prompt)
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens, split_special_tokens=False)["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return ids

    # -- 3. encode and prefill ----------------------------------------------------------------------
    async def submit(self, generation: Generation, attempt: str, prompt: Prompt, sampling: SamplingParams,
                     output_offset: int = 0) -> None:
        images, stream = generation.images, generation.stream.subject
        planned = slots.plan(prompt, images)
        spans = slots.spans(planned, self.merge)
        encoded: dict[int, EncodeResult] = {}  # by image, once encoded through the encoder subjects
        leave_out = generation.resumes == 0  # a resume sends every image
        tried: set[str] = set()  # workers this request went to: gone, or too slow to accept it
        vanished: set[str] = set()  # those of them that went away
        gone, sent, until = 0, False, self.workers.deadline()
        try:
            while True:
                await self.workers.intake(until, exclude=vanished)  # none listed: the queue group, and NATS says
                route = await self.intake.route(prompt.token_ids, spans, exclude=tried)
                target = route.target
                if kind_of(target.instance) == "prefill":
                    await self.workers.decode(until)  # it hands the prompt on to one
                cached = slots.inside(planned, route.cached_tokens, self.merge) if leave_out else set()
                cached -= encoded.keys()  # encoded for a worker that went away: sent, or nobody pulls them
                needed = [i for i in range(len(planned)) if i not in cached and not isinstance(images[i], ImageEmbeds)]
                in_place = bool(needed) and self.intake.encodes_in_place(target)
                await self._decode(generation, needed)
                if not in_place and (missing := [i for i in needed if i not in encoded]):
                    encoded.update(zip(missing, await self._encode(generation, attempt, missing)))
                published = self._publish(images, cached, needed if in_place else [])
                try:
                    job = self.prefill_job(attempt, prompt.token_ids, planned, images, cached, encoded, published,
                                           sampling, stream, output_offset)
                    if not sent:  # the first_token stage counts from here (in place: the images' encoding too)
                        generation.timing.submitted, sent = time.time(), True
                    with self.intake.outstanding.sending(target.instance):
                        reply = await call_watched(self.nc, self.directory, target, pack(job),
                                                   self.settings.prefill_timeout, self.workers.intake_name())
                    generation.stream.expect(attempt, unpack(PrefillAccepted, reply).prefill_id)
                    self.images_cached += len(cached)
                    return
                except ServiceCallError as err:
                    if isinstance(err, WorkerGone) or (err.no_responders and target.instance):
                        # died before it accepted, or left (draining) since it was listed: another takes it now
                        tried.add(target.instance)
                        vanished.add(target.instance)
                        log.warning("prefill.worker_gone", request_id=attempt, worker=target.instance)
                        if len(tried) > RESUME_ATTEMPTS:
                            raise ApiError(503, f"every {self.workers.intake_name()} this request was sent to went "
                                                "away") from None
                        continue
                    if err.status == EMBEDDINGS_GONE and gone < ENCODE_ATTEMPTS:
                        # their encoder went away before prefill pulled them, or the worker no longer holds what
                        # it was said to: every image encoded again and sent, under an id of its own (a refused
                        # split prefill cancels the old one's decode reservation by its id)
                        gone += 1
                        await self.plane.discard([result.embedding for result in encoded.values()])  # still held
                        encoded, leave_out, attempt = {}, False, f"{attempt}.g{gone}"
                        log.warning("prefill.embeddings_gone", request_id=attempt, message=err.message)
                        continue
                    if err.status == 504:
                        self.cancel_soon(attempt, "prefill timeout")
                        if target.instance and len(tried) < RESUME_ATTEMPTS:
                            # slow is not dead, and that worker may still take it: cancelled there, the prompt
                            # goes to another under an id of its own (the cancel names the old one)
                            tried.add(target.instance)
                            log.warning("prefill.timeout_retry", request_id=attempt, worker=target.instance)
                            attempt = f"{attempt}.t{len(tried)}"
                            continue
                    raise ApiError(503 if err.status == EMBEDDINGS_GONE else err.status, err.message) from None
                finally:
                    for handle in published.values():
                        self.plane.release(handle)
        except BaseException:  # not accepted: its embeddings will not be pulled, the encoders free them now
            self.chores.spawn(self.plane.discard([result.embedding for result in encoded.values()]))
            raise

    async def _decode(self, generation: Generation, indices: list[int]) -> None:
        """The images of ``indices`` that were only recognised by their bytes, decoded (they are sent)."""
        images = generation.images
        todo = [i for i in indices if isinstance(images[i], RecognisedImage)]
        for i, image in zip(todo, await asyncio.gather(*(self.media.decode(images[i]) for i in todo))):
            if image.content_hash != images[i].content_hash:  # the same bytes decode the same, or the cache lies
                raise ApiError(500, "internal error: an image decoded otherwise than before")
            images[i] = image

    async def _encode(self, generation: Generation, attempt: str, indices: list[int]) -> list[EncodeResult]:
        """These images through the encoder subjects (the request's first encoding is its ``encode`` stage)."""
        started = time.time()
        results = await self.encoding.encode(attempt, [generation.images[i] for i in indices])
        generation.timing.stages.setdefault("encode", time.time() - started)
        return results

    def _publish(self, images: list, cached: set[int], in_place: list[int]) -> dict:
        """By image, what the worker pulls from this frontend's data plane before it accepts the prompt
        (released after its answer): the client's embeddings it does not hold, and the decoded pixels of
        ``in_place`` (for a worker that encodes in place)."""
        lease = self.settings.prefill_timeout + 30
        given = [i for i, image in enumerate(images) if isinstance(image, ImageEmbeds) and i not in cached]
        published = {i: self.plane.publish(images[i].rows, consumers=None, lease=lease) for i in given}
        return published | dict(zip(in_place, self.encoding.publish([images[i] for i in in_place], lease)))

    def prefill_job(self, request_id: str, token_ids: list[int], planned: list[ImageSlot], images: list,
                    cached: set[int], encoded: dict[int, EncodeResult], published: dict, sampling: SamplingParams,
                    stream: str, output_offset: int = 0) -> PrefillJob:
        """The job for a worker: each image left out (``cached``), or with the client's embeddings or its
        pixels ``published`` here, or with an encoder's embeddings (``encoded``)."""
        filled = [slots.cached(slot) if i in cached else
                  slots.with_embedding(slot, encoded[i]) if i in encoded and i not in published else
                  slots.given(slot, published[i], images[i]) for i, slot in enumerate(planned)]
        return PrefillJob(request_id=request_id, token_ids=token_ids, images=filled, sampling=sampling,
                          stream=stream, output_offset=output_offset)

    # -- 4. resume --------------------------------------------------------------------------------
    async def resume(self, generation: Generation, reason: str) -> None:
        """Continue on other workers from the prompt plus every token received so far."""
        if generation.resumes >= RESUME_ATTEMPTS:
            raise ApiError(503, "the model workers serving this request failed")
        generation.resumes += 1
        log.warning("request.resume", request_id=generation.request_id, reason=reason,
                    tokens=len(generation.generated))
        self.cancel_soon(generation.stream.attempt, "resumed elsewhere")
        attempt = f"{generation.request_id}.{generation.resumes}"
        base = generation.prompt
        prompt = dataclasses.replace(base, token_ids=base.token_ids + generation.generated)
        if len(generation.choices) > 1 and generation.completion_tokens:
            raise ApiError(503, "the model worker serving this request failed (requests with n > 1 are not "
                                "resumed once tokens have streamed)")
        done = len(generation.generated)
        sampling = msgspec.structs.replace(generation.sampling, max_tokens=generation.sampling.max_tokens - done,
                                           min_tokens=max(0, generation.sampling.min_tokens - done))
        await self.submit(generation, attempt, prompt, sampling, output_offset=len(generation.generated))

    # -- endings ----------------------------------------------------------------------------------
    def cancel_soon(self, request_id: str, reason: str) -> None:
        self.chores.spawn(self._cancel(request_id, reason))

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel, pack(Cancel(request_id=request_id, reason=reason)))
        except Exception:  # NATS gone: the stages' own timeouts and leases clean up
            log.warning("cancel.publish_failed", request_id=request_id)

    def stats(self) -> dict:
        return {"images_decoded": self.media.decoded, "images_recognised": self.media.recognised,
                "images_cached": self.images_cached, "images_encoded": self.encoding.encoded_images,
                "pixel_bytes_published": self.encoding.pixel_bytes, "prefix_lookups": self.intake.lookups}

    def finished(self, generation: Generation) -> None:
        self.chores.spawn(generation.stream.close())
        self.on_finished(generation)
