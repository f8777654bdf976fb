"""Same-GPU pulls through CUDA IPC: the holder hands out its GPU memory, the consumer copies from it.

Processes of one stack that share a GPU (colocated topologies, with or without MPS) otherwise move every
embedding and KV chunk through host memory: the holder copies to pinned memory, ZMQ carries the bytes,
the consumer copies them up again (41 ms for four 1080p images' embeddings, 527 ms for a 10k-token
prompt's KV on an H200; docs/benchmarks.md). Over IPC the consumer copies device to device.

The exchange (ZMQ transport, ``shared.dataplane.zmq_server``, ``zmq_staging``, ``zmq_client``):

1. ``publish`` of a GPU tensor records an event on the publishing thread's stream (``mark``): the point
   after which the tensor is complete, without whatever that stream queues later;
2. a consumer that pulls onto a GPU names that GPU (its UUID) in its ``PullRequest``;
3. a holder whose tensor lies on that same physical GPU answers with ``PullReply.ipc`` and no payload
   (``export``): torch's IPC description of the tensor's allocation block (memory handle, the tensor's
   offset in it, a reference counter in shared memory that keeps the block alive while a consumer maps
   it, an IPC event recorded on an idle stream once the publish event has passed);
4. the consumer maps the block, copies the tensor's bytes on a stream of its own after that event,
   waits for the copy, drops the mapping (which releases the holder's block) and acks; the holder then
   counts the pull as done, as after any pull.

A consumer that cannot map the block (another container without a shared IPC namespace, a driver that
refuses) releases its reference, pulls the bytes instead and stops asking that holder.

Mapping and unmapping cost more than the copy, and hold the GIL while they do: on an H200 a pull of one
258 × 8,192 bf16 embedding took ~0.9 ms to map and ~0.85 ms to unmap on an idle GPU, and while another
stream of the consumer ran 10 ms steps, ~10 ms to unmap (the unmap waits for the device's queued work),
with the consumer's other Python threads (its engine's) stalled up to 16 ms. So a holder serves same-GPU
pulls from an **export pool** (``ExportPool``) where it can: one buffer per GPU, allocated once and never
freed while the holder lives, which each consumer maps once and keeps mapped:

5. the holder stages the tensor into a free slot of its pool (a device copy after its publish event, on
   the idle stream, waited for off the event loop) and answers with the slot's offset, and with the
   pool's description only when the consumer's request does not name the pool as mapped already;
6. the consumer copies the slot's bytes from its mapping and acks naming the slot, which frees it.

Ten copies from a pool mapped once took 0.7 ms idle and 7 ms beside the busy stream (no Python thread
stalled over 1.6 ms), against 2.5 and 112 ms mapped one by one (an H200; the transport's
own figures: ``bench/dataplane.py --busy``, docs/benchmarks.md). A tensor that does not fit the pool's
free space (or a pool that could not be allocated) goes the per-tensor way above. The pool exposes what
was staged in it (earlier pulls' tensors too), not the holder's other memory.

Trust: a mapped handle reaches the holder's whole caching-allocator block, which may hold other tensors of
the holder, not only the one pulled. IPC therefore serves processes of one stack on one GPU, which share
the device (and under MPS its server) anyway; ``EPD_DATA_CUDA_IPC=false`` turns it off for a process, and
then every pull carries bytes. The tuple is torch's own (``torch.multiprocessing``'s CUDA reduction
uses the same storage calls), sent as MessagePack fields, never pickled.
"""

from __future__ import annotations

import functools
import secrets
import threading

import torch

from shared.dataplane.wire import CudaIpc


class Unavailable(Exception):
    """The holder's memory cannot be mapped here: pull the bytes instead."""


@functools.cache
def gpu_id(index: int) -> str:
    """The physical GPU behind this process's device ``index`` (stable across processes, MPS and
    ``CUDA_VISIBLE_DEVICES`` renumbering)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def mark(tensor: torch.Tensor) -> torch.cuda.Event:
    """An event after the work that produced ``tensor`` (recorded on the current stream now)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


