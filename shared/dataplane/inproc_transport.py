"""In-process transport: the consumer gets the holder's tensor itself (zero copies).

For the aggregated topology and for tests: holder and consumer share a process, so a handle only has
to name the store. The token, lease and pull count rules are the same as over the network.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from shared.dataplane import tensor_bytes
from shared.dataplane.handle import TensorHandle
from shared.dataplane.store import DataPlaneError, TensorStore

_STORES: dict[str, TensorStore] = {}  # address → store of each in-process holder


class InprocServer:
    def __init__(self, store: TensorStore):
        self.store = store
        self.address = ""

    async def start(self) -> None:
        self.address = f"inproc://{uuid.uuid4().hex}"
        _STORES[self.address] = self.store

    async def stop(self) -> None:
        _STORES.pop(self.address, None)


class InprocClient:
    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        store = _STORES.get(handle.address)
        if store is None:
            raise DataPlaneError("unreachable", "no in-process holder at this address (stopped, or another process)")
        return take(store, handle, device, out)

    async def discard(self, handle: TensorHandle) -> None:
        store = _STORES.get(handle.address)
        if store is not None:
            store.ack(handle.key, handle.token)

    async def close(self) -> None:
        pass


def take(store: TensorStore, handle: TensorHandle, device: torch.device | None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """One pull straight from a store in this process: the tensor itself, copied or moved only if asked (a
    host array held: as a tensor over its memory)."""
    tensor = store.get(handle.key, handle.token)
    store.done(handle.key)
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(tensor)
    if out is None:
        return tensor if device is None else tensor.to(device)
    return tensor_bytes.deliver(tensor_bytes.flat_bytes(tensor), handle, None, out)
