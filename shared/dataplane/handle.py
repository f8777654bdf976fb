"""The handle a producer gives out instead of a tensor: enough for a consumer to pull it, and no more."""

from __future__ import annotations

import time

import msgspec
import torch

# Wire names of the dtypes the data plane carries.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

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
        if self.dtype not in DTYPES:
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
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"the data plane cannot carry {dtype}") from None
