"""ZMQ transport: a ROUTER socket serves pulls from the store; DEALER sockets pull, one per peer, reused.

Wire: the consumer sends ``[request_id, PullRequest]``; the holder answers ``[request_id, PullReply,
payload]`` where the payload is the tensor's raw bytes, sent without a copy. Requests are size-capped
and schema-checked; nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings

import msgspec
import torch
import zmq
import zmq.asyncio

from shared.dataplane.handle import DTYPES, TensorHandle
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.logging import get_logger

log = get_logger(__name__)

MAX_REQUEST_BYTES = 4096


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str
    token: str


class PullReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    code: str = ""
    message: str = ""


_request_decoder = msgspec.msgpack.Decoder(PullRequest)
_reply_decoder = msgspec.msgpack.Decoder(PullReply)
_encoder = msgspec.msgpack.Encoder()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_from_bytes(buffer, handle: TensorHandle) -> torch.Tensor:
    if handle.nbytes == 0:
        return torch.empty(handle.shape, dtype=DTYPES[handle.dtype])
    with warnings.catch_warnings():  # the receive buffer is read-only; consumers copy on use
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(DTYPES[handle.dtype]).view(handle.shape)


def resolve_advertise(advertise: str, host: str) -> str:
    """The address peers dial. ``auto``: this host's outward interface (containers, one IP per replica).
    A wildcard bind without an advertised address would hand peers 0.0.0.0: refuse that."""
    if advertise == "auto":
        import socket

        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the default route's interface
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
        finally:
            probe.close()
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", "*"):
        raise ValueError("the data plane listens on all interfaces: set --data-advertise (an address peers "
                         "can reach, or 'auto')")
    return host


class ZmqServer:
    def __init__(self, store: TensorStore, host: str, advertise: str, context: zmq.asyncio.Context):
        self.store = store
        self.host = host
        self.advertise = resolve_advertise(advertise, host)
        self.context = context
        self.address = ""
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._socket = sock
        self.address = f"tcp://{self.advertise}:{port}"
        self._task = asyncio.create_task(self._serve(), name="zmq-dataplane-server")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket:
            self._socket.close(0)

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
            request = _request_decoder.decode(body)
            tensor = self.store.get(request.key, request.token)
        except (msgspec.DecodeError, msgspec.ValidationError):
            await sock.send_multipart([identity, request_id, _encoder.encode(PullReply(False, "bad_request", "malformed pull request")), b""])
            return
        except DataPlaneError as err:
            await sock.send_multipart([identity, request_id, _encoder.encode(PullReply(False, err.code, err.message)), b""])
            return
        payload = tensor_bytes(tensor) if tensor.device.type == "cpu" else await asyncio.to_thread(tensor_bytes, tensor)
        await sock.send_multipart([identity, request_id, _encoder.encode(PullReply(True)), payload], copy=False)
        self.store.done(request.key)


class _Peer:
    """One DEALER connection to one holder, shared by all pulls to it; replies matched by request id."""

    def __init__(self, context: zmq.asyncio.Context, address: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.pending: dict[bytes, tuple[asyncio.Future, TensorHandle]] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read(), name=f"zmq-peer-{address}")

    async def pull(self, handle: TensorHandle, timeout: float) -> torch.Tensor:
        request_id = next(self.ids).to_bytes(8, "little")
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = (future, handle)
        try:
            await self.socket.send_multipart([request_id, _encoder.encode(PullRequest(handle.key, handle.token))])
            return await asyncio.wait_for(future, timeout)
        finally:
            self.pending.pop(request_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            if len(frames) != 3:
                continue
            request_id, header, payload = frames
            waiter = self.pending.get(request_id.bytes)
            if waiter is None or waiter[0].done():
                continue  # the puller gave up (timeout or cancel)
            future, handle = waiter
            try:
                reply = _reply_decoder.decode(header.bytes)
                if not reply.ok:
                    future.set_exception(DataPlaneError(reply.code, reply.message))
                elif len(payload) != handle.nbytes:
                    future.set_exception(DataPlaneError("bad_request", "payload size does not match the handle"))
                else:
                    future.set_result(tensor_from_bytes(payload.buffer, handle))
            except (msgspec.DecodeError, msgspec.ValidationError):
                future.set_exception(DataPlaneError("bad_request", "malformed reply from holder"))

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        for future, _ in self.pending.values():
            if not future.done():
                future.set_exception(DataPlaneError("not_found", "data plane closed"))
        self.socket.close(0)


class ZmqClient:
    def __init__(self, context: zmq.asyncio.Context):
        self.context = context
        self._peers: dict[str, _Peer] = {}

    async def pull(self, handle: TensorHandle, timeout: float) -> torch.Tensor:
        if not handle.address.startswith("tcp://") and not handle.address.startswith("ipc://"):
            raise DataPlaneError("bad_request", "zmq handle with a non-zmq address")
        peer = self._peers.get(handle.address)
        if peer is None:
            peer = self._peers[handle.address] = _Peer(self.context, handle.address)
        return await peer.pull(handle, timeout)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
