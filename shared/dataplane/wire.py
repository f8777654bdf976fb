"""What the network transports say to each other, and how a tensor becomes bytes and back.

A pull is three messages: the consumer's ``PullRequest``, the holder's ``PullReply`` followed by the raw
tensor bytes (or, holder and consumer on one GPU, a slot of the holder's export pool or a CUDA IPC
description instead: ``cuda_ipc``), and
the consumer's ``PullAck`` once it holds them. The holder counts a pull as done only
on the ack, so a consumer that dies mid-transfer leaves the tensor to its lease, never half-counted.
Control messages are small msgspec structs (MessagePack); nothing is ever unpickled.
"""

from __future__ import annotations

import struct
import warnings

import msgspec
import torch

from shared.dataplane.cuda_ipc import CudaIpc
from shared.dataplane.handle import ELEMENT_SIZES, TensorHandle
from shared.dataplane.store import DataPlaneError, TensorStore

CONTROL_BYTES = 256  # every control frame (UCX) is exactly this long; ZMQ caps requests at this size
BATCH_BYTES = 4096  # ... and batches of pulls (``PullBatch``) at this one
MAX_BATCH = 32  # handles a batch names (so it fits BATCH_BYTES)
MAX_MESSAGE_CHARS = 160  # error messages are cut to fit a control frame
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ELEMENT_SIZES}  # the handles' dtypes


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="pull"):
    key: str
    token: str
    nbytes: int  # what the consumer's handle says; a holder whose tensor differs refuses
    id: int = 0  # matches the reply to the request when many are in flight on one connection
    to_device: bool = False  # the consumer receives into GPU memory (UCX): GPU tensors go as they are
    gpu: str = ""  # the GPU the consumer receives on (ZMQ): a holder of the tensor on it answers with ``ipc``
    pool: str = ""  # the holder's export pool this consumer has mapped already (``cuda_ipc.ExportPool``)


class PullBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="batch"):
    """Same GPU, several tensors of one holder at once (a request's image embeddings): staged together
    in one slot of the holder's export pool, answered by one ``PullReply`` naming it. A holder that
    cannot (no pool, no room, a tensor elsewhere or refused) answers ``unbatched`` and the consumer
    pulls them one by one, each with its own answer."""
    keys: list[str]
    tokens: list[str]
    nbytes: list[int]
    gpu: str
    pool: str = ""


class PullAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ack"):
    key: str
    token: str
    slot: int = -1  # the export pool's slot the bytes were copied from: the holder frees it
    done: bool = True  # the pull counts (False: only the slot is given back; the bytes come by another pull)


class PullReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    ok: bool
    code: str = ""
    message: str = ""
    ipc: CudaIpc | None = None  # same GPU: map the holder's memory, no payload follows (``cuda_ipc``)
    slot: int = -1  # same GPU: the bytes are at this offset of the export pool ``pool`` (``ipc``: the pool)
    pool: str = ""


ConsumerMessage = PullRequest | PullBatch | PullAck

_encoder = msgspec.msgpack.Encoder()
consumer_decoder = msgspec.msgpack.Decoder(ConsumerMessage)
reply_decoder = msgspec.msgpack.Decoder(PullReply)
_LENGTH = struct.Struct("<I")


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def refusal(code: str, message: str) -> PullReply:
    return PullReply(False, code, message[:MAX_MESSAGE_CHARS])


def lookup(store: TensorStore, request: PullRequest) -> tuple[PullReply, torch.Tensor | None]:
    """The holder's answer to a pull: its reply, and the tensor to send when the reply is ok."""
    try:
        tensor = store.get(request.key, request.token)
    except DataPlaneError as err:
        return refusal(err.code, err.message), None
    if tensor.numel() * tensor.element_size() != request.nbytes:
        return refusal("bad_request", "the handle's byte size does not match the tensor"), None
    return PullReply(True), tensor


def to_frame(message: msgspec.Struct) -> bytearray:
    """``message`` in a fixed-size frame: a length, the MessagePack body, zero padding."""
    body = _encoder.encode(message)
    if len(body) + _LENGTH.size > CONTROL_BYTES:
        raise ValueError("control message does not fit a frame")
    frame = bytearray(CONTROL_BYTES)
    _LENGTH.pack_into(frame, 0, len(body))
    frame[_LENGTH.size:_LENGTH.size + len(body)] = body
    return frame


def from_frame(frame: bytes | bytearray, decoder: msgspec.msgpack.Decoder):
    """Raises msgspec.DecodeError / ValidationError on anything but a well-formed frame."""
    (length,) = _LENGTH.unpack_from(frame, 0)
    if length > CONTROL_BYTES - _LENGTH.size:
        raise msgspec.DecodeError("control frame length out of range")
    return decoder.decode(memoryview(frame)[_LENGTH.size:_LENGTH.size + length])


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat uint8 tensor on its own device, without a copy (it is contiguous)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory: a view for a CPU tensor, else one copy into pinned memory (from
    torch's cache of pinned blocks; 4x a pageable copy's speed). Blocks: call off the event loop."""
    flat = flat_bytes(tensor)
    if flat.device.type != "cpu":
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        flat = host
    return memoryview(flat.numpy())


def empty_like_handle(handle: TensorHandle, device: torch.device | str = "cpu") -> torch.Tensor:
    """A writable flat uint8 buffer that a handle's bytes are received into."""
    return torch.empty(handle.nbytes, dtype=torch.uint8, device=device)


def check_out(out: torch.Tensor, handle: TensorHandle) -> torch.Tensor:
    """``out`` (a caller's buffer to receive into) as flat bytes; it must be contiguous and the right size."""
    if not out.is_contiguous() or out.numel() * out.element_size() != handle.nbytes:
        raise ValueError(f"out must be a contiguous tensor of {handle.nbytes} bytes")
    return flat_bytes(out)


def deliver(flat: torch.Tensor, handle: TensorHandle, device: torch.device | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """Received bytes as the handle's tensor: copied into ``out`` (unless they landed there), else moved
    to ``device`` if they are not on it already."""
    if out is not None:
        target = check_out(out, handle)
        if target.data_ptr() != flat.data_ptr() and handle.nbytes:
            target.copy_(flat)
        return as_tensor(target, handle)
    tensor = as_tensor(flat, handle)
    return tensor if device is None or tensor.device == device else tensor.to(device)


def as_tensor(flat: torch.Tensor, handle: TensorHandle) -> torch.Tensor:
    """The received bytes seen as the handle's dtype and shape (no copy)."""
    return flat.view(DTYPES[handle.dtype]).view(handle.shape)


def tensor_from_buffer(buffer, handle: TensorHandle) -> torch.Tensor:
    """A tensor over a received (read-only) buffer, without a copy; consumers copy on use."""
    if handle.nbytes == 0:
        return torch.empty(handle.shape, dtype=DTYPES[handle.dtype])
    with warnings.catch_warnings():  # torch warns that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return as_tensor(flat, handle)
