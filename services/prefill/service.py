"""Prefill: language model only. Pulls image embeddings by handle, reserves room on a decode worker,
computes the prompt (batched across requests) while streaming its KV to that worker layer group by
layer group, sends the first token straight to the request's stream, and starts the decode."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from services.prefill.settings import PrefillSettings
from shared.bus import QUEUE, CancelRegistry, ConcurrentEndpoint, HandlerError, Publisher, ServiceCallError, call
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.builder import build_engine
from shared.engine.engine import StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.sequence import ImageInput, Sequence
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import Cancel, cancelled_request
from shared.messages.decode import DecodeAccepted, DecodeStart, KVChunk, KVReservation, KVReserve
from shared.messages.prefill import PrefillAccepted, PrefillJob
from shared.messages.stream import TokenEvent, error_event
from shared.model.config import ModelConfig
from shared.model.geometry import grid_tokens
from shared.service import ServiceBase

log = get_logger(__name__)

_FULL_RETRY_FIRST = 0.05  # seconds before asking full decode workers again; doubles up to the next
_FULL_RETRY_MAX = 0.5


def validate_prompt(job: PrefillJob, config: ModelConfig) -> None:
    """Every placeholder token belongs to exactly one image slot, and every slot to a placeholder run."""
    vocab = config.text.vocab_size
    if any(not 0 <= t < vocab for t in job.token_ids):
        raise HandlerError(400, "token id out of the vocabulary")
    covered = 0
    end = 0
    for slot in sorted(job.images, key=lambda s: s.offset):
        t, h, w = slot.grid
        if t < 1 or h < 1 or w < 1 or h % config.vision.merge_size or w % config.vision.merge_size:
            raise HandlerError(400, "invalid image grid")
        n = grid_tokens(slot.grid, config.vision.merge_size)
        if slot.offset < end or slot.offset + n > len(job.token_ids):
            raise HandlerError(400, "image slots overlap or run past the prompt")
        if any(tok != config.image_token_id for tok in job.token_ids[slot.offset:slot.offset + n]):
            raise HandlerError(400, "image slot does not cover a run of image placeholder tokens")
        if list(slot.embedding.shape) != [n, config.embedding_width]:  # Qwen3-VL: deepstack levels too
            raise HandlerError(400, "image embedding shape does not match its grid")
        covered += n
        end = slot.offset + n
    # Only the client's prompt places images; tokens the model generated earlier (a resumed request's
    # tail) are plain tokens even when they happen to be the placeholder id.
    prompt = job.token_ids[:len(job.token_ids) - job.output_offset]
    if end > len(prompt) or covered != sum(1 for tok in prompt if tok == config.image_token_id):
        raise HandlerError(400, "image placeholder tokens without an image")


@dataclass
class Handoff:
    """A request between admission and its decode start: where its KV goes, and the chunks in flight."""

    job: PrefillJob
    decode_id: str
    chunks: list[asyncio.Task] = field(default_factory=list)


class PrefillService(ServiceBase):
    kind = "prefill"
    description = "Language-model prefill: prompt + image embeddings in, first token and KV out"

    def __init__(self, settings: PrefillSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.endpoint = ConcurrentEndpoint("prefill", self.handle_prefill, settings.max_concurrent_jobs)
        self.handoffs: dict[str, Handoff] = {}
        self.tasks: set[asyncio.Task] = set()
        self.cancelled = CancelRegistry()
        self.engine = None
        self.prompts = 0
        self.waited_for_decode = 0  # times a request was told "every decode worker is full" and waited
        self.prompt_tokens = 0
        self.chunks_sent = 0

    async def setup(self, nc) -> None:
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, "prefill")
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop(),
                               on_layer_done=self.on_layer_done)
        self.loop.start()
        self.publisher = Publisher(nc)
        await self.plane.start()
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)

    async def serve(self, service) -> None:
        await self.endpoint.add_to(service, self.subjects.prefill, QUEUE["prefill"])

    # -- admission --------------------------------------------------------------------------------
    async def handle_prefill(self, data: bytes) -> bytes:
        job = unpack(PrefillJob, data)
        validate_prompt(job, self.config)
        if len(job.token_ids) >= self.engine.max_model_len:
            raise HandlerError(400, f"prompt of {len(job.token_ids)} tokens does not fit the context "
                                    f"({self.engine.max_model_len})")
        try:
            device = self.engine.runner.device  # GPU to GPU where the transport can (UCX)
            embeds = await asyncio.gather(*(self.plane.pull(slot.embedding, device=device) for slot in job.images))
        except DataPlaneError as err:
            raise HandlerError(502, f"could not fetch image embeddings: {err.message}")
        decode_id = await self._reserve(job)
        if job.request_id in self.cancelled:
            await self._release_reservation(job.request_id)
            raise HandlerError(499, "request was cancelled")
        seq = Sequence(job.request_id, list(job.token_ids), len(job.token_ids), job.sampling,
                       images=[ImageInput(s.offset, tuple(s.grid), e) for s, e in zip(job.images, embeds)],
                       output_offset=job.output_offset)
        self.handoffs[job.request_id] = Handoff(job, decode_id)
        try:
            await self.loop.call(lambda engine: engine.add_prompt(seq))
        except ValueError as err:
            self.handoffs.pop(job.request_id, None)
            await self._release_reservation(job.request_id)
            raise HandlerError(400, str(err))
        self.prompts += 1
        self.prompt_tokens += len(seq)
        return pack(PrefillAccepted(prefill_id=self.instance))

    async def _reserve(self, job: PrefillJob) -> str:
        """Room on a decode worker before any compute. While every decode worker is full the request
        waits here, asking again with back-off (the queue group may pick another worker each time), for
        up to ``decode_wait`` seconds: overload queues requests instead of failing them. No decode worker
        at all, or room still lacking at the deadline: 503."""
        request = KVReserve(request_id=job.request_id, num_tokens=len(job.token_ids),
                            max_tokens=job.sampling.max_tokens, stream=job.stream)
        deadline = time.monotonic() + self.settings.decode_wait
        pause = _FULL_RETRY_FIRST
        while True:
            try:
                reply = await call(self.nc, self.subjects.decode, pack(request), self.settings.handoff_timeout,
                                   "decode worker")
                return unpack(KVReservation, reply).decode_id
            except ServiceCallError as err:
                full = err.status == 503 and not err.no_responders
                if not full or time.monotonic() + pause > deadline or job.request_id in self.cancelled:
                    raise HandlerError(err.status, err.message) from None
            self.waited_for_decode += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, _FULL_RETRY_MAX)

    async def _release_reservation(self, request_id: str) -> None:
        await self.nc.publish(self.subjects.cancel, pack(Cancel(request_id=request_id, reason="prefill gave up")))

    # -- KV streaming (engine thread → event loop) ------------------------------------------------
    def on_layer_done(self, layer: int, seqs: list[Sequence]) -> None:
        """Engine thread, during a prefill: at the end of each layer group, copy the group's KV out."""
        group = self.settings.kv_chunk_layers
        layers = self.config.text.num_layers
        if (layer + 1) % group and layer + 1 != layers:
            return
        first = layer // group * group
        for seq in seqs:
            kv = self.engine.read_kv(seq, slice(first, layer + 1))
            self.loop.loop.call_soon_threadsafe(self._send_chunk, seq.request_id, first, layer + 1, kv)

    def _send_chunk(self, request_id: str, first: int, last: int, kv: torch.Tensor) -> None:
        handoff = self.handoffs.get(request_id)
        if handoff is None:
            return  # cancelled meanwhile
        handle = self.plane.publish(kv, consumers=1)
        chunk = KVChunk(request_id=request_id, first_layer=first, last_layer=last, kv=handle)
        task = self._spawn(call(self.nc, self.subjects.decode_kv(handoff.decode_id), pack(chunk),
                                self.settings.handoff_timeout, "decode worker"))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.plane.release(handle))
        handoff.chunks.append(task)
        self.chunks_sent += 1

    # -- first token, decode start ----------------------------------------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            handoff = self.handoffs.get(out.seq.request_id)
            if handoff is None:
                continue  # cancelled while computing
            job = handoff.job
            # the decode worker holding the reservation is responsible from here on: the frontend
            # watches it, and resumes the request elsewhere if it dies before or while decoding
            event = TokenEvent(request_id=job.request_id, index=out.index, token_ids=[out.token],
                               finish_reason=out.finish_reason, worker=handoff.decode_id)
            self.publisher.publish(job.stream, pack(event))
            if out.finish_reason is not None:
                self.handoffs.pop(job.request_id, None)
                self._spawn(self._release_reservation(job.request_id))  # nothing left to decode
            else:
                start = DecodeStart(request_id=job.request_id, token_ids=out.seq.token_ids[:out.seq.prompt_len + 1],
                                    prompt_len=out.seq.prompt_len, rope_delta=out.seq.rope_delta,
                                    sampling=job.sampling, stream=job.stream, output_offset=job.output_offset)
                self._spawn(self._start_decode(handoff, start))

    async def _start_decode(self, handoff: Handoff, start: DecodeStart) -> None:
        rid = start.request_id
        try:
            for chunk in handoff.chunks:
                await chunk
            reply = await call(self.nc, self.subjects.decode_start(handoff.decode_id), pack(start),
                               self.settings.handoff_timeout, "decode worker")
            unpack(DecodeAccepted, reply)
        except ServiceCallError as err:
            self._fail(start.stream, rid, err.status, f"handing the request to decode failed: {err.message}")
            await self._release_reservation(rid)
        except Exception:
            log.exception("prefill.handoff_failed", request_id=rid)
            self._fail(start.stream, rid, 500, "handing the request to decode failed")
            await self._release_reservation(rid)
        finally:
            self.handoffs.pop(rid, None)

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            handoff = self.handoffs.pop(request_id, None)
            if handoff is not None:
                self._fail(handoff.job.stream, request_id, 500, "prefill failed")
                self._spawn(self._release_reservation(request_id))

    def _fail(self, stream: str, request_id: str, status: int, message: str) -> None:
        self.publisher.publish(stream, pack(error_event(request_id, status, message, self.instance)))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), ServiceCallError):
            log.error("prefill.task_failed", error=repr(task.exception()))

    async def on_cancel(self, msg) -> None:
        request_id = cancelled_request(msg.data)
        if request_id is None:
            return
        self.cancelled.add(request_id)
        if self.handoffs.pop(request_id, None) is not None:
            await self.loop.call(lambda engine: engine.abort(request_id))

    # -- lifecycle --------------------------------------------------------------------------------
    async def drain(self) -> None:
        await self.endpoint.drain()
        while self.handoffs or self.tasks:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        await self.publisher.close()
        await self.plane.stop()

    def stats(self) -> dict:
        return {
            **(self.engine.block_stats() if self.engine else {}),
            "instance": self.instance,
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "active": len(self.handoffs),
            "kv_chunks_sent": self.chunks_sent,
            "decode_full_waits": self.waited_for_decode,
            "errors": self.endpoint.errors,
            "bytes_held": self.plane.store.bytes_held,
        }
