"""Decode: language model only. Reserves KV blocks for a sequence before its prompt KV is transferred,
lands the KV layer group by layer group as prefill streams it, then generates in a continuous batch and
streams every token to the request. A reservation that is cancelled, fails or times out is freed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.decode.settings import DecodeSettings
from shared.bus import QUEUE, CancelRegistry, ConcurrentEndpoint, HandlerError, Publisher, leave_endpoints
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.builder import build_engine
from shared.engine.engine import StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import cancelled_request
from shared.messages.decode import DecodeAccepted, DecodeStart, KVChunk, KVReservation, KVReserve
from shared.messages.stream import TokenEvent, error_event
from shared.service import ServiceBase

log = get_logger(__name__)


@dataclass
class Reservation:
    seq: Sequence  # prompt-length placeholder until the start fills in the real tokens
    stream: str
    deadline: float
    landed: set[int] = field(default_factory=set)  # layers whose KV is in the blocks
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class DecodeService(ServiceBase):
    kind = "decode"
    description = "Language-model decode: continuous batching over KV streamed from prefill"

    def __init__(self, settings: DecodeSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        limit = settings.max_concurrent_jobs
        self.reserve_endpoint = ConcurrentEndpoint("reserve", self.handle_reserve, limit)
        self.kv_endpoint = ConcurrentEndpoint("kv", self.handle_kv, limit)
        self.start_endpoint = ConcurrentEndpoint("start", self.handle_start, limit)
        self.reservations: dict[str, Reservation] = {}
        self.streams: dict[str, str] = {}  # running request → its stream subject
        self.cancelled = CancelRegistry()
        self.engine = None
        self.accepted = 0
        self.tokens = 0
        self.expired = 0

    async def setup(self, nc) -> None:
        self.engine, self.config = await asyncio.to_thread(build_engine, self.settings, "decode")
        self.loop = EngineLoop(self.engine, self.on_outputs, self.on_failure, asyncio.get_running_loop())
        self.loop.start()
        self.publisher = Publisher(nc)
        await self.plane.start()
        await nc.subscribe(self.subjects.cancel, cb=self.on_cancel)
        self.sweeper = asyncio.create_task(self._expire_forever(), name="reservation-sweeper")

    async def serve(self, service) -> None:
        await self.reserve_endpoint.add_to(service, self.subjects.decode, QUEUE["decode"])
        await self.kv_endpoint.add_to(service, self.subjects.decode_kv(self.instance), QUEUE["decode"])
        await self.start_endpoint.add_to(service, self.subjects.decode_start(self.instance), QUEUE["decode"])

    # -- 1. reserve --------------------------------------------------------------------------------
    async def handle_reserve(self, data: bytes) -> bytes:
        request = unpack(KVReserve, data)
        rid = request.request_id
        if rid in self.cancelled:
            raise HandlerError(499, "request was cancelled")
        if rid in self.reservations or rid in self.streams:
            raise HandlerError(409, "request already has a reservation here")
        if request.num_tokens + 1 > self.engine.max_model_len:
            raise HandlerError(400, "prompt does not fit this decode worker's context")
        seq = Sequence(rid, [0] * request.num_tokens, request.num_tokens,
                       SamplingParams(max_tokens=request.max_tokens), num_computed=request.num_tokens)

        def reserve(engine) -> bool:
            if not engine.can_reserve(request.num_tokens + 1):
                return False
            engine.reserve(seq)
            return True

        if not await self.loop.call(reserve):
            raise HandlerError(503, "decode worker has no free KV blocks")
        self.reservations[rid] = Reservation(seq, request.stream, time.monotonic() + self.settings.reservation_timeout)
        return pack(KVReservation(decode_id=self.instance))

    # -- 2. KV chunks ------------------------------------------------------------------------------
    async def handle_kv(self, data: bytes) -> bytes:
        chunk = unpack(KVChunk, data)
        reservation = self.reservations.get(chunk.request_id)
        if reservation is None:
            raise HandlerError(404, "no reservation for this request (expired or cancelled)")
        text = self.config.text
        layers = range(chunk.first_layer, chunk.last_layer)
        expected = [len(layers), 2, reservation.seq.num_computed, text.num_kv_heads, text.head_dim]
        if chunk.last_layer > text.num_layers or list(chunk.kv.shape) != expected:
            raise HandlerError(400, f"KV chunk of shape {chunk.kv.shape} for layers {chunk.first_layer}.."
                                    f"{chunk.last_layer} does not match this model ({expected})")
        try:
            kv = await self.plane.pull(chunk.kv, device=self.engine.runner.device)
        except DataPlaneError as err:
            raise HandlerError(502, f"could not fetch the KV chunk: {err.message}") from None
        if self.reservations.get(chunk.request_id) is not reservation:
            raise HandlerError(404, "the reservation ended while the chunk was in flight")
        target = slice(chunk.first_layer, chunk.last_layer)
        await self.loop.call(lambda engine: engine.write_kv(chunk.request_id, kv, target))
        reservation.landed.update(layers)
        if len(reservation.landed) == text.num_layers:
            reservation.complete.set()
        return b""

    # -- 3. start ----------------------------------------------------------------------------------
    async def handle_start(self, data: bytes) -> bytes:
        start = unpack(DecodeStart, data)
        rid = start.request_id
        reservation = self.reservations.get(rid)
        if reservation is None:
            raise HandlerError(404, "no reservation for this request (expired or cancelled)")
        seq = reservation.seq
        if len(start.token_ids) != seq.num_computed + 1 or start.prompt_len > seq.num_computed or any(
                not 0 <= t < self.config.text.vocab_size for t in start.token_ids):
            raise HandlerError(400, "start does not match the reservation (token count or ids)")
        try:
            await asyncio.wait_for(reservation.complete.wait(), max(0.0, reservation.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise HandlerError(504, "the KV transfer did not complete in time") from None
        if self.reservations.pop(rid, None) is not reservation:
            raise HandlerError(404, "the reservation ended while waiting for its KV")
        seq.token_ids = list(start.token_ids)
        seq.prompt_len = start.prompt_len
        seq.sampling = start.sampling
        seq.rope_delta = start.rope_delta
        seq.output_offset = start.output_offset
        self.streams[rid] = start.stream
        await self.loop.call(lambda engine: engine.activate(rid))
        self.accepted += 1
        return pack(DecodeAccepted(decode_id=self.instance))

    # -- tokens out --------------------------------------------------------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.seq.request_id)
            if stream is None:
                continue
            self.tokens += 1
            event = TokenEvent(request_id=out.seq.request_id, index=out.index, token_ids=[out.token],
                               finish_reason=out.finish_reason, worker=self.instance)
            self.publisher.publish(stream, pack(event))
            if out.finish_reason is not None:
                self.streams.pop(out.seq.request_id, None)

    def on_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            stream = self.streams.pop(request_id, None)
            reservation = self.reservations.pop(request_id, None)
            stream = stream or (reservation.stream if reservation else None)
            if stream is not None:
                self._fail(stream, request_id, 500, "decode failed")

    def _fail(self, stream: str, request_id: str, status: int, message: str) -> None:
        self.publisher.publish(stream, pack(error_event(request_id, status, message, self.instance)))

    # -- ending early ------------------------------------------------------------------------------
    async def on_cancel(self, msg) -> None:
        request_id = cancelled_request(msg.data)
        if request_id is None:
            return
        self.cancelled.add(request_id)
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None or self.streams.pop(request_id, None) is not None:
            await self.loop.call(lambda engine: engine.abort(request_id))

    async def _expire_forever(self) -> None:
        """Free reservations whose transfer or start never came (a prefill that died half-way)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, reservation in list(self.reservations.items()):
                if now > reservation.deadline and self.reservations.pop(rid, None) is reservation:
                    self.expired += 1
                    await self.loop.call(lambda engine, rid=rid: engine.abort(rid))
                    self._fail(reservation.stream, rid, 504, "the KV transfer from prefill did not complete")
                    log.warning("decode.reservation_expired", request_id=rid, layers=len(reservation.landed))

    # -- lifecycle ---------------------------------------------------------------------------------
    async def stop_intake(self) -> None:
        """Take no new reservations, but keep landing KV and starting the ones already made."""
        await leave_endpoints(self.service, {"reserve"})

    async def drain(self) -> None:
        for endpoint in (self.reserve_endpoint, self.kv_endpoint, self.start_endpoint):
            await endpoint.drain()
        while self.streams or self.reservations:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.sweeper.cancel()
        await asyncio.to_thread(self.loop.stop)
        await self.publisher.close()
        await self.plane.stop()

    def stats(self) -> dict:
        return {
            **(self.engine.block_stats() if self.engine else {}),
            "instance": self.instance,
            "accepted": self.accepted,
            "tokens": self.tokens,
            "running": len(self.streams),
            "reservations": len(self.reservations),
            "reservations_expired": self.expired,
            "errors": sum(e.errors for e in (self.reserve_endpoint, self.kv_endpoint, self.start_endpoint)),
        }
