"""One DEALER connection from a consumer to one holder (ZMQ transport), shared by every pull to it."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import torch
import zmq
import zmq.asyncio

from shared.dataplane import cuda_ipc, tensor_bytes, wire
from shared.dataplane.handle import TensorHandle
from shared.dataplane.store import DataPlaneError


class ZmqPeer:
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
        return tensor_bytes.tensor_from_buffer(payload.buffer, handle)

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
