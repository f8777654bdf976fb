"""Decode: language model only. Reserves KV blocks for a sequence before its prompt KV is transferred,
lands the KV layer group by layer group as prefill streams it, then generates in a continuous batch and
streams every token to the request (the protocol: ``shared/messages/decode.py``, numbered the same here
and in ``services/prefill/handoff.py``)."""

from __future__ import annotations

import asyncio

from services.decode.reservations import Reservation, Reservations
from services.decode.settings import DecodeSettings
from services.language.intake import validate_sampling
from services.language.worker import LanguageWorker, Tracked
from shared.aio import TaskSet
from shared.bus.directory import Directory
from shared.bus.service_api import Endpoint, Request
from shared.bus.subjects import QUEUE
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.engine.sequence import Sequence
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.decode import DecodeAccepted, DecodeStart, KVChunk, KVReservation, KVReserve
from shared.messages.sampling import SamplingParams
from shared.messages.stream import error_event
from shared.service import Service

log = get_logger(__name__)


class DecodeService(Service):
    kind = "decode"
    description = "Language-model decode: continuous batching over KV streamed from prefill"
    intake_endpoints = {"reserve", "reserve-direct"}  # draining, it still lands the KV and starts what it reserved

    def __init__(self, settings: DecodeSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.worker = LanguageWorker(settings, "decode", self.subjects, self.instance)
        self.reservations = Reservations(settings.reservation_timeout, self._expired)
        self.worker.on_cancel.append(self.reservations.take)  # the worker's abort frees its blocks
        self.senders = TaskSet("kv-sender-watch")  # a reservation's prefill, watched until it ends
        self.directory: Directory | None = None
        self.accepted = 0

    async def setup(self) -> None:
        await self.open_plane()
        self.directory = Directory(self.nc, self.subjects.prefix)
        self.directory.start(listing=False)  # only the liveness pings of the prefills it waits on
        self.resources.push_async_callback(self.directory.stop)
        self.resources.push_async_callback(self.senders.cancel)
        await self.worker.start(self.nc, self.resources)

    def endpoints(self) -> list[Endpoint]:
        limit = self.settings.max_concurrent_jobs
        return [Endpoint("reserve", self.subjects.decode, QUEUE["decode"], self.handle_reserve, limit),
                Endpoint("reserve-direct", self.subjects.decode_reserve(self.instance), QUEUE["decode"],
                         self.handle_reserve, limit),
                Endpoint("kv", self.subjects.decode_kv(self.instance), QUEUE["decode"], self.handle_kv, limit),
                Endpoint("start", self.subjects.decode_start(self.instance), QUEUE["decode"], self.handle_start,
                         limit)]

    # -- 1. reserve -------------------------------------------------------------------------------
    async def handle_reserve(self, request: Request) -> bytes:
        reserve = unpack(KVReserve, request.data)
        rid = reserve.request_id
        self.worker.refuse_cancelled(rid)
        if rid in self.reservations or rid in self.worker.requests:
            raise ServiceError(409, "request already has a reservation here")
        if reserve.num_tokens + 1 > self.worker.engine.max_model_len:
            raise ServiceError(400, "prompt does not fit this decode worker's context")
        seq = Sequence(rid, [0] * reserve.num_tokens, reserve.num_tokens,
                       SamplingParams(max_tokens=reserve.max_tokens), num_computed=reserve.num_tokens)

        def reserve_blocks(engine) -> bool:
            if not engine.can_reserve(reserve.num_tokens + 1):
                return False
            engine.reserve(seq)
            return True

        if not await self.worker.loop.call(reserve_blocks):
            raise ServiceError(503, "decode worker has no free KV blocks")
        # cancelled while the engine reserved: the cancel's abort, queued behind the reserve, frees the
        # blocks, and a reservation held now would outlive it until --reservation-timeout
        self.worker.refuse_cancelled(rid)
        reservation = Reservation(seq, reserve.stream)
        self.reservations.hold(rid, reservation)
        if reserve.prefill_id:
            self.senders.spawn(self._watch_sender(rid, reservation, reserve.prefill_id))
        return pack(KVReservation(decode_id=self.instance))

    async def _watch_sender(self, rid: str, reservation: Reservation, prefill_id: str) -> None:
        """A prefill that dies after reserving never sends the rest: end the reservation as soon as NATS
        says it is gone, not after ``--reservation-timeout`` (the request resumes elsewhere at once)."""
        with self.directory.watching(prefill_id) as gone:
            waits = [asyncio.ensure_future(gone.wait()), asyncio.ensure_future(reservation.ended.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if gone.is_set():
            self.reservations.expire(rid, reservation, f"the prefill worker sending the KV ({prefill_id}) is gone")

    # -- 2. KV chunks -----------------------------------------------------------------------------
    async def handle_kv(self, request: Request) -> bytes:
        chunk = unpack(KVChunk, request.data)
        reservation = self.reservations.get(chunk.request_id)
        if reservation is None:
            raise ServiceError(404, "no reservation for this request (expired or cancelled)")
        text = self.worker.config.text
        layers = range(chunk.first_layer, chunk.last_layer)
        tokens = chunk.kv.shape[2] if len(chunk.kv.shape) == 5 else 0
        expected = [len(layers), 2, tokens, text.num_kv_heads, text.head_dim]
        if chunk.last_layer > text.num_layers or list(chunk.kv.shape) != expected or tokens < 1 \
                or chunk.first_token + tokens > reservation.seq.num_computed:
            raise ServiceError(400, f"KV chunk of shape {chunk.kv.shape} for layers {chunk.first_layer}.."
                                    f"{chunk.last_layer}, tokens from {chunk.first_token}, does not match this "
                                    f"model and reservation")
        try:
            kv = await self.plane.pull(chunk.kv, device=self.worker.engine.runner.device)
        except DataPlaneError as err:
            raise ServiceError(502, f"could not fetch the KV chunk: {err.message}") from None
        if self.reservations.get(chunk.request_id) is not reservation:
            raise ServiceError(404, "the reservation ended while the chunk was in flight")
        target = slice(chunk.first_layer, chunk.last_layer)
        await self.worker.loop.call(lambda engine: engine.write_kv(chunk.request_id, kv, target, chunk.first_token))
        self.reservations.land(reservation, layers, tokens, text.num_layers)
        return b""

    # -- 3. start ---------------------------------------------------------------------------------
    async def handle_start(self, request: Request) -> bytes:
        start = unpack(DecodeStart, request.data)
        rid = start.request_id
        reservation = self.reservations.get(rid)
        if reservation is None:
            raise ServiceError(404, "no reservation for this request (expired or cancelled)")
        if len(start.token_ids) != reservation.seq.num_computed + 1 or start.prompt_len > reservation.seq.num_computed \
                or any(not 0 <= t < self.worker.config.text.vocab_size for t in start.token_ids):
            raise ServiceError(400, "start does not match the reservation (token count or ids)")
        validate_sampling(start.sampling, self.worker.config)
        try:
            await asyncio.wait_for(reservation.complete.wait(), self.reservations.remaining(reservation))
        except asyncio.TimeoutError:
            raise ServiceError(504, "the KV transfer did not complete in time") from None
        if self.reservations.take(rid, reservation) is None:
            raise ServiceError(404, "the reservation ended while waiting for its KV")
        self.worker.track(rid, Tracked(start.stream, self.instance, choices=start.sampling.n))

        def begin(engine) -> bool:  # in the engine thread: the sequence is the engine's from here on
            seq = engine.reserved[rid]
            seq.token_ids, seq.prompt_len, seq.sampling = list(start.token_ids), start.prompt_len, start.sampling
            seq.rope_delta, seq.output_offset = start.rope_delta, start.output_offset
            return engine.activate(rid)

        if not await self.worker.loop.call(begin):  # choice 0 ended at its first token: it only seeded the others
            self.worker.finish_choice(rid, "finished")
        self.accepted += 1
        return pack(DecodeAccepted(decode_id=self.instance))

    def _expired(self, request_id: str, reservation: Reservation, reason: str) -> None:
        """A reservation whose transfer or start will not come (a prefill that died half-way). The stream
        hears of it once the blocks are free, so that whoever resumes the request finds the room."""
        freed = self.worker.loop.call(lambda engine: engine.abort(request_id))
        event = pack(error_event(request_id, 504, reason, self.instance))

        def tell(done) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.warning("decode.abort_failed", request_id=request_id, error=repr(done.exception()))
            self.worker.publisher.publish(reservation.stream, event)

        freed.add_done_callback(tell)
        log.warning("decode.reservation_expired", request_id=request_id, layers=len(reservation.landed), reason=reason)

    # -- lifecycle --------------------------------------------------------------------------------
    async def drain(self) -> None:
        await self.registration.drain()
        await self.reservations.none_held.wait()  # each ends by its start, a cancel, or its expiry timer
        await self.worker.drained()

    def stats(self) -> dict:
        return {"instance": self.instance, **self.worker.stats(), "accepted": self.accepted,
                "reservations": len(self.reservations), "reservations_expired": self.reservations.expired,
                "errors": sum(e.errors for e in self.registration.endpoints) if self.registration else 0}