_idle: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _stream(index: int) -> torch.cuda.Stream:
    """A stream of this module's own per device: it only ever waits on events, so an event recorded on it
    marks nothing but what it waited for."""
    with _lock:
        stream = _idle.get(index)
        if stream is None:
            stream = _idle[index] = torch.cuda.Stream(index)
        return stream


def export(tensor: torch.Tensor, ready: torch.cuda.Event | None) -> CudaIpc:
    """Describe ``tensor`` (contiguous, on a GPU) for one consumer to map. Torch records its IPC event on
    the current stream: here an idle stream made to wait on ``ready``, so the consumer's copy waits for
    the tensor alone. The description carries one reference; a consumer that maps it releases it when its
    mapping dies, one that does not must call ``release``."""
    index = tensor.device.index
    stream = _stream(index)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        storage = tensor.untyped_storage()
        (_, handle, block_bytes, block_offset, counter, counter_offset, event, event_sync) = storage._share_cuda_()
    return CudaIpc(handle=handle, block_bytes=block_bytes, block_offset=block_offset,
                   byte_offset=tensor.storage_offset() * tensor.element_size(), counter=counter,
                   counter_offset=counter_offset, event=event, event_sync=bool(event_sync))


def copy(ipc: CudaIpc, nbytes: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """The holder's ``nbytes`` bytes copied into ``out`` (flat uint8 on ``device``) or a new flat buffer,
    complete when this returns. Blocks (mapping and the copy's wait): run it off the event loop. Raises
    ``Unavailable`` when the block cannot be mapped (the reference is released then)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    stream = _stream(index)
    caller = torch.cuda.current_stream(device)  # where the engine will read what arrives
    with torch.cuda.device(index), torch.cuda.stream(stream):
        if out is not None:
            stream.wait_stream(caller)  # the caller's reused buffer may still be read by its queued kernels
        source = _map(ipc, device, nbytes)
        target = out if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
        target.copy_(source, non_blocking=True)  # after the holder's event: ``_new_shared_cuda`` queued the wait
        stream.synchronize()  # the mapping must outlive the copy; the caller's streams may read ``target`` now
        # unmapped and the holder's block released here: torch's deleter first synchronizes the current
        # stream, which must be this idle one, not the caller's (the engine's queued steps)
        del source
    if out is None:
        # a block of the copy stream's pool, read and freed on the caller's stream: not recycled before that
        # stream's work at its free has passed
        target.record_stream(caller)
    return target


def _map(ipc: CudaIpc, device: torch.device, nbytes: int) -> torch.Tensor:
    """The described bytes, mapped here: a flat uint8 tensor that holds the mapping while it lives (its
    deleter unmaps, after synchronizing the then-current stream). Raises ``Unavailable`` (the reference
    released) when the block cannot be mapped."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(device.index, ipc.handle, ipc.block_bytes, ipc.block_offset,
                                                        ipc.counter, ipc.counter_offset, ipc.event, ipc.event_sync)
    except (RuntimeError, TypeError, ValueError) as err:
        release(ipc)
        raise Unavailable(str(err)) from None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, ipc.byte_offset, (nbytes,))


def release(ipc: CudaIpc) -> None:
    """Give back a description's reference without mapping it (a pull abandoned or refused), so the
    holder's block is freed. Best effort: where the counter file cannot be opened either, the holder keeps
    the block until it exits."""
    try:
        torch.UntypedStorage._release_ipc_counter(ipc.counter, ipc.counter_offset)
    except (RuntimeError, TypeError, ValueError):
        pass


def collect() -> None:
    """Free blocks the holder has let go of and consumers have unmapped (torch keeps them until asked)."""
    torch.cuda.ipc_collect()


ALIGN = 512  # slot offsets and sizes (a copy's alignment; keeps every slot's start 16-byte aligned)


