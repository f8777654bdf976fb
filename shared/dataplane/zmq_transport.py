"""ZMQ transport: a ROUTER socket serves pulls from the store; one DEALER per holder pulls, reused.

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
import itertools
import os
import time
import uuid
from dataclasses import dataclass

import msgspec
import torch
import zmq
import zmq.asyncio

from shared.dataplane import cuda_ipc, wire
from shared.dataplane.handle import TensorHandle
from shared.dataplane.net import resolve_advertise, url_host
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.logging import get_logger

log = get_logger(__name__)


@dataclass
class _Slot:
    """A slot of an export pool staged for one pull, until its consumer acks (or the lease passes)."""
    pool: cuda_ipc.ExportPool
    token: str
    nbytes: int
    expires: float


class ZmqServer:
    def __init__(self, store: TensorStore, host: str, advertise: str, context: zmq.asyncio.Context,
                 mappable: bool = False, pool_bytes: int = 0):
        self.store = store
        self.mappable = mappable  # GPU tensors may be answered with a CUDA IPC description
        self.pool_bytes = pool_bytes  # per GPU; 0: every same-GPU pull maps the tensor's own block
        self._pools: dict[int, cuda_ipc.ExportPool | None] = {}  # device index → pool (None: not allocatable)
        self._slots: dict[tuple[str, int], _Slot] = {}  # (key, offset) → the slot staged for a pull of key
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
        self._pools.clear()  # consumers' mappings keep the memory until they unmap
        self._slots.clear()
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
                self._free_slot(message.key, message.token, message.slot)
            return self.store.ack(message.key, message.token) if message.done else None
        if isinstance(message, wire.PullBatch):
            return await self._answer_batch(sock, identity, request_id, message)
        if len(body) > wire.CONTROL_BYTES:
            return await self._refuse(sock, identity, request_id, "bad_request", "pull request too long")
        reply, tensor = wire.lookup(self.store, message)
        if tensor is None:
            return await self._refuse(sock, identity, request_id, reply.code, reply.message)
        if tensor.device.type == "cpu":
            return await self._send(sock, identity, request_id, wire.host_bytes(tensor))
        if self.mappable and message.gpu and message.nbytes and message.gpu == cuda_ipc.gpu_id(tensor.device.index):
            staged = self._take_slot(tensor.device.index, message.nbytes, message.key, message.token)
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
        return {"pool_bytes_used": sum(pool.slots.used for pool in self._pools.values() if pool is not None),
                "pull_serve_seconds_total": round(self.pool_serve_seconds, 6), "pull_serve_count": self.pool_serves}

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)

    def _pool(self, index: int) -> cuda_ipc.ExportPool | None:
        if index not in self._pools:
            try:
                self._pools[index] = cuda_ipc.ExportPool(index, self.pool_bytes) if self.pool_bytes else None
            except (RuntimeError, torch.OutOfMemoryError) as err:
                log.warning("dataplane.export_pool_unavailable", device=index, mb=self.pool_bytes >> 20,
                            error=str(err)[:200])
                self._pools[index] = None
        return self._pools[index]

    def _take_slot(self, index: int, nbytes: int, key: str, token: str) -> tuple[cuda_ipc.ExportPool, int] | None:
        """A slot of the GPU's export pool for a pull of ``key`` (a batch: its first key), freed by an ack
        with its token (None: no pool, or no room even after dropping the slots whose consumers never acked
        within the lease)."""
        pool = self._pool(index)
        if pool is None:
            return None
        offset = pool.slots.take(nbytes)
        if offset is None:
            now = time.monotonic()
            for stale, at in [k for k, slot in self._slots.items() if slot.expires < now]:
                slot = self._slots.pop((stale, at))
                slot.pool.slots.give(at, slot.nbytes)
            offset = pool.slots.take(nbytes)
            if offset is None:
                return None
        self._slots[(key, offset)] = _Slot(pool, token, nbytes, time.monotonic() + self.store.lease_seconds)
        return pool, offset

    def _batchable(self, message: wire.PullBatch) -> list[torch.Tensor] | None:
        """The batch's tensors, if one slot can serve them all: this holder maps, each is held for this
        token with the size named, on the GPU named, none empty (else the consumer pulls one by one)."""
        n = len(message.keys)
        if not (self.mappable and 0 < n <= wire.MAX_BATCH and len(message.tokens) == len(message.nbytes) == n):
            return None
        tensors = []
        for key, token, nbytes in zip(message.keys, message.tokens, message.nbytes):
            try:
                tensor = self.store.get(key, token, count=False)
            except DataPlaneError:
                return None
            device = tensors[0].device if tensors else tensor.device
            if (not tensor.is_cuda or nbytes <= 0 or tensor.numel() * tensor.element_size() != nbytes
                    or tensor.device != device or cuda_ipc.gpu_id(device.index) != message.gpu):
                return None
            tensors.append(tensor)
        return tensors

    async def _answer_batch(self, sock, identity: bytes, request_id: bytes, message: wire.PullBatch) -> None:
        tensors = self._batchable(message)
        offsets = cuda_ipc.Slots.layout(message.nbytes)
        staged = tensors and self._take_slot(tensors[0].device.index, offsets[-1], message.keys[0], message.tokens[0])
        if not staged:
            return await self._refuse(sock, identity, request_id, "unbatched", "pull these one by one")
        self.store.served += len(tensors)
        self._spawn(self._stage_and_reply(sock, identity, request_id, message.pool, message.keys, tensors,
                                          offsets[:-1], *staged))

    def _free_slot(self, key: str, token: str, offset: int) -> None:
        slot = self._slots.get((key, offset))
        if slot is not None and slot.token == token:
            del self._slots[(key, offset)]
            slot.pool.slots.give(offset, slot.nbytes)

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
            entry = self._slots.pop((keys[0], slot), None)
            if entry is not None:
                pool.slots.give(slot, entry.nbytes)
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


class _Peer:
    """One DEALER connection to one holder, shared by all pulls to it; replies matched by request id.

    ZMQ hides a vanished peer (it reconnects forever, and a pull would wait out its timeout): a socket
    monitor reports the holder closing the connection or refusing it, and every pull waiting on it
    fails at once as ``unreachable`` (holders never come back at the same address).
    """

    def __init__(self, context: zmq.asyncio.Context, address: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_STOP, zmq.RECONNECT_STOP_CONN_REFUSED)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED |
                                                      zmq.EVENT_CLOSED)
        self.socket.connect(address)
        self.dead = False
        self.closed = False
        self.mappable = True  # until mapping this holder's GPU memory fails once
        self.pools: dict[str, asyncio.Future] = {}  # the holder's export pools mapped here: id → PoolMapping
        self.pool_ids: dict[str, str] = {}  # GPU → the id of the pool mapped for pulls onto it
        self.gone = asyncio.Event()
        # request id → (waiter, handle); an entry outlives a caller that gave up, so its late reply is
        # still acknowledged (the holder frees the tensor then, not at lease expiry).
        self.pending: dict[bytes, tuple[asyncio.Future, TensorHandle]] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read(), name=f"zmq-peer-{address}")
        self.watcher = asyncio.create_task(self._watch(), name=f"zmq-peer-monitor-{address}")

    async def pull(self, handle: TensorHandle, timeout: float,
                   gpu: str = "") -> torch.Tensor | cuda_ipc.CudaIpc | wire.PullReply:
        """The tensor's bytes, or (``gpu`` named and the holder's tensor on it) a reply naming the slot of
        the holder's export pool it was staged in, or its CUDA IPC description; the caller copies from
        either and then ``ack``s."""
        request = wire.PullRequest(handle.key, handle.token, handle.nbytes, gpu=gpu,
                                   pool=self.pool_ids.get(gpu, "") if gpu else "")
        return await self._request(request, handle, timeout)

    async def pull_batch(self, handles: list[TensorHandle], timeout: float, gpu: str) -> wire.PullReply:
        """Several tensors staged in one slot of the holder's export pool (``wire.PullBatch``): the reply
        naming it, which the caller copies from and then acks for each handle. Raises DataPlaneError
        (``unbatched``: pull them one by one)."""
        request = wire.PullBatch([h.key for h in handles], [h.token for h in handles], [h.nbytes for h in handles],
                                 gpu, self.pool_ids.get(gpu, ""))
        return await self._request(request, handles, timeout)

    async def _request(self, request: wire.PullRequest | wire.PullBatch, handle: TensorHandle | list[TensorHandle],
                       timeout: float):
        if self.dead or self.closed:
            raise DataPlaneError("unreachable", "the holder is gone")
        self._forget_expired()
        request_id = next(self.ids).to_bytes(8, "little")
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = (future, handle)
        request = [request_id, wire.encode(request)]
        try:
            await self._send(request, timeout)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DataPlaneError("timeout", f"no answer from the holder within {timeout:g}s") from None
        finally:
            if not future.done():
                self.pending.pop(request_id, None)
            elif not future.cancelled():
                future.exception()  # seen: a pull that failed on its send raised its own error already

    async def _send(self, frames: list[bytes], timeout: float) -> None:
        """A DEALER whose only peer is gone blocks on send for ever: give up when the holder is gone."""
        send = asyncio.ensure_future(self.socket.send_multipart(frames))
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({send, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not send.done():
                send.cancel()
        if not send.done() or send.cancelled():
            raise DataPlaneError("unreachable", "the holder is gone") if self.dead else TimeoutError()
        try:
            send.result()
        except zmq.ZMQError:  # the socket was closed under this send: its holder was found gone
            raise DataPlaneError("unreachable", "the holder is gone") from None

    async def _read(self) -> None:
        while True:
            request_id, header, payload = await self._next_reply()
            waiter = self.pending.pop(request_id.bytes, None)
            if waiter is None:
                continue  # a reply to a request forgotten after its lease ran out
            future, handle = waiter
            try:
                result = self._result(header.bytes, payload, handle)
            except DataPlaneError as err:
                result = err
            else:
                if isinstance(result, wire.PullReply):  # a slot of the export pool
                    if future.done():  # nobody will copy it: the holder may reuse the slot
                        if result.ipc is not None:
                            cuda_ipc.release(result.ipc)
                        self.ack_slot(handle, result.slot)
                elif not isinstance(result, cuda_ipc.CudaIpc):
                    self.ack(handle)
                elif future.done():  # a mapping nobody will make: the holder may free its block
                    cuda_ipc.release(result)
                    self.ack(handle)
            if future.done():
                continue  # the puller gave up (timeout or cancel)
            if isinstance(result, DataPlaneError):
                future.set_exception(result)
            else:
                future.set_result(result)

    def ack_slot(self, handle: TensorHandle | list[TensorHandle], slot: int, done: bool = True) -> None:
        """Give back a slot (registered under a batch's first handle) and, if ``done``, count every pull."""
        handles = handle if isinstance(handle, list) else [handle]
        self.ack(handles[0], slot, done)
        for other in handles[1:] if done else ():
            self.ack(other)

    def ack(self, handle: TensorHandle, slot: int = -1, done: bool = True) -> None:
        """Best effort, never blocking: a holder that misses it frees the tensor (and the slot) at its lease.
        ``done``: the pull counts (else only the slot is given back)."""
        if self.closed:
            return
        sent = self.socket.send_multipart([b"ack", wire.encode(wire.PullAck(handle.key, handle.token, slot, done))],
                                          flags=zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # zmq.Again: not sent, and that is fine

    async def mapping(self, reply: wire.PullReply, gpu: str, device: torch.device) -> cuda_ipc.PoolMapping:
        """The holder's export pool named in ``reply``, mapped here once (concurrent first pulls share the
        one mapping; a description that came with a later reply is released). Raises ``Unavailable``."""
        pending = self.pools.get(reply.pool)
        if pending is None:
            if reply.ipc is None:
                raise cuda_ipc.Unavailable("the holder's pool is not mapped here")
            pending = self.pools[reply.pool] = asyncio.ensure_future(asyncio.to_thread(
                cuda_ipc.PoolMapping, reply.pool, reply.ipc, reply.ipc.block_bytes, device))
        elif reply.ipc is not None:
            cuda_ipc.release(reply.ipc)
        try:
            mapping = await asyncio.shield(pending)
        except cuda_ipc.Unavailable:
            self.pools.pop(reply.pool, None)
            raise
        if mapping.device != device:
            raise cuda_ipc.Unavailable("the holder's pool is mapped onto another device here")
        self.pool_ids[gpu] = reply.pool
        return mapping

    async def _unmap(self) -> None:
        """Drop every mapping of the holder's pools (the holder is gone, or this connection closes)."""
        pools, self.pools, self.pool_ids = list(self.pools.values()), {}, {}
        for pending in pools:
            try:
                mapping = await pending
            except Exception:  # never mapped
                continue
            await asyncio.to_thread(mapping.close)

    async def _watch(self) -> None:
        await self.monitor.recv_multipart()  # the first event: disconnected, or connection refused
        self.dead = True
        self.gone.set()
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(DataPlaneError("unreachable", "the holder closed the connection or is gone"))
        await self._unmap()  # now, not when this peer is next used: a holder that is gone never is

    async def _next_reply(self):
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            if len(frames) == 3:
                return frames

    @staticmethod
    def _result(header: bytes, payload, handle: TensorHandle | list[TensorHandle]):
        try:
            reply = wire.reply_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise DataPlaneError("bad_request", "malformed reply from holder") from None
        if not reply.ok:
            raise DataPlaneError(reply.code, reply.message)
        if reply.slot >= 0:
            return reply
        if isinstance(handle, list):
            raise DataPlaneError("bad_request", "a batch's reply without its slot")
        if reply.ipc is not None:
            return reply.ipc
        if len(payload) != handle.nbytes:
            raise DataPlaneError("bad_request", "payload size does not match the handle")
        return wire.tensor_from_buffer(payload.buffer, handle)

    def _forget_expired(self) -> None:
        stale = [rid for rid, (future, handle) in self.pending.items()
                 if future.done() and (handle[0] if isinstance(handle, list) else handle).expired]
        for rid in stale:
            del self.pending[rid]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in (self.reader, self.watcher):
            task.cancel()
        await asyncio.gather(self.reader, self.watcher, return_exceptions=True)
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(DataPlaneError("unreachable", "data plane closed"))
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        await self._unmap()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class ZmqClient:
    def __init__(self, context: zmq.asyncio.Context, mapping: bool = False):
        self.context = context
        self.mapping = mapping  # pulls onto a GPU ask holders on it for CUDA IPC
        self._peers: dict[str, _Peer] = {}

    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        if not handle.address.startswith(("tcp://", "ipc://")):
            raise DataPlaneError("bad_request", "zmq handle with a non-zmq address")
        if out is not None:
            wire.check_out(out, handle)
        peer = await self._peer(handle.address)
        target = out.device if out is not None else device
        if self.mapping and peer.mappable and target is not None and target.type == "cuda":
            gpu = cuda_ipc.gpu_id(_index(target))
            got = await peer.pull(handle, timeout, gpu)
            if not isinstance(got, (wire.PullReply, cuda_ipc.CudaIpc)):  # another GPU, or a holder that does not map
                return wire.deliver(wire.flat_bytes(got), handle, device, out)
            try:
                if isinstance(got, wire.PullReply):
                    return await self._copy_slot(peer, got, gpu, handle, target, out)
                return await self._copy(peer, got, handle, target, out)
            except cuda_ipc.Unavailable as err:
                peer.mappable = False
                log.warning("dataplane.cuda_ipc_unavailable", holder=handle.address, error=str(err)[:200])
        tensor = await peer.pull(handle, timeout)  # lands in ZMQ's own buffer: one copy into ``out``
        return wire.deliver(wire.flat_bytes(tensor), handle, device, out)

    @staticmethod
    async def _copy(peer: _Peer, ipc: cuda_ipc.CudaIpc, handle: TensorHandle, target: torch.device,
                    out: torch.Tensor | None) -> torch.Tensor:
        """Device to device from the holder's mapped memory, then the ack (also when the caller gives up:
        the copy's thread still unmaps, and the holder need not wait for the lease)."""
        flat_out = wire.check_out(out, handle) if out is not None else None
        try:
            flat = await asyncio.to_thread(cuda_ipc.copy, ipc, handle.nbytes, target, flat_out)
        except cuda_ipc.Unavailable:
            raise  # no ack: the bytes are pulled next, and that pull acks
        except BaseException:  # cancelled or failed: the holder need not keep the tensor for us
            peer.ack(handle)
            raise
        peer.ack(handle)
        return wire.deliver(flat, handle, None, out)

    async def pull_many(self, handles: list[TensorHandle], timeout: float,
                        device: torch.device | None) -> list[torch.Tensor]:
        """Tensors of one holder onto ``device``: where it is a GPU that the holder's tensors are on, staged
        together in one slot of its export pool (``wire.PullBatch``, up to MAX_BATCH a request), else one
        by one."""
        address = handles[0].address if handles else ""
        if not (self.mapping and device is not None and device.type == "cuda" and len(handles) > 1 and address.startswith(("tcp://", "ipc://"))
                and all(h.address == address and h.nbytes for h in handles)):
            return list(await asyncio.gather(*(self.pull(h, timeout, device, None) for h in handles)))
        if len(handles) > wire.MAX_BATCH:
            parts = [handles[i:i + wire.MAX_BATCH] for i in range(0, len(handles), wire.MAX_BATCH)]
            return [t for part in await asyncio.gather(*(self.pull_many(p, timeout, device) for p in parts))
                    for t in part]
        peer = await self._peer(address)
        if peer.mappable:
            gpu = cuda_ipc.gpu_id(_index(device))
            try:
                reply = await peer.pull_batch(handles, timeout, gpu)
            except DataPlaneError as err:
                if err.code in ("unreachable", "timeout"):
                    raise
            else:
                try:
                    return await self._copy_batch(peer, reply, gpu, handles, device)
                except cuda_ipc.Unavailable as err:
                    peer.mappable = False
                    log.warning("dataplane.cuda_ipc_unavailable", holder=address, error=str(err)[:200])
        return list(await asyncio.gather(*(self.pull(h, timeout, device, None) for h in handles)))

    async def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and peer.dead:
            del self._peers[address]  # before awaiting: a pull racing this one must not reuse it
            await peer.close()
            peer = self._peers.get(address)  # another pull may have made the new one meanwhile
        if peer is None:
            peer = self._peers[address] = _Peer(self.context, address)
        return peer

    @staticmethod
    async def _copy_batch(peer: _Peer, reply: wire.PullReply, gpu: str, handles: list[TensorHandle],
                          target: torch.device) -> list[torch.Tensor]:
        """One copy of the batch's slot, split into its tensors (views of one buffer), then the acks."""
        offsets = cuda_ipc.Slots.layout([h.nbytes for h in handles])
        device = torch.device("cuda", _index(target))
        try:
            mapping = await peer.mapping(reply, gpu, device)
        except BaseException:
            peer.ack_slot(handles, reply.slot, done=False)  # they are pulled one by one next
            raise
        try:
            flat = await asyncio.to_thread(mapping.copy, reply.slot, offsets[-1], None)
        except ValueError:
            raise DataPlaneError("bad_request", "the holder's slot lies outside its pool") from None
        finally:
            peer.ack_slot(handles, reply.slot)
        return [wire.as_tensor(flat[o:o + h.nbytes], h) for o, h in zip(offsets, handles)]

    @staticmethod
    async def _copy_slot(peer: _Peer, reply: wire.PullReply, gpu: str, handle: TensorHandle, target: torch.device,
                         out: torch.Tensor | None) -> torch.Tensor:
        """Device to device from the slot of the holder's mapped export pool, then the ack that frees the
        slot (also when the caller gives up or the pool cannot be mapped: the bytes are pulled next)."""
        flat_out = wire.check_out(out, handle) if out is not None else None
        device = torch.device("cuda", _index(target))
        try:
            mapping = await peer.mapping(reply, gpu, device)
        except BaseException:
            peer.ack_slot(handle, reply.slot, done=False)  # the slot only: the bytes are pulled next, and that pull counts
            raise
        try:
            flat = await asyncio.to_thread(mapping.copy, reply.slot, handle.nbytes, flat_out)
        except ValueError:
            raise DataPlaneError("bad_request", "the holder's slot lies outside its pool") from None
        finally:
            peer.ack_slot(handle, reply.slot)
        return wire.deliver(flat, handle, None, out)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
