"""Same-GPU pulls through CUDA IPC: the holder hands out its GPU memory, the consumer copies from it.

Processes of one stack that share a GPU (colocated topologies, with or without MPS) otherwise move every
embedding and KV chunk through host memory: the holder copies to pinned memory, ZMQ carries the bytes,
the consumer copies them up again (41 ms for four 1080p images' embeddings, 527 ms for a 10k-token
prompt's KV on an H200; docs/benchmarks.md). Over IPC the consumer copies device to device.

The exchange (ZMQ transport, ``shared.dataplane.zmq_transport``):

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

Trust: a mapped handle reaches the holder's whole caching-allocator block, which may hold other tensors of
the holder, not only the one pulled. IPC therefore serves processes of one stack on one GPU, which share
the device (and under MPS its server) anyway; ``EPD_DATA_CUDA_IPC=false`` turns it off for a process, and
then every pull carries bytes. The tuple is torch's own (``torch.multiprocessing``'s CUDA reduction
uses the same storage calls), sent as MessagePack fields, never pickled.
"""

from __future__ import annotations

import functools
import threading

import msgspec
import torch


class CudaIpc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a consumer needs to map a holder's GPU tensor (torch's ``_share_cuda_`` fields)."""
    handle: bytes  # the allocation block's IPC memory handle
    block_bytes: int  # size of the storage the tensor lives in
    block_offset: int  # the storage's offset in the block
    byte_offset: int  # the tensor's offset in its storage
    counter: bytes  # name of the shared-memory file of reference counters
    counter_offset: int
    event: bytes  # IPC event handle: the copy waits for it
    event_sync: bool


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
        try:
            storage = torch.UntypedStorage._new_shared_cuda(index, ipc.handle, ipc.block_bytes, ipc.block_offset,
                                                            ipc.counter, ipc.counter_offset, ipc.event,
                                                            ipc.event_sync)
        except (RuntimeError, TypeError, ValueError) as err:
            release(ipc)
            raise Unavailable(str(err)) from None
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, ipc.byte_offset, (nbytes,))
        target = out if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
        target.copy_(source, non_blocking=True)  # after the holder's event: ``_new_shared_cuda`` queued the wait
        stream.synchronize()  # the mapping must outlive the copy; the caller's streams may read ``target`` now
        # unmapped and the holder's block released here: torch's deleter first synchronizes the current
        # stream, which must be this idle one, not the caller's (the engine's queued steps)
        del source, storage
    if out is None:
        # a block of the copy stream's pool, read and freed on the caller's stream: not recycled before that
        # stream's work at its free has passed
        target.record_stream(caller)
    return target


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
