"""The one interface every transport implements: a server that serves a store, a client that pulls.

A process serves what it holds over one transport (chosen per deployment) and can pull from holders
of every transport, so a deployment may mix them (e.g. UCX between GPU hosts, ZMQ to a CPU frontend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from shared.dataplane.handle import TensorHandle

if TYPE_CHECKING:
    import torch


class TransportServer(Protocol):
    address: str  # what handles carry: where consumers reach this server

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class TransportClient(Protocol):
    async def pull(self, handle: TensorHandle, timeout: float, device: torch.device | None,
                   out: torch.Tensor | None) -> torch.Tensor:
        """The handle's tensor: received into ``out`` when given (the caller's reused buffer, no
        allocation), else on ``device`` (None: wherever it lands cheapest, host memory for remote
        holders). Raises DataPlaneError with the holder's code, or timeout / unreachable."""
        ...

    async def close(self) -> None: ...
