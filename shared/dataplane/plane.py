"""The data plane of one process: publish a tensor → a handle; pull a handle → the tensor.

A process serves what it holds over its configured transport and can pull from holders of any
transport. ``inproc`` hands the tensor itself to a consumer in the same process (the aggregated
topology and tests): zero copies.
"""

from __future__ import annotations

import asyncio
import uuid

import torch
import zmq.asyncio

from shared.dataplane.handle import TensorHandle, dtype_name
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.dataplane.zmq_transport import ZmqClient, ZmqServer

_INPROC: dict[str, TensorStore] = {}  # address → store, for holders in this process


class DataPlane:
    def __init__(self, transport: str = "zmq", host: str = "127.0.0.1", advertise: str = "",
                 max_bytes: int = 8 << 30, lease_seconds: float = 60.0, pull_timeout: float = 60.0):
        if transport not in ("zmq", "inproc"):
            raise ValueError(f"data plane transport {transport!r} is not available (use zmq or inproc)")
        self.transport = transport
        self.store = TensorStore(max_bytes, lease_seconds)
        self.pull_timeout = pull_timeout
        self._context = zmq.asyncio.Context()
        self._server = ZmqServer(self.store, host, advertise, self._context) if transport == "zmq" else None
        self._zmq = ZmqClient(self._context)
        self._sweeper: asyncio.Task | None = None
        self.address = ""

    @classmethod
    def from_settings(cls, settings) -> "DataPlane":
        return cls(settings.transport, settings.data_host, settings.data_advertise,
                   settings.data_max_mb << 20, settings.lease_seconds)

    async def start(self) -> None:
        if self._server is not None:
            await self._server.start()
            self.address = self._server.address
        else:
            self.address = f"inproc://{uuid.uuid4().hex}"
            _INPROC[self.address] = self.store
        self._sweeper = asyncio.create_task(self._sweep(), name="dataplane-sweeper")

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            await self._server.stop()
        _INPROC.pop(self.address, None)
        await self._zmq.close()
        self._context.term()

    def publish(self, tensor: torch.Tensor, consumers: int | None = 1, lease: float | None = None) -> TensorHandle:
        key, token, expires_at = self.store.put(tensor, consumers, lease)
        return TensorHandle(transport=self.transport, address=self.address, key=key, token=token,
                            dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                            nbytes=tensor.numel() * tensor.element_size(), expires_at=expires_at)

    def release(self, handle: TensorHandle) -> None:
        if handle.address == self.address:
            self.store.release(handle.key)

    async def pull(self, handle: TensorHandle) -> torch.Tensor:
        if handle.transport == "inproc":
            store = _INPROC.get(handle.address)
            if store is None:
                raise DataPlaneError("not_found", "in-process holder is gone")
            tensor = store.get(handle.key, handle.token)
            store.done(handle.key)
            return tensor
        if handle.transport == "zmq":
            return await self._zmq.pull(handle, self.pull_timeout)
        raise DataPlaneError("bad_request", f"unknown transport {handle.transport!r}")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.store.sweep()
