"""ZMQ transport: a ROUTER socket serves pulls from the store; one DEALER per holder pulls, reused.

Wire: the consumer sends ``[request_id, PullRequest]``; the holder answers ``[request_id, PullReply,
payload]`` with the tensor's raw bytes sent without a copy; the consumer then sends ``[request_id,
PullAck]``. Many pulls share one connection, matched by request id. Requests are size-capped and
schema-checked; nothing is unpickled. TCP across hosts; ``ipc://DIR`` as the data host for a Unix socket
between processes of one host. A consumer that receives on a GPU names it in its request; a holder of the
tensor on that same GPU replies with a CUDA IPC description and an empty payload, and the consumer acks
once its device-to-device copy is done (``cuda_ipc``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid

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


class ZmqServer:
    def __init__(self, store: TensorStore, host: str, advertise: str, context: zmq.asyncio.Context,
                 mappable: bool = False):
        self.store = store
        self.mappable = mappable  # GPU tensors may be answered with a CUDA IPC description
        self.host = host
        self.advertise = "" if host.startswith("ipc://") else resolve_advertise(advertise, host)
        self.context = context
        self.address = ""
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._staging: set[asyncio.Task] = set()  # device-to-host copies of GPU tensors being served

    async def start(self) -> None:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.CONTROL_BYTES)
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
            return self.store.ack(message.key, message.token)
        reply, tensor = wire.lookup(self.store, message)
        if tensor is None:
            return await self._refuse(sock, identity, request_id, reply.code, reply.message)
        if tensor.device.type == "cpu":
            return await self._send(sock, identity, request_id, wire.host_bytes(tensor))
        if self.mappable and message.gpu and message.nbytes and message.gpu == cuda_ipc.gpu_id(tensor.device.index):
            try:
                ipc = cuda_ipc.export(tensor, self.store.ready(message.key))
            except (RuntimeError, TypeError, ValueError):  # an allocation torch cannot share: the bytes go
                log.warning("dataplane.cuda_ipc_export_failed", exc_info=True)
            else:
                self.store.mapped += 1
                return await self._send(sock, identity, request_id, b"", wire.PullReply(True, ipc=ipc))
        task = asyncio.create_task(self._stage_and_send(sock, identity, request_id, tensor))
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)

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
        self.gone = asyncio.Event()
        # request id → (waiter, handle); an entry outlives a caller that gave up, so its late reply is
        # still acknowledged (the holder frees the tensor then, not at lease expiry).
        self.pending: dict[bytes, tuple[asyncio.Future, TensorHandle]] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read(), name=f"zmq-peer-{address}")
        self.watcher = asyncio.create_task(self._watch(), name=f"zmq-peer-monitor-{address}")

    async def pull(self, handle: TensorHandle, timeout: float, gpu: str = "") -> torch.Tensor | cuda_ipc.CudaIpc:
        """The tensor's bytes, or (``gpu`` named and the holder's tensor on it) its CUDA IPC description,
        which the caller copies from and then ``ack``s."""
        if self.dead or self.closed:
            raise DataPlaneError("unreachable", "the holder is gone")
        self._forget_expired()
        request_id = next(self.ids).to_bytes(8, "little")
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = (future, handle)
        request = [request_id, wire.encode(wire.PullRequest(handle.key, handle.token, handle.nbytes, gpu=gpu))]
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
                if not isinstance(result, cuda_ipc.CudaIpc):
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

    def ack(self, handle: TensorHandle) -> None:
        """Best effort, never blocking: a holder that misses it frees the tensor at its lease."""
        if self.closed:
            return
        sent = self.socket.send_multipart([b"ack", wire.encode(wire.PullAck(handle.key, handle.token))],
                                          flags=zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # zmq.Again: not sent, and that is fine

    async def _watch(self) -> None:
        await self.monitor.recv_multipart()  # the first event: disconnected, or connection refused
        self.dead = True
        self.gone.set()
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(DataPlaneError("unreachable", "the holder closed the connection or is gone"))

    async def _next_reply(self):
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            if len(frames) == 3:
                return frames

    @staticmethod
    def _result(header: bytes, payload, handle: TensorHandle) -> torch.Tensor | cuda_ipc.CudaIpc:
        try:
            reply = wire.reply_decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise DataPlaneError("bad_request", "malformed reply from holder") from None
        if not reply.ok:
            raise DataPlaneError(reply.code, reply.message)
        if reply.ipc is not None:
            return reply.ipc
        if len(payload) != handle.nbytes:
            raise DataPlaneError("bad_request", "payload size does not match the handle")
        return wire.tensor_from_buffer(payload.buffer, handle)

    def _forget_expired(self) -> None:
        stale = [rid for rid, (future, handle) in self.pending.items() if future.done() and handle.expired]
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
        peer = self._peers.get(handle.address)
        if peer is not None and peer.dead:
            del self._peers[handle.address]  # before awaiting: a pull racing this one must not reuse it
            await peer.close()
            peer = self._peers.get(handle.address)  # another pull may have made the new one meanwhile
        if peer is None:
            peer = self._peers[handle.address] = _Peer(self.context, handle.address)
        target = out.device if out is not None else device
        if self.mapping and peer.mappable and target is not None and target.type == "cuda":
            got = await peer.pull(handle, timeout, cuda_ipc.gpu_id(_index(target)))
            if isinstance(got, cuda_ipc.CudaIpc):
                try:
                    return await self._copy(peer, got, handle, target, out)
                except cuda_ipc.Unavailable as err:
                    peer.mappable = False
                    log.warning("dataplane.cuda_ipc_unavailable", holder=handle.address, error=str(err)[:200])
            else:  # another GPU, or a holder that does not map: the bytes came
                return wire.deliver(wire.flat_bytes(got), handle, device, out)
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

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
