"""The handle a producer gives out instead of a tensor: enough for a consumer to pull it, and no more."""

from __future__ import annotations

import time

import msgspec

# Wire names of the dtypes the data plane carries (torch's own names: ``torch.<name>``), and their sizes
# in bytes. No torch here: handles are read and checked by processes that never touch a tensor (``epd
# up`` starts in 3 s less without it); ``shared.dataplane.wire`` maps the names to torch dtypes.
ELEMENT_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}

MAX_DIMS = 8
TRANSPORTS = ("ucx", "zmq", "inproc")


class TensorHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    transport: str  # one of TRANSPORTS
    address: str  # where the holder listens: ucx://10.0.0.5:41234, tcp://10.0.0.5:41234, ipc://..., inproc://...
    key: str  # the tensor's name at the holder
    token: str  # unguessable; the holder refuses a pull without it
    dtype: str
    shape: list[int]
    nbytes: int
    expires_at: float  # unix time after which the holder may have freed the tensor

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown data plane transport {self.transport!r}")
        if self.dtype not in ELEMENT_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if len(self.shape) > MAX_DIMS or any(d < 0 for d in self.shape):
            raise ValueError("tensor shape must have at most 8 non-negative dimensions")
        expected = element_size(self.dtype)
        for d in self.shape:
            expected *= d
        if expected != self.nbytes:
            raise ValueError(f"nbytes {self.nbytes} does not match shape {self.shape} of {self.dtype}")

    @property
    def expired(self) -> bool:
        return time.time() > self.expires_at


def element_size(dtype: str) -> int:
    return ELEMENT_SIZES[dtype]


def dtype_name(dtype) -> str:
    """The wire name of a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in ELEMENT_SIZES:
        raise ValueError(f"the data plane cannot carry {dtype}")
    return name
