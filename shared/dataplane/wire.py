"""What the network transports say to each other (how a tensor becomes bytes and back: ``tensor_bytes``).

A pull is three messages: the consumer's ``PullRequest``, the holder's ``PullReply`` followed by the raw
tensor bytes (or, holder and consumer on one GPU, a slot of the holder's export pool or a CUDA IPC
description instead: ``cuda_ipc``), and
the consumer's ``PullAck`` once it holds them. The holder counts a pull as done only
on the ack, so a consumer that dies mid-transfer leaves the tensor to its lease, never half-counted.
Control messages are small msgspec structs (MessagePack); nothing is ever unpickled.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from shared.dataplane.store import DataPlaneError, TensorStore

CONTROL_BYTES = 256  # every control frame (UCX) is exactly this long; ZMQ caps requests at this size
BATCH_BYTES = 4096  # ... and batches of pulls (``PullBatch``) at this one
MAX_BATCH = 32  # handles a batch names (so it fits BATCH_BYTES)
MAX_MESSAGE_CHARS = 160  # error messages are cut to fit a control frame


class CudaIpc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a consumer needs to map a holder's GPU tensor (torch's ``_share_cuda_`` fields; ``cuda_ipc``)."""
    handle: bytes  # the allocation block's IPC memory handle
    block_bytes: int  # size of the storage the tensor lives in
    block_offset: int  # the storage's offset in the block
    byte_offset: int  # the tensor's offset in its storage
    counter: bytes  # name of the shared-memory file of reference counters
    counter_offset: int
    event: bytes  # IPC event handle: the copy waits for it
    event_sync: bool


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


def lookup(store: TensorStore, request: PullRequest):
    """The holder's answer to a pull: its reply, and the tensor (or host array) to send when the reply is ok."""
    try:
        tensor = store.get(request.key, request.token)
    except DataPlaneError as err:
        return refusal(err.code, err.message), None
    if tensor.nbytes != request.nbytes:
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


def host_bytes(value) -> memoryview:
    """A held array's bytes in host memory: a host array's own (the store holds them contiguous), a GPU
    tensor's copied (``tensor_bytes.host_bytes``; blocks: call off the event loop)."""
    if isinstance(value, np.ndarray):
        return memoryview(value.reshape(-1).view(np.uint8))
    from shared.dataplane import tensor_bytes  # a tensor: torch is loaded already

    return tensor_bytes.host_bytes(value)
