"""Decode: language model only. Takes sequences whose prompt KV was computed by prefill, reserves KV
blocks before pulling it, and generates in a continuous batch, streaming every token to its request."""

from __future__ import annotations

import asyncio

from services.decode.settings import DecodeSettings
from shared.bus import QUEUE, CancelRegistry, ConcurrentEndpoint, HandlerError, Publisher
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.builder import build_engine
from shared.engine.engine import StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.sequence import Sequence
from shared.logging import get_logger
from shared.messages import decode, encode
from shared.messages.control import Cancel
from shared.messages.decode import DecodeAccepted, DecodeJob
from shared.messages.stream import ErrorInfo, TokenEvent
from shared.service import ServiceBase

log = get_logger(__name__)


class DecodeService(ServiceBase):
    kind = "decode"
    description = "Language-model decode: continuous batching over KV handed over by prefill"

    def __init__(self, settings: DecodeSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.endpoint = ConcurrentEndpoint("decode", self.handle_decode, settings.max_concurrent_jobs)
        self.jobs: dict[str, DecodeJob] = {}
        self.cancelled = CancelRegistry()
        self.engine = None
        self.accepted = 0
        self.tokens = 0

    async def setup(self, nc) -> None:
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, "decode")
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop())
        self.loop.start()
        self.publisher = Publisher(nc)
        await self.plane.start()
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)

    async def serve(self, service) -> None:
        await self.endpoint.add_to(service, self.subjects.decode, QUEUE["decode"])

    def _check(self, job: DecodeJob) -> None:
        text = self.config.text
        computed = len(job.token_ids) - 1
        expected = [text.num_layers, 2, computed, text.num_kv_heads, text.head_dim]
        if list(job.kv.shape) != expected:
            raise HandlerError(400, f"KV shape {job.kv.shape} does not match this model ({expected})")
        if job.prompt_len > computed or any(not 0 <= t < text.vocab_size for t in job.token_ids):
            raise HandlerError(400, "invalid token ids or prompt length")

    async def handle_decode(self, data: bytes) -> bytes:
        job = decode(DecodeJob, data)
        self._check(job)
        if job.request_id in self.cancelled:
            raise HandlerError(499, "request was cancelled")
        rid = job.request_id
        seq = Sequence(rid, list(job.token_ids), job.prompt_len, job.sampling, rope_delta=job.rope_delta,
                       num_computed=len(job.token_ids) - 1)

        def reserve(engine) -> bool:
            if not engine.can_reserve(len(seq) + 1):
                return False
            engine.reserve(seq)
            return True

        if not await self.loop.call(reserve):
            raise HandlerError(503, "decode worker has no free KV blocks")
        self.jobs[rid] = job
        try:
            kv = await self.plane.pull(job.kv)
            if rid not in self.jobs:
                raise HandlerError(499, "request was cancelled")
            await self.loop.call(lambda engine: (engine.write_kv(rid, kv), engine.activate(rid)))
        except BaseException as err:
            self.jobs.pop(rid, None)
            await self.loop.call(lambda engine: engine.abort(rid))
            if isinstance(err, DataPlaneError):
                raise HandlerError(502, f"could not fetch the KV cache: {err.message}") from None
            raise
        self.accepted += 1
        log.debug("decode.accepted", request_id=rid, tokens=len(seq))
        return encode(DecodeAccepted(decode_id=self.instance))

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self.jobs.get(out.seq.request_id)
            if job is None:
                continue
            self.tokens += 1
            event = TokenEvent(request_id=job.request_id, index=out.index, token_ids=[out.token],
                               finish_reason=out.finish_reason)
            self.publisher.publish(job.stream, encode(event))
            if out.finish_reason is not None:
                self.jobs.pop(job.request_id, None)

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            job = self.jobs.pop(request_id, None)
            if job is not None:
                event = TokenEvent(request_id=request_id, index=0, error=ErrorInfo(status=500, message="decode failed"))
                self.publisher.publish(job.stream, encode(event))

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
        while self.jobs:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        await self.publisher.close()
        await self.plane.stop()

    def stats(self) -> dict:
        blocks = self.engine.blocks if self.engine else None
        return {
            "instance": self.instance,
            "accepted": self.accepted,
            "tokens": self.tokens,
            "running": len(self.jobs),
            "kv_blocks_free": blocks.num_free if blocks else 0,
            "kv_blocks_used": blocks.num_used if blocks else 0,
            "kv_blocks_total": blocks.num_blocks if blocks else 0,
            "errors": self.endpoint.errors,
        }
