"""ZMQ transport, the holder's side: a ROUTER socket serves pulls from the store (the consumer's side:
``zmq_client``, one DEALER per holder, ``zmq_peer``).

Wire: the consumer sends ``[request_id, PullRequest]``; the holder answers ``[request_id, PullReply,
payload]`` with the tensor's raw bytes sent without a copy; the consumer then sends ``[request_id,
PullAck]``. Many pulls share one connection, matched by request id. Requests are size-capped and
schema-checked; nothing is unpickled. TCP across hosts; ``ipc://DIR`` as the data host for a Unix socket
between processes of one host. A consumer that receives on a GPU names it in its request; a holder of the
tensor on that same GPU stages it in a slot of its export pool and replies with the slot (and the pool's
CUDA IPC description, the first time), or else with the tensor's own description, and an empty payload;
the consumer acks once its device-to-device copy is done, naming the slot (``cuda_ipc``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from shared.dataplane import wire
from shared.dataplane.net import resolve_advertise, url_host
from shared.dataplane.store import TensorStore
from shared.dataplane.zmq_staging import POOL_BYTES, ExportSlots
from shared.logging import get_logger

if TYPE_CHECKING:
    import torch

    from shared.dataplane import cuda_ipc

log = get_logger(__name__)


class ZmqServer:
    def __init__(self, store: TensorStore, host: str, advertise: str, context: zmq.asyncio.Context,
                 mappable: bool = False, pool_bytes: int = POOL_BYTES):
        self.store = store
        self.mappable = mappable  # GPU tensors may be answered with a CUDA IPC description
        self.exports = ExportSlots(store, pool_bytes)
        self.host = host
        self.advertise = "" if host.startswith("ipc://") else resolve_advertise(advertise, host)
        self.context = context
        self.address = ""
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._staging: set[asyncio.Task] = set()  # device-to-host copies of GPU tensors being served
        self.pool_serve_seconds = 0.0  # pulls answered from the export pool: staging them until the reply
        self.pool_serves = 0

    async def start(self) -> None:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.BATCH_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        if self.host.startswith("ipc://"):
            path = os.path.join(self.host[len("ipc://"):], f"epd-{uuid.uuid4().hex[:12]}.sock")
            self.address = f"ipc://{path}"
            sock.bind(self.address)
        else:
            port = sock.bind_to_random_port(f"tcp://{url_host(self.host)}")
            self.address = f"tcp://{url_host(self.advertise)}:{port}"
        self._socket = sock
        self._task = asyncio.create_task(self._serve(), name="zmq-dataplane-server")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._staging) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._socket:
            self._socket.close(0)
        self.exports.clear()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except OSError:
                pass

    async def _serve(self) -> None:
        sock = self._socket
        while True:
            frames = await sock.recv_multipart(copy=True)
            try:
                await self._answer(sock, frames)
            except Exception:  # one bad peer must not stop the server
                log.exception("dataplane.serve_failed")

    async def _answer(self, sock, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("dataplane.malformed_request", frames=len(frames))
            return  # not our protocol: no reply, no state
        identity, request_id, body = frames
        try:
            message = wire.consumer_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return await self._refuse(sock, identity, request_id, "bad_request", "malformed pull request")
        if isinstance(message, wire.PullAck):
            if message.slot >= 0:
                self.exports.free(message.key, message.token, message.slot)
            return self.store.ack(message.key, message.token) if message.done else None
        if isinstance(message, wire.PullBatch):
            return await self._answer_batch(sock, identity, request_id, message)
        if len(body) > wire.CONTROL_BYTES:
            return await self._refuse(sock, identity, request_id, "bad_request", "pull request too long")
        reply, tensor = wire.lookup(self.store, message)
        if tensor is None:
            return await self._refuse(sock, identity, request_id, reply.code, reply.message)
        if not getattr(tensor, "is_cuda", False):  # a CPU tensor, or a host array (a process without torch)
            return await self._send(sock, identity, request_id, wire.host_bytes(tensor))
        from shared.dataplane import cuda_ipc  # a GPU tensor: torch is loaded

        if self.mappable and message.gpu and message.nbytes and message.gpu == cuda_ipc.gpu_id(tensor.device.index):
            staged = self.exports.take(tensor.device.index, message.nbytes, message.key, message.token)
            if staged is not None:
                return self._spawn(self._stage_and_reply(sock, identity, request_id, message.pool, [message.key],
                                                         [tensor], [0], *staged))
            try:
                ipc = cuda_ipc.export(tensor, self.store.ready(message.key))
            except (RuntimeError, TypeError, ValueError):  # an allocation torch cannot share: the bytes go
                log.warning("dataplane.cuda_ipc_export_failed", exc_info=True)
            else:
                self.store.mapped += 1
                return await self._send(sock, identity, request_id, b"", wire.PullReply(True, ipc=ipc))
        self._spawn(self._stage_and_send(sock, identity, request_id, tensor))

    def stats(self) -> dict:
        """The export pools' bytes in slots (staged for pulls not yet acked), and the time pulls served from
        them took here (a batch counts once: the stage after its publish events, the reply sent)."""
        return {"pool_bytes_used": self.exports.used_bytes,
                "pull_serve_seconds_total": round(self.pool_serve_seconds, 6), "pull_serve_count": self.pool_serves}

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)

    async def _answer_batch(self, sock, identity: bytes, request_id: bytes, message: wire.PullBatch) -> None:
        tensors = self.exports.batchable(message) if self.mappable else None
        staged = None
        if tensors:  # GPU tensors: torch is loaded
            from shared.dataplane import cuda_ipc

            offsets = cuda_ipc.Slots.layout(message.nbytes)
            staged = self.exports.take(tensors[0].device.index, offsets[-1], message.keys[0], message.tokens[0])
        if not staged:
            return await self._refuse(sock, identity, request_id, "unbatched", "pull these one by one")
        self.store.served += len(tensors)
        self._spawn(self._stage_and_reply(sock, identity, request_id, message.pool, message.keys, tensors,
                                          offsets[:-1], *staged))

    async def _stage_and_reply(self, sock, identity: bytes, request_id: bytes, mapped: str, keys: list[str],
                               tensors: list[torch.Tensor], offsets: list[int], pool: cuda_ipc.ExportPool,
                               slot: int) -> None:
        """Stage the tensors at their offsets in the slot, then reply with it (and the pool's description
        unless the consumer has ``mapped`` it). A failed stage frees the slot; a single pull then sends
        the bytes, a batch answers ``unbatched``."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(pool.stage, tensors, [self.store.ready(k) for k in keys],
                                    [slot + o for o in offsets])
            ipc = None if mapped == pool.id else pool.describe()
        except Exception:
            self.exports.give_back(keys[0], slot)
            log.exception("dataplane.export_pool_stage_failed")
            if len(tensors) > 1:
                return await self._refuse(sock, identity, request_id, "unbatched", "pull these one by one")
            return await self._stage_and_send(sock, identity, request_id, tensors[0])
        self.store.mapped += len(tensors)
        self.store.pooled += len(tensors)
        await self._send(sock, identity, request_id, b"", wire.PullReply(True, ipc=ipc, slot=slot, pool=pool.id))
        self.pool_serve_seconds += time.monotonic() - started
        self.pool_serves += 1

    async def _stage_and_send(self, sock, identity: bytes, request_id: bytes, tensor: torch.Tensor) -> None:
        try:
            payload = await asyncio.to_thread(wire.host_bytes, tensor)
            await self._send(sock, identity, request_id, payload)
        except Exception:
            log.exception("dataplane.stage_failed")

    async def _send(self, sock, identity: bytes, request_id: bytes, payload,
                    reply: wire.PullReply = wire.PullReply(True)) -> None:
        await sock.send_multipart([identity, request_id, wire.encode(reply), payload], copy=False)

    async def _refuse(self, sock, identity: bytes, request_id: bytes, code: str, message: str) -> None:
        await sock.send_multipart([identity, request_id, wire.encode(wire.refusal(code, message)), b""])
