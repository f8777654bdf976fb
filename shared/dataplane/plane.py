"""The data plane of one process: publish a tensor → a handle; pull a handle → the tensor.

A process serves what it holds over its configured transport (``ucx``, ``zmq`` or ``inproc``) and can
pull from holders of any transport; clients are made on first use, so a ZMQ deployment never loads
UCX. A handle this process holds is taken from its own store whatever its transport: no copy. Over ZMQ,
holder and consumer on one GPU exchange a CUDA IPC description instead of the bytes (``cuda_ipc``).

A process that only holds host arrays (the frontend's decoded pixels, published as numpy) never loads
torch: the ZMQ server sends their bytes as they are, and torch comes in with the first GPU tensor or pull.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
import zmq.asyncio

from shared.dataplane.handle import TRANSPORTS, TensorHandle, dtype_name
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.dataplane.transport import TransportClient, TransportServer
from shared.dataplane.zmq_server import ZmqServer
from shared.dataplane.zmq_staging import POOL_BYTES

if TYPE_CHECKING:
    import torch


class DataPlane:
    def __init__(self, transport: str = "zmq", host: str = "127.0.0.1", advertise: str = "",
                 max_bytes: int = 8 << 30, lease_seconds: float = 60.0, pull_timeout: float = 60.0,
                 cuda_ipc: bool = True, cuda_ipc_pool_mb: int = POOL_BYTES >> 20):
        if transport not in TRANSPORTS:
            raise ValueError(f"data plane transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.transport = transport
        self.host = host
        self.advertise = advertise
        self.store = TensorStore(max_bytes, lease_seconds)
        self.pull_timeout = pull_timeout
        self.cuda_ipc = cuda_ipc and transport != "inproc"  # inproc hands the tensor itself over
        self.cuda_ipc_pool_bytes = cuda_ipc_pool_mb << 20  # per GPU, allocated at the first same-GPU pull
        self._context: zmq.asyncio.Context | None = None
        self._server = self._make_server()
        self._clients: dict[str, TransportClient] = {}
        self._sweeper: asyncio.Task | None = None
        self._empty: asyncio.Event | None = None

    @classmethod
    def from_settings(cls, settings) -> "DataPlane":
        return cls(settings.transport, settings.data_host, settings.data_advertise, settings.data_max_mb << 20,
                   cuda_ipc=settings.data_cuda_ipc)

    @property
    def address(self) -> str:
        return self._server.address

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._empty = asyncio.Event()
        self.store.on_empty = lambda: loop.call_soon_threadsafe(self._empty.set)
        await self._server.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="dataplane-sweeper")

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._server.stop()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._context is not None:
            self._context.term()

    def publish(self, tensor: torch.Tensor | np.ndarray, consumers: int | None = 1, lease: float | None = None,
                complete: bool = False) -> TensorHandle:
        """Hold ``tensor`` for ``consumers`` pulls (None: until released or its lease ends). A consumer on
        the same GPU may map it (``cuda_ipc``) and copies once the work queued before this call on the
        current stream is done; ``complete``: its producer synchronized already, so nothing queued since
        (the next batch) delays that copy."""
        ready = None
        if self.cuda_ipc and getattr(tensor, "is_cuda", False) and not complete:
            from shared.dataplane import cuda_ipc

            ready = cuda_ipc.mark(tensor)
        key, token, expires_at = self.store.put(tensor, consumers, lease, ready)
        return TensorHandle(transport=self.transport, address=self.address, key=key, token=token,
                            dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), nbytes=tensor.nbytes,
                            expires_at=expires_at)

    def release(self, handle: TensorHandle) -> None:
        if handle.address == self.address:
            self.store.release(handle.key)

    async def discard(self, handles) -> None:
        """Handles nobody will pull after all (their request failed, or its images were encoded again): each
        holder is told at once, as a pull's ack would (a holder counts it only from whoever has the token), so
        it frees the tensor now and not at the end of its lease; a draining holder need not wait for it.
        Best effort: a holder gone or missing the word frees it at its lease, as does a UCX holder (a UCX
        client would load torch into the frontend, the one process that discards)."""
        for handle in handles:
            if handle.address == self.address:
                self.store.ack(handle.key, handle.token)
            elif handle.transport != "ucx":
                await self._client(handle.transport).discard(handle)

    async def pull(self, handle: TensorHandle, device: torch.device | str | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The handle's tensor, on ``device`` (None: as held for this process's own tensors, host memory
        for others'), or received into ``out``: a contiguous buffer of the handle's byte size that the
        caller reuses (no allocation; UCX writes straight into it), returned viewed as the handle's
        dtype and shape. Raises DataPlaneError: the holder's refusal, ``timeout`` or ``unreachable``."""
        import torch

        from shared.dataplane.inproc_transport import take

        target = torch.device(device) if device is not None else None
        if handle.address == self.address:
            return take(self.store, handle, target, out)
        try:
            return await self._client(handle.transport).pull(handle, self.pull_timeout, target, out)
        except TimeoutError:
            raise DataPlaneError("timeout", f"no answer from the holder within {self.pull_timeout:g}s") from None

    async def pull_many(self, handles: list[TensorHandle], device: torch.device | str | None = None) -> list[torch.Tensor]:
        """``pull`` of each handle, in order; those of one holder on this process's GPU come in one batch
        (ZMQ: staged together in the holder's export pool, one reply and one copy for all)."""
        import torch

        target = torch.device(device) if device is not None else None
        groups: dict[tuple[str, str], list[int]] = {}
        for i, handle in enumerate(handles):
            groups.setdefault((handle.transport, handle.address), []).append(i)
        pulled: list = [None] * len(handles)

        async def group(transport: str, address: str, indices: list[int]) -> None:
            mine = [handles[i] for i in indices]
            if transport == "zmq" and address != self.address and len(mine) > 1:  # its timeouts: DataPlaneError
                tensors = await self._client("zmq").pull_many(mine, self.pull_timeout, target)
            else:
                tensors = await asyncio.gather(*(self.pull(h, target) for h in mine))
            for i, tensor in zip(indices, tensors):
                pulled[i] = tensor

        await asyncio.gather(*(group(t, a, i) for (t, a), i in groups.items()))
        return pulled

    async def handed_out(self) -> None:
        """Until everything published here has been pulled, released or let lapse (a draining holder
        keeps serving what its consumers were promised)."""
        while len(self.store):
            self._empty.clear()
            if not len(self.store):
                return
            await self._empty.wait()

    def stats(self) -> dict:
        stats = self.store.stats()
        if isinstance(self._server, ZmqServer):
            stats |= self._server.stats()
        return stats

    def _make_server(self) -> TransportServer:
        if self.transport == "zmq":
            return ZmqServer(self.store, self.host, self.advertise, self._zmq_context(), self.cuda_ipc,
                             self.cuda_ipc_pool_bytes)
        if self.transport == "ucx":
            from shared.dataplane.ucx_transport import UcxServer

            return UcxServer(self.store, self.host, self.advertise)
        from shared.dataplane.inproc_transport import InprocServer

        return InprocServer(self.store)

    def _client(self, transport: str) -> TransportClient:
        client = self._clients.get(transport)
        if client is None:
            if transport == "zmq":
                from shared.dataplane.zmq_client import ZmqClient

                client = ZmqClient(self._zmq_context(), self.cuda_ipc)
            elif transport == "ucx":
                from shared.dataplane.ucx_transport import UcxClient

                client = UcxClient()
            else:
                from shared.dataplane.inproc_transport import InprocClient

                client = InprocClient()
            self._clients[transport] = client
        return client

    def _zmq_context(self) -> zmq.asyncio.Context:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        return self._context

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.store.sweep()
            if self.store.mapped:  # blocks consumers mapped and have let go of: torch frees them when asked
                from shared.dataplane import cuda_ipc

                cuda_ipc.collect()
