"""Prefill → decode: room reserved before any compute, KV streamed while computing, decode started
after the first token (the protocol is narrated in ``shared/messages/decode.py``; the steps are
numbered the same on both sides).

1. ``reserve``: a decode worker with room holds blocks for the prompt. The request goes to the decode
   worker with the most room this prefill worker knows of (its own ``Directory``), watched while it
   answers: one that is gone, has left or is full is skipped for the next at once. While every decode
   worker is full the request waits here, asking again with back-off, for up to ``DECODE_WAIT_S``:
   overload queues requests instead of failing them.
2. ``on_layer_done`` (engine thread, during a step with prompt chunks): after each group of
   ``KV_CHUNK_LAYERS`` layers, those layers' KV of the tokens this step computed (a ``KVSpan``; the
   first span of a prompt starts at 0 and carries its cached prefix) is copied out, published, and a
   ``KVChunk`` sent to the reserving worker — the transfer overlaps the remaining layers' and chunks'
   compute.
3. ``first_token``: the first token goes straight to the stream, naming the decode worker as
   responsible; once every chunk is delivered, ``DecodeStart`` sends the prompt, the token and the
   sampling. A request that ends here (its first token was its last, it failed, it was refused)
   releases its reservation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from services.language.worker import LanguageWorker, Tracked
from shared.aio import TaskSet
from shared.bus.calls import ServiceCallError, call
from shared.bus.directory import Directory
from shared.bus.watched import Target, WorkerGone, call_watched
from shared.dataplane.plane import DataPlane
from shared.engine.engine import KVSpan, StepOutput
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import pack, unpack
from shared.messages.control import Cancel
from shared.messages.decode import DecodeAccepted, DecodeStart, KVChunk, KVReservation, KVReserve
from shared.messages.prefill import PrefillJob

log = get_logger(__name__)

KV_CHUNK_LAYERS = 4  # layers per KV chunk streamed to decode during prefill
ANSWER_TIMEOUT = 30.0  # seconds a decode worker has to answer (reserve, take a KV chunk, start)
DECODE_WAIT_S = 20.0  # for KV room while every decode worker is full, then 503 (below the frontend's prefill timeout)
_FULL_RETRY_FIRST = 0.05  # seconds before asking full decode workers again; doubles up to the next
_FULL_RETRY_MAX = 0.5


@dataclass
class Handoff:
    """A request between admission and its decode start: where its KV goes, and the chunks in flight."""

    job: PrefillJob
    decode_id: str
    chunks: list[asyncio.Task] = field(default_factory=list)
    started: bool = False  # DecodeStart accepted: the decode worker owns the reservation now


class Handoffs:
    def __init__(self, worker: LanguageWorker, nc, subjects, plane: DataPlane, directory: Directory):
        self.worker = worker
        self.nc = nc
        self.directory = directory  # the decode workers, and whether the one asked is still there
        self.subjects = subjects
        self.plane = plane
        self.active: dict[str, Handoff] = {}
        self.tasks = TaskSet("handoff", expected=(ServiceCallError,))
        self.waited_for_decode = 0  # times a request was told "every decode worker is full" and waited
        self.chunks_sent = 0

    # -- 1. reserve -------------------------------------------------------------------------------
    async def reserve(self, job: PrefillJob) -> Tracked:
        """Room on a decode worker; the ``Tracked`` that hands the request over after its first token."""
        request = pack(KVReserve(request_id=job.request_id, num_tokens=len(job.token_ids),
                                 max_tokens=job.sampling.max_tokens, stream=job.stream, prefill_id=self.worker.instance))
        deadline = time.monotonic() + DECODE_WAIT_S
        pause, tried = _FULL_RETRY_FIRST, set()
        while True:
            target = self._decode_target(tried)
            try:
                reply = await call_watched(self.nc, self.directory, target, request, ANSWER_TIMEOUT,
                                           "decode worker")
                break
            except ServiceCallError as err:
                skip = isinstance(err, WorkerGone) or err.status == 503  # gone, left, or full
                if skip and target.instance:
                    tried.add(target.instance)
                    if self._decode_target(tried).instance:
                        continue  # another decode worker may have room: ask it now
                full = err.status == 503 and not err.no_responders
                if not full or time.monotonic() + pause > deadline or job.request_id in self.worker.cancelled:
                    raise ServiceError(err.status, err.message) from None
            self.waited_for_decode += 1
            await asyncio.sleep(pause)
            pause, tried = min(pause * 2, _FULL_RETRY_MAX), set()
        handoff = self.active[job.request_id] = Handoff(job, unpack(KVReservation, reply).decode_id)
        # the decode worker holding the reservation is responsible from here on: the frontend watches
        # it, and resumes the request elsewhere if it dies before or while decoding
        return Tracked(job.stream, handoff.decode_id, on_output=self.first_token,
                       on_end=lambda reason, rid=job.request_id: self._ended(rid, reason))

    def _decode_target(self, tried: set[str]) -> Target:
        """The listed decode worker with the most free KV blocks not yet tried; else the queue group."""
        decodes = [d for d in self.directory.of("decode") if d.instance not in tried]
        if not decodes:
            return Target(self.subjects.decode)
        best = max(decodes, key=lambda d: (int(d.data.get("kv_blocks_free", 0)), -int(d.data.get("reservations", 0)),
                                           d.instance))
        return Target(self.subjects.decode_reserve(best.instance), best.instance)

    def abandon(self, request_id: str) -> None:
        """A reservation made for a request that will not run here."""
        if self.active.pop(request_id, None) is not None:
            self.tasks.spawn(self._release(request_id))

    def _ended(self, request_id: str, reason: str) -> None:
        handoff = self.active.pop(request_id, None)
        if handoff is not None and not handoff.started and reason != "cancelled":  # a cancel reached decode too
            self.tasks.spawn(self._release(request_id))

    async def _release(self, request_id: str) -> None:
        await self.nc.publish(self.subjects.cancel, pack(Cancel(request_id=request_id, reason="prefill gave up")))

    # -- 2. KV streaming (engine thread → event loop) ---------------------------------------------
    def on_layer_done(self, layer: int, spans: list[KVSpan]) -> None:
        """Engine thread: at the end of each layer group, copy the group's KV of this step's tokens out."""
        group = KV_CHUNK_LAYERS
        layers = self.worker.config.text.num_layers
        if (layer + 1) % group and layer + 1 != layers:
            return
        first = layer // group * group
        for span in spans:
            kv = self.worker.engine.read_kv(span.seq, slice(first, layer + 1), span.start, span.end)
            self.worker.loop.loop.call_soon_threadsafe(self._send_chunk, span.seq.request_id, first, layer + 1,
                                                       span.start, kv)

    def _send_chunk(self, request_id: str, first: int, last: int, first_token: int, kv: torch.Tensor) -> None:
        handoff = self.active.get(request_id)
        if handoff is None:
            return  # cancelled meanwhile
        handle = self.plane.publish(kv, consumers=1)
        chunk = KVChunk(request_id=request_id, first_layer=first, last_layer=last, first_token=first_token, kv=handle)
        task = self.tasks.spawn(call(self.nc, self.subjects.decode_kv(handoff.decode_id), pack(chunk),
                                     ANSWER_TIMEOUT, "decode worker"))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.plane.release(handle))
        handoff.chunks.append(task)
        self.chunks_sent += 1

    # -- 3. first token, decode start -------------------------------------------------------------
    def first_token(self, out: StepOutput) -> None:
        rid = out.seq.request_id
        handoff = self.active.get(rid)
        tracked = self.worker.requests.get(rid)
        if handoff is None or tracked is None:
            return
        self.worker.publish_token(out, tracked)
        if out.finish_reason is not None and handoff.job.sampling.n == 1:
            self.worker.end(rid, "finished")  # nothing left to decode: the reservation is released
            return
        seq, job = out.seq, handoff.job
        start = DecodeStart(request_id=rid, token_ids=seq.token_ids[:seq.prompt_len + 1], prompt_len=seq.prompt_len,
                            rope_delta=seq.rope_delta, sampling=job.sampling, stream=job.stream,
                            output_offset=job.output_offset)
        self.tasks.spawn(self._start_decode(handoff, start))

    async def _start_decode(self, handoff: Handoff, start: DecodeStart) -> None:
        rid = start.request_id
        try:
            for chunk in handoff.chunks:
                await chunk
            reply = await call(self.nc, self.subjects.decode_start(handoff.decode_id), pack(start),
                               ANSWER_TIMEOUT, "decode worker")
            unpack(DecodeAccepted, reply)
            handoff.started = True
            self.worker.end(rid, "handed off")
        except ServiceCallError as err:
            self.worker.fail(rid, err.status, f"handing the request to decode failed: {err.message}")
        except Exception:
            log.exception("prefill.handoff_failed", request_id=rid)
            self.worker.fail(rid, 500, "handing the request to decode failed")

    def stats(self) -> dict:
        return {"handoffs": len(self.active), "kv_chunks_sent": self.chunks_sent,
                "decode_full_waits": self.waited_for_decode}
