"""Prefill: language model only. Pulls image embeddings by handle, computes the prompt (batched across
requests), sends the first token straight to the request's stream, and hands the sequence and its KV to
a decode worker."""

from __future__ import annotations

import asyncio

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
from shared.messages import decode, encode
from shared.messages.control import Cancel
from shared.messages.decode import DecodeAccepted, DecodeJob
from shared.messages.prefill import PrefillAccepted, PrefillJob
from shared.messages.stream import ErrorInfo, TokenEvent
from shared.model.config import ModelConfig
from shared.service import ServiceBase

log = get_logger(__name__)


def validate_prompt(job: PrefillJob, config: ModelConfig) -> None:
    """Every placeholder token belongs to exactly one image slot, and every slot to a placeholder run."""
    vocab = config.text.vocab_size
    if any(not 0 <= t < vocab for t in job.token_ids):
        raise HandlerError(400, "token id out of the vocabulary")
    covered = 0
    end = 0
    unit = config.vision.merge_size ** 2
    for slot in sorted(job.images, key=lambda s: s.offset):
        t, h, w = slot.grid
        if t < 1 or h < 1 or w < 1 or h % config.vision.merge_size or w % config.vision.merge_size:
            raise HandlerError(400, "invalid image grid")
        n = t * h * w // unit
        if slot.offset < end or slot.offset + n > len(job.token_ids):
            raise HandlerError(400, "image slots overlap or run past the prompt")
        if any(tok != config.image_token_id for tok in job.token_ids[slot.offset:slot.offset + n]):
            raise HandlerError(400, "image slot does not cover a run of image placeholder tokens")
        if list(slot.embedding.shape) != [n, config.text.hidden_size]:
            raise HandlerError(400, "image embedding shape does not match its grid")
        covered += n
        end = slot.offset + n
    if covered != sum(1 for tok in job.token_ids if tok == config.image_token_id):
        raise HandlerError(400, "image placeholder tokens without an image")


class PrefillService(ServiceBase):
    kind = "prefill"
    description = "Language-model prefill: prompt + image embeddings in, first token and KV out"

    def __init__(self, settings: PrefillSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.endpoint = ConcurrentEndpoint("prefill", self.handle_prefill, settings.max_concurrent_jobs)
        self.jobs: dict[str, PrefillJob] = {}
        self.handoffs: set[asyncio.Task] = set()
        self.cancelled = CancelRegistry()
        self.engine = None
        self.prompts = 0
        self.prompt_tokens = 0

    async def setup(self, nc) -> None:
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, "prefill")
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop())
        self.loop.start()
        self.publisher = Publisher(nc)
        await self.plane.start()
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)

    async def serve(self, service) -> None:
        await self.endpoint.add_to(service, self.subjects.prefill, QUEUE["prefill"])

    async def handle_prefill(self, data: bytes) -> bytes:
        job = decode(PrefillJob, data)
        validate_prompt(job, self.config)
        try:
            embeds = await asyncio.gather(*(self.plane.pull(slot.embedding) for slot in job.images))
        except DataPlaneError as err:
            raise HandlerError(502, f"could not fetch image embeddings: {err.message}")
        if job.request_id in self.cancelled:
            raise HandlerError(499, "request was cancelled")
        seq = Sequence(job.request_id, list(job.token_ids), len(job.token_ids), job.sampling,
                       images=[ImageInput(s.offset, tuple(s.grid), e) for s, e in zip(job.images, embeds)])
        self.jobs[job.request_id] = job
        try:
            await self.loop.call(lambda engine: engine.add_prompt(seq))
        except ValueError as err:
            self.jobs.pop(job.request_id, None)
            raise HandlerError(400, str(err))
        self.prompts += 1
        self.prompt_tokens += len(seq)
        return encode(PrefillAccepted(prefill_id=self.instance))

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self.jobs.pop(out.seq.request_id, None)
            if job is None:
                continue  # cancelled while computing
            event = TokenEvent(request_id=job.request_id, index=out.index, token_ids=[out.token],
                               finish_reason=out.finish_reason)
            self.publisher.publish(job.stream, encode(event))
            if out.kv is not None:
                task = asyncio.create_task(self.hand_off(job, out.seq, out.kv), name="handoff")
                self.handoffs.add(task)
                task.add_done_callback(self.handoffs.discard)

    async def hand_off(self, job: PrefillJob, seq: Sequence, kv: torch.Tensor) -> None:
        handle = self.plane.publish(kv, consumers=1)
        decode_job = DecodeJob(request_id=job.request_id, token_ids=seq.token_ids, prompt_len=seq.prompt_len,
                               rope_delta=seq.rope_delta, sampling=job.sampling, stream=job.stream, kv=handle)
        try:
            decode(DecodeAccepted, await call(self.nc, self.subjects.decode, encode(decode_job),
                                              self.settings.handoff_timeout, "decode worker"))
        except ServiceCallError as err:
            self.plane.release(handle)
            self._fail(job.stream, job.request_id, 1, err.status, err.message)
        except Exception:
            self.plane.release(handle)
            log.exception("prefill.handoff_failed", request_id=job.request_id)
            self._fail(job.stream, job.request_id, 1, 500, "handing the request to decode failed")

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            job = self.jobs.pop(request_id, None)
            if job is not None:
                self._fail(job.stream, request_id, 0, 500, "prefill failed")

    def _fail(self, stream: str, request_id: str, index: int, status: int, message: str) -> None:
        event = TokenEvent(request_id=request_id, index=index, error=ErrorInfo(status=status, message=message))
        self.publisher.publish(stream, encode(event))

    async def on_cancel(self, msg) -> None:
        try:
            request_id = decode(Cancel, msg.data).request_id
        except ValueError:
            return
        self.cancelled.add(request_id)
        if self.jobs.pop(request_id, None) is not None:
            await self.loop.call(lambda engine: engine.abort(request_id))

    async def drain(self) -> None:
        await self.endpoint.drain()
        while self.jobs or self.handoffs:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        await self.publisher.close()
        await self.plane.stop()

    def stats(self) -> dict:
        blocks = self.engine.blocks if self.engine else None
        return {
            "instance": self.instance,
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "active": len(self.jobs),
            "kv_blocks_free": blocks.num_free if blocks else 0,
            "kv_blocks_used": blocks.num_used if blocks else 0,
            "errors": self.endpoint.errors,
            "bytes_held": self.plane.store.bytes_held,
        }
