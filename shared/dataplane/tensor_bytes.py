"""How a tensor becomes bytes and back: a consumer's buffers, and a holder's tensors sent as bytes."""

from __future__ import annotations

import warnings

import torch

from shared.dataplane.handle import ELEMENT_SIZES, TensorHandle

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ELEMENT_SIZES}  # the handles' dtypes


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
