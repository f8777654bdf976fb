"""A holder's CUDA IPC staging for the ZMQ transport: the export pools a same-GPU pull is staged in.

One pool per GPU (``cuda_ipc.ExportPool``, allocated at the first same-GPU pull, ``POOL_BYTES``): a
pulled tensor is copied into a slot of it and the consumer copies it out of its mapping of the pool (mapped
once per consumer), then acks with the slot, which frees it. A consumer that never acks leaves its slot
to the lease. A batch of one holder's tensors (``wire.PullBatch``) shares one slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.dataplane import wire
from shared.dataplane.store import DataPlaneError, TensorStore
from shared.logging import get_logger

if TYPE_CHECKING:
    import torch

    from shared.dataplane import cuda_ipc

log = get_logger(__name__)

POOL_BYTES = 256 << 20  # per GPU: tensors that do not fit the free space map their own block instead


@dataclass
class _Slot:
    """A slot of an export pool staged for one pull, until its consumer acks (or the lease passes)."""
    pool: cuda_ipc.ExportPool
    token: str
    nbytes: int
    expires: float


class ExportSlots:
    """The export pools of this holder's GPUs and the slots staged in them for pulls not yet acked."""

    def __init__(self, store: TensorStore, pool_bytes: int = POOL_BYTES):
        self.store = store
        self.pool_bytes = pool_bytes  # per GPU; 0: every same-GPU pull maps the tensor's own block
        self._pools: dict[int, cuda_ipc.ExportPool | None] = {}  # device index → pool (None: not allocatable)
        self._slots: dict[tuple[str, int], _Slot] = {}  # (key, offset) → the slot staged for a pull of key

    @property
    def used_bytes(self) -> int:
        return sum(pool.slots.used for pool in self._pools.values() if pool is not None)

    def clear(self) -> None:
        self._pools.clear()  # consumers' mappings keep the memory until they unmap
        self._slots.clear()

    def _pool(self, index: int) -> cuda_ipc.ExportPool | None:
        if index not in self._pools:
            import torch  # a pull between processes on one GPU: torch is loaded

            from shared.dataplane import cuda_ipc

            try:
                self._pools[index] = cuda_ipc.ExportPool(index, self.pool_bytes) if self.pool_bytes else None
            except (RuntimeError, torch.OutOfMemoryError) as err:
                log.warning("dataplane.export_pool_unavailable", device=index, mb=self.pool_bytes >> 20,
                            error=str(err)[:200])
                self._pools[index] = None
        return self._pools[index]

    def take(self, index: int, nbytes: int, key: str, token: str) -> tuple[cuda_ipc.ExportPool, int] | None:
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

    def give_back(self, key: str, offset: int) -> None:
        """A slot whose staging failed: free again, whoever asks for it."""
        slot = self._slots.pop((key, offset), None)
        if slot is not None:
            slot.pool.slots.give(offset, slot.nbytes)

    def free(self, key: str, token: str, offset: int) -> None:
        """A consumer's ack naming the slot, with the pull's token."""
        slot = self._slots.get((key, offset))
        if slot is not None and slot.token == token:
            del self._slots[(key, offset)]
            slot.pool.slots.give(offset, slot.nbytes)

    def batchable(self, message: wire.PullBatch) -> list[torch.Tensor] | None:
        """The batch's tensors, if one slot can serve them all: each is held for this token with the size
        named, on the GPU named, none empty (else the consumer pulls one by one)."""
        n = len(message.keys)
        if not (0 < n <= wire.MAX_BATCH and len(message.tokens) == len(message.nbytes) == n):
            return None
        tensors = []
        for key, token, nbytes in zip(message.keys, message.tokens, message.nbytes):
            try:
                tensor = self.store.get(key, token, count=False)
            except DataPlaneError:
                return None
            if not getattr(tensor, "is_cuda", False):  # a host array: no torch, nothing to map
                return None
            from shared.dataplane.cuda_ipc import gpu_id  # a GPU tensor: torch is loaded

            device = tensors[0].device if tensors else tensor.device
            if (nbytes <= 0 or tensor.numel() * tensor.element_size() != nbytes
                    or tensor.device != device or gpu_id(device.index) != message.gpu):
                return None
            tensors.append(tensor)
        return tensors
