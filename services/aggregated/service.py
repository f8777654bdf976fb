"""Aggregated: encode, prefill and decode in one process with one engine — the baseline EPD is measured against.

It serves the encoder's and prefill's subjects (queue groups ``encoder`` and ``prefill``), so the unchanged
frontend talks to it as to a disaggregated stack. The vision half is an ``EncoderService`` held whole (its
batcher, data plane and endpoints); the language half is one engine of role ``both`` that prefills and then
keeps generating, streaming every token to the request's subject as prefill and decode do. Embeddings that
this process's own encoder holds come from its data plane's store without a copy (the plane short-circuits
its own handles); others (several aggregated replicas behind one frontend) are pulled over the network.
"""

from __future__ import annotations

import asyncio

from services.aggregated.settings import AggregatedSettings
from services.encoder.service import EncoderService
from services.prefill.service import validate_prompt
from shared.bus import QUEUE, CancelRegistry, ConcurrentEndpoint, HandlerError, Publisher
from shared.dataplane.store import DataPlaneError
from shared.engine.builder import build_engine
from shared.engine.engine import StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.sequence import ImageInput, Sequence
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import cancelled_request
from shared.messages.prefill import PrefillAccepted, PrefillJob
from shared.messages.stream import TokenEvent, error_event
from shared.service import ServiceBase

log = get_logger(__name__)


class AggregatedService(ServiceBase):
    kind = "aggregated"
    description = "Encoder + prefill + decode in one process and one engine (the aggregated baseline)"

    def __init__(self, settings: AggregatedSettings):
        super().__init__(settings)
        self.encoder = EncoderService(settings)
        self.encoder.instance = self.instance
        self.plane = self.encoder.plane  # one data plane per process: the encoder's
        self.endpoint = ConcurrentEndpoint("prefill", self.handle_prefill, settings.max_concurrent_prompts)
        self.jobs: dict[str, PrefillJob] = {}
        self.cancelled = CancelRegistry()
        self.engine = None
        self.prompts = 0
        self.tokens = 0

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), **self.encoder.metadata()}  # the encoder's cache fingerprint, if any

    async def setup(self, nc) -> None:
        self.encoder.nc = nc
        await self.encoder.setup(nc)  # the vision tower first: the KV pool is sized from what is left
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, "both")
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop())
        self.loop.start()
        self.publisher = Publisher(nc)
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)

    async def serve(self, service) -> None:
        await self.encoder.serve(service)
        await self.endpoint.add_to(service, self.subjects.prefill, QUEUE["prefill"])

    # -- admission -----------------------------------------------------------------------------------
    async def handle_prefill(self, data: bytes) -> bytes:
        job = unpack(PrefillJob, data)
        validate_prompt(job, self.config)
        try:
            embeds = await asyncio.gather(*(self.plane.pull(slot.embedding) for slot in job.images))
        except DataPlaneError as err:
            raise HandlerError(502, f"could not fetch image embeddings: {err.message}")
        if job.request_id in self.cancelled:
            raise HandlerError(499, "request was cancelled")
        seq = Sequence(job.request_id, list(job.token_ids), len(job.token_ids), job.sampling,
                       images=[ImageInput(s.offset, tuple(s.grid), e) for s, e in zip(job.images, embeds)],
                       output_offset=job.output_offset)
        self.jobs[job.request_id] = job
        try:
            await self.loop.call(lambda engine: engine.add_prompt(seq))
        except ValueError as err:
            self.jobs.pop(job.request_id, None)
            raise HandlerError(400, str(err))
        self.prompts += 1
        return pack(PrefillAccepted(prefill_id=self.instance))

    # -- engine outputs ------------------------------------------------------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self.jobs.get(out.seq.request_id)
            if job is None:
                continue  # cancelled while the step ran
            self.tokens += 1
            event = TokenEvent(request_id=job.request_id, index=out.index, token_ids=[out.token],
                               finish_reason=out.finish_reason, worker=self.instance)
            self.publisher.publish(job.stream, pack(event))
            if out.finish_reason is not None:
                self.jobs.pop(job.request_id, None)

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            job = self.jobs.pop(request_id, None)
            if job is not None:
                event = error_event(request_id, 500, "generation failed", self.instance)
                self.publisher.publish(job.stream, pack(event))

    async def on_cancel(self, msg) -> None:
        request_id = cancelled_request(msg.data)
        if request_id is None:
            return
        self.cancelled.add(request_id)
        if self.jobs.pop(request_id, None) is not None:
            await self.loop.call(lambda engine: engine.abort(request_id))

    # -- lifecycle -----------------------------------------------------------------------------------
    async def drain(self) -> None:
        await asyncio.gather(self.encoder.drain(), self.endpoint.drain())
        while self.jobs:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        await self.publisher.close()
        await self.encoder.close()

    def stats(self) -> dict:
        return {
            **(self.engine.block_stats() if self.engine else {}),
            **self.encoder.stats(),
            "prompts": self.prompts,
            "tokens": self.tokens,
            "running": len(self.jobs),
            "errors": self.encoder.endpoint.errors + self.endpoint.errors,
        }