class Slots:
    """First-fit allocation of byte ranges of a pool: ``take`` → an offset or None, ``give`` it back.
    Free ranges are kept sorted by offset and merged with their neighbours."""

    def __init__(self, size: int):
        self.size = size
        self.free: list[list[int]] = [[0, size]] if size > 0 else []  # [offset, length], sorted
        self.used = 0

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)

    @classmethod
    def layout(cls, nbytes: list[int]) -> list[int]:
        """Where each tensor of a batch starts in its one slot (every start aligned), the slot's size last."""
        offsets = [0]
        for n in nbytes:
            offsets.append(offsets[-1] + cls.rounded(n))
        return offsets

    def take(self, nbytes: int) -> int | None:
        need = self.rounded(nbytes)
        for i, (offset, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = [offset + need, length - need]
                self.used += need
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        size = self.rounded(nbytes)
        i = 0
        while i < len(self.free) and self.free[i][0] < offset:
            i += 1
        before = self.free[i - 1] if i else None
        after = self.free[i] if i < len(self.free) else None
        if (before and before[0] + before[1] > offset) or (after and offset + size > after[0]) \
                or offset < 0 or offset + size > self.size:
            raise ValueError("a slot given back overlaps free space or lies outside the pool")
        self.used -= size
        if before and before[0] + before[1] == offset:
            before[1] += size
            if after and before[0] + before[1] == after[0]:
                before[1] += after[1]
                del self.free[i]
        elif after and offset + size == after[0]:
            after[0], after[1] = offset, after[1] + size
        else:
            self.free.insert(i, [offset, size])


class ExportPool:
    """A holder's staging buffer on one GPU, mapped once by each consumer on that GPU (steps 5–6 above).
    Slots are taken and given back on the holder's event loop only."""

    def __init__(self, index: int, nbytes: int):
        self.id = secrets.token_hex(4)  # a new pool (a restarted holder's) is never taken for a mapped one
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        self.slots = Slots(nbytes)

    def describe(self) -> CudaIpc:
        """The pool for one more consumer to map: its own reference, released when it unmaps."""
        return export(self.buffer, None)

    def stage(self, tensors: list[torch.Tensor], ready: list[torch.cuda.Event | None], offsets: list[int]) -> None:
        """Each tensor's bytes into the pool at its offset (after its publish event), complete when this
        returns: one wait for all. Blocks: run it off the event loop (concurrent stages share the idle
        stream: each waits for what was queued)."""
        index = self.buffer.device.index
        stream = _stream(index)
        with torch.cuda.device(index), torch.cuda.stream(stream):
            for tensor, event, offset in zip(tensors, ready, offsets):
                if event is not None:
                    stream.wait_event(event)
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                self.buffer[offset:offset + flat.numel()].copy_(flat, non_blocking=True)
            stream.synchronize()


class PoolMapping:
    """A consumer's mapping of one holder's export pool, kept while that holder serves it."""

    def __init__(self, pool: str, ipc: CudaIpc, nbytes: int, device: torch.device):
        self.pool = pool
        self.device = device
        with torch.cuda.device(device.index), torch.cuda.stream(_stream(device.index)):
            self.base = _map(ipc, device, nbytes)

    def copy(self, offset: int, nbytes: int, out: torch.Tensor | None) -> torch.Tensor:
        """The slot's bytes in ``out`` (flat uint8 on this mapping's device) or a new flat buffer, complete
        when this returns. Blocks: run it off the event loop. Raises ``Unavailable`` once unmapped (the
        holder is gone), ValueError for a slot outside the pool."""
        base = self.base  # the slice below keeps the mapping alive through the copy, even if closed meanwhile
        if base is None:
            raise Unavailable("the pool was unmapped: its holder is gone")
        if offset < 0 or offset + nbytes > base.numel():
            raise ValueError("a slot outside the mapped pool")
        index = self.device.index
        stream = _stream(index)
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.device(index), torch.cuda.stream(stream):
            if out is not None:
                stream.wait_stream(caller)
            target = out if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            target.copy_(base[offset:offset + nbytes], non_blocking=True)
            stream.synchronize()
        if out is None:
            target.record_stream(caller)
        return target

    def close(self) -> None:
        """Unmap (blocks, as unmapping does: call it off the event loop); torch's deleter synchronizes the
        current stream, the idle one here."""
        index = self.device.index
        with torch.cuda.device(index), torch.cuda.stream(_stream(index)):
            self.base = None
