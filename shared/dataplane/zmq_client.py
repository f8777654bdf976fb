"""ZMQ transport, the consumer's side: pulls over one ``ZmqPeer`` per holder; onto a GPU the holder's
tensor is on, a device-to-device copy from its CUDA IPC mapping instead of the bytes (``zmq_server``'s
docstring has the exchange)."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

from shared.dataplane import cuda_ipc, tensor_bytes, wire
from shared.dataplane.handle import TensorHandle
from shared.dataplane.store import DataPlaneError
from shared.dataplane.zmq_peer import ZmqPeer
from shared.logging import get_logger

log = get_logger(__name__)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class ZmqClient:
    def __init__(self, context: zmq.asyncio.Context, mapping: bool = False):
        self.context = context
        self.mapping = mapping  # pulls onto a GPU ask holders on it for CUDA IPC
        self._peers: dict[str, ZmqPeer] = {}

    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        if not handle.address.startswith(("tcp://", "ipc://")):
            raise DataPlaneError("bad_request", "zmq handle with a non-zmq address")
        if out is not None:
            tensor_bytes.check_out(out, handle)
        peer = await self._peer(handle.address)
        target = out.device if out is not None else device
        if self.mapping and peer.mappable and target is not None and target.type == "cuda":
            gpu = cuda_ipc.gpu_id(_index(target))
            got = await peer.pull(handle, timeout, gpu)
            if not isinstance(got, (wire.PullReply, cuda_ipc.CudaIpc)):  # another GPU, or a holder that does not map
                return tensor_bytes.deliver(tensor_bytes.flat_bytes(got), handle, device, out)
            try:
                if isinstance(got, wire.PullReply):
                    return await self._copy_slot(peer, got, gpu, handle, target, out)
                return await self._copy(peer, got, handle, target, out)
            except cuda_ipc.Unavailable as err:
                peer.mappable = False
                log.warning("dataplane.cuda_ipc_unavailable", holder=handle.address, error=str(err)[:200])
        tensor = await peer.pull(handle, timeout)  # lands in ZMQ's own buffer: one copy into ``out``
        return tensor_bytes.deliver(tensor_bytes.flat_bytes(tensor), handle, device, out)

    @staticmethod
    async def _copy(peer: ZmqPeer, ipc: cuda_ipc.CudaIpc, handle: TensorHandle, target: torch.device,
                    out: torch.Tensor | None) -> torch.Tensor:
        """Device to device from the holder's mapped memory, then the ack (also when the caller gives up:
        the copy's thread still unmaps, and the holder need not wait for the lease)."""
        flat_out = tensor_bytes.check_out(out, handle) if out is not None else None
        try:
            flat = await asyncio.to_thread(cuda_ipc.copy, ipc, handle.nbytes, target, flat_out)
        except cuda_ipc.Unavailable:
            raise  # no ack: the bytes are pulled next, and that pull acks
        except BaseException:  # cancelled or failed: the holder need not keep the tensor for us
            peer.ack(handle)
            raise
        peer.ack(handle)
        return tensor_bytes.deliver(flat, handle, None, out)

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

    async def discard(self, handle: TensorHandle) -> None:
        """No pull of ``handle`` will come: its ack without the pull (best effort, never waits)."""
        if handle.address.startswith(("tcp://", "ipc://")):
            (await self._peer(handle.address)).ack(handle)

    async def _peer(self, address: str) -> ZmqPeer:
        peer = self._peers.get(address)
        if peer is not None and peer.dead:
            del self._peers[address]  # before awaiting: a pull racing this one must not reuse it
            await peer.close()
            peer = self._peers.get(address)  # another pull may have made the new one meanwhile
        if peer is None:
            peer = self._peers[address] = ZmqPeer(self.context, address)
        return peer

    @staticmethod
    async def _copy_batch(peer: ZmqPeer, reply: wire.PullReply, gpu: str, handles: list[TensorHandle],
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
        return [tensor_bytes.as_tensor(flat[o:o + h.nbytes], h) for o, h in zip(offsets, handles)]

    @staticmethod
    async def _copy_slot(peer: ZmqPeer, reply: wire.PullReply, gpu: str, handle: TensorHandle, target: torch.device,
                         out: torch.Tensor | None) -> torch.Tensor:
        """Device to device from the slot of the holder's mapped export pool, then the ack that frees the
        slot (also when the caller gives up or the pool cannot be mapped: the bytes are pulled next)."""
        flat_out = tensor_bytes.check_out(out, handle) if out is not None else None
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
        return tensor_bytes.deliver(flat, handle, None, out)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
