"""UCX transport (ucxx): RDMA, NVLink or CUDA IPC where the hardware has them, TCP otherwise.

One ucxx listener serves the store; consumers keep one endpoint per holder and run many pulls on it at
once. A pull: the consumer posts its two receives and sends a fixed-size ``PullRequest`` frame (tag
``CONTROL``); the holder answers on tags derived from the request id: a ``PullReply`` frame, then the
tensor's bytes straight from its memory. The consumer receives them into a buffer it allocated or was
given (on the GPU when asked and UCX has CUDA support: no host copy on either side), then sends a
``PullAck`` frame, on which the holder counts the pull.

ucxx's listener binds every interface (it takes no address); ``--data-host`` only picks what is
advertised. The per-handle token is what guards the tensors.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import numpy as np
import torch

from shared.dataplane import tensor_bytes, ucx_runtime, wire
from shared.dataplane.handle import TensorHandle
from shared.dataplane.net import resolve_advertise, split_address, url_host
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.logging import get_logger

log = get_logger(__name__)

CONTROL = 1  # tag of consumer → holder frames; replies use reply_tag / payload_tag of the request id
ABORT_NS = 100_000_000  # how long closing a broken endpoint may wait for UCX (blocks the loop)
REFUSED_PAYLOAD = bytearray(1)


def reply_tag(request_id: int) -> int:
    return 2 + 2 * request_id


def payload_tag(request_id: int) -> int:
    return 3 + 2 * request_id


class UcxServer:
    def __init__(self, store: TensorStore, host: str, advertise: str):
        ucx_runtime.module()  # fail at configuration, not at the first pull, where ucxx is missing
        self.store = store
        self.advertise = resolve_advertise(advertise, host)
        self.address = ""
        self._listener = None
        self._connections: set[_Connection] = set()

    async def start(self) -> None:
        ucxx = ucx_runtime.acquire()
        self._listener = ucxx.create_listener(self._accept, port=0)
        self.address = f"ucx://{url_host(self.advertise)}:{self._listener.port}"

    async def stop(self) -> None:
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        await asyncio.gather(*(c.close() for c in list(self._connections)), return_exceptions=True)
        for _ in range(100):  # the aborted endpoints' receives fail soon after; let their handlers end
            if not self._connections and not listener.active_clients:
                break
            await asyncio.sleep(0.01)
        listener.close()
        ucx_runtime.release()

    async def _accept(self, endpoint) -> None:
        connection = _Connection(endpoint, self.store)
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)


class _Connection:
    """One consumer's endpoint, holder side: reads its frames, answers each pull as its own task."""

    def __init__(self, endpoint, store: TensorStore):
        self.endpoint = endpoint
        self.store = store
        self.answers: set[asyncio.Task] = set()

    async def serve(self) -> None:
        ucxx = ucx_runtime.module()
        while True:
            frame = bytearray(wire.CONTROL_BYTES)
            try:
                await self.endpoint.recv(frame, tag=CONTROL)
            except ucxx.exceptions.UCXError:
                return  # the consumer went away; what it did not ack stays until its lease
            try:
                message = wire.from_frame(frame, wire.consumer_decoder)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("dataplane.malformed_frame")
                return  # not our protocol: drop the connection, not the server
            if isinstance(message, wire.PullAck):
                self.store.ack(message.key, message.token)
                continue
            task = asyncio.create_task(self.answer(message))
            self.answers.add(task)
            task.add_done_callback(self.answers.discard)

    async def answer(self, request: wire.PullRequest) -> None:
        """The reply frame and, when the consumer expects bytes, the payload: the tensor, or one filler
        byte after a refusal, so the receive the consumer posted up front always completes."""
        ucxx = ucx_runtime.module()
        reply, tensor = wire.lookup(self.store, request)
        sends = [self.endpoint.send(wire.to_frame(reply), tag=reply_tag(request.id))]
        if request.nbytes:
            payload = await _payload(tensor, request.to_device) if tensor is not None else REFUSED_PAYLOAD
            sends.append(self.endpoint.send(payload, tag=payload_tag(request.id)))
        try:
            await _all(sends)
        except ucxx.exceptions.UCXError as err:
            log.info("dataplane.send_failed", error=str(err))  # consumer gone: the lease frees the tensor

    async def close(self) -> None:
        for task in self.answers:
            task.cancel()
        await asyncio.gather(*self.answers, return_exceptions=True)
        self.endpoint.abort(period=ABORT_NS)


async def _all(operations: list) -> None:
    """Await UCX operations posted together; raise the first failure once every one has ended (an
    operation left running would fail unobserved when its endpoint is aborted)."""
    for outcome in await asyncio.gather(*operations, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def _payload(tensor, to_device: bool):
    """What UCX sends: host memory as is (a host array too); device memory as is to a consumer that receives
    into GPU memory (cuda_ipc, GPUDirect RDMA), else a pinned host copy made off the loop: UCX's own path
    from device memory into a remote host buffer measured 0.15 GB/s on an H200, 5x slower than staging."""
    if isinstance(tensor, np.ndarray):
        return tensor.reshape(-1).view(np.uint8)
    flat = tensor_bytes.flat_bytes(tensor)
    if flat.device.type == "cpu":
        return flat.numpy()
    if to_device and ucx_runtime.cuda_support():
        # UCX reads device memory outside torch's streams: the producer's kernels must have finished.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
        await asyncio.to_thread(event.synchronize)
        return flat
    return (await asyncio.to_thread(tensor_bytes.host_bytes, flat)).obj


class _Peer:
    """One endpoint to one holder, consumer side, shared by every pull to it."""

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self.ids = itertools.count()
        self.broken = False  # a failed transfer: the next pull to this holder connects afresh
        self.aborted = False
        self.transfers: set[asyncio.Task] = set()

    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        # A caller that gives up (cancel) must not leave a receive posted into a buffer nobody awaits:
        # the transfer runs to its end (or its timeout) as a task of its own, and is acknowledged.
        task = asyncio.create_task(self._bounded(handle, timeout, device, out))
        self.transfers.add(task)
        task.add_done_callback(self._settled)
        return await asyncio.shield(task)

    def _settled(self, task: asyncio.Task) -> None:
        self.transfers.discard(task)
        if not task.cancelled():
            task.exception()  # seen here when the caller had gone; raised to it otherwise

    async def _bounded(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                       out: torch.Tensor | None) -> torch.Tensor:
        try:
            async with asyncio.timeout(timeout):
                flat = await self._transfer(handle, _landing(handle, device, out))
        except TimeoutError:
            self.abort()  # the only way to withdraw receives UCX has already posted
            raise DataPlaneError("timeout", f"no answer from the holder within {timeout:g}s") from None
        return tensor_bytes.deliver(flat, handle, device, out)

    async def _transfer(self, handle: TensorHandle, landing: torch.Tensor) -> torch.Tensor:
        """The handle's bytes, received into ``landing`` (flat uint8, host or, with CUDA support, GPU).
        The request goes out with both receives already posted: one round trip, no waits in between."""
        ucxx = ucx_runtime.module()
        request_id = next(self.ids)
        header = bytearray(wire.CONTROL_BYTES)
        request = wire.PullRequest(handle.key, handle.token, handle.nbytes, request_id, to_device=landing.is_cuda)
        steps = [self.endpoint.send(wire.to_frame(request), tag=CONTROL),
                 self.endpoint.recv(header, tag=reply_tag(request_id))]
        if handle.nbytes:
            steps.append(self.endpoint.recv(landing if landing.is_cuda else landing.numpy(), tag=payload_tag(request_id)))
        try:
            await _all(steps)
            reply = wire.from_frame(header, wire.reply_decoder)
        except ucxx.exceptions.UCXError as err:
            self.abort()  # withdraws the receives still posted
            raise DataPlaneError("unreachable", f"UCX transfer failed: {err}") from None
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.abort()
            raise DataPlaneError("bad_request", "malformed reply from holder") from None
        if not reply.ok:
            raise DataPlaneError(reply.code, reply.message)
        self._acknowledge(handle)
        return landing

    def _acknowledge(self, handle: TensorHandle) -> None:
        """Tell the holder it may free the tensor; off the puller's path (the bytes are already here)."""
        task = asyncio.create_task(self._send_ack(handle))
        self.transfers.add(task)
        task.add_done_callback(self._settled)

    async def _send_ack(self, handle: TensorHandle) -> None:
        try:
            await self.endpoint.send(wire.to_frame(wire.PullAck(handle.key, handle.token)), tag=CONTROL)
        except ucx_runtime.module().exceptions.UCXError as err:
            log.info("dataplane.ack_failed", error=str(err))  # holder gone; its lease covers the rest

    def abort(self) -> None:
        self.broken = True
        if not self.aborted:
            self.aborted = True
            self.endpoint.abort(period=ABORT_NS)

    async def close(self) -> None:
        for task in self.transfers:
            task.cancel()
        await asyncio.gather(*self.transfers, return_exceptions=True)
        self.abort()


def _landing(handle: TensorHandle, device: torch.device | None, out: torch.Tensor | None) -> torch.Tensor:
    """Where UCX writes the bytes: the caller's ``out`` or a new buffer on ``device`` when UCX can write
    that memory, else a new host buffer (moved or copied by ``tensor_bytes.deliver`` afterwards)."""
    target = out.device if out is not None else device
    direct = target is None or target.type == "cpu" or ucx_runtime.cuda_support()
    if out is not None:
        flat = tensor_bytes.check_out(out, handle)
        if direct:
            return flat
    return tensor_bytes.empty_like_handle(handle, target if direct and target is not None else "cpu")


class UcxClient:
    def __init__(self, connect_timeout: float = 5.0):
        self.connect_timeout = connect_timeout
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._ucxx = None

    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        peer = await self._peer(handle.address)
        return await peer.pull(handle, timeout, device, out)

    async def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and not peer.broken:
            return peer
        task = self._connecting.get(address)
        if task is None:  # one connect per holder, however many pulls wait for it
            task = self._connecting[address] = asyncio.create_task(self._connect(address))
            task.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str) -> _Peer:
        try:
            host, port = split_address(address, "ucx")
        except ValueError as err:
            raise DataPlaneError("bad_request", f"ucx handle with a bad address: {err}") from None
        if self._ucxx is None:
            self._ucxx = ucx_runtime.acquire()
        try:
            endpoint = await self._ucxx.create_endpoint(host, port, connect_timeout=self.connect_timeout)
        except (self._ucxx.exceptions.UCXError, TimeoutError, OSError) as err:
            raise DataPlaneError("unreachable", f"cannot reach the holder: {err!r}") from None
        old = self._peers.get(address)
        if old is not None:
            old.abort()
        peer = self._peers[address] = _Peer(endpoint)
        return peer

    async def close(self) -> None:
        for task in self._connecting.values():
            task.cancel()
        await asyncio.gather(*(p.close() for p in self._peers.values()), return_exceptions=True)
        self._peers.clear()
        if self._ucxx is not None:
            self._ucxx = None
            ucx_runtime.release()
