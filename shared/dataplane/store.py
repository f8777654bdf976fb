"""What a producer holds for its consumers: tensors under keys, each with a token, a lease and a pull count.

A tensor is a torch tensor, or a host array (numpy) from a process that never loads torch (the frontend's
decoded pixels): both are held contiguous and served as their bytes.

A tensor is freed when it has been pulled by every consumer it was published for, when its lease
expires (so a crashed consumer cannot leak the holder's memory), or when the producer releases it.
Bytes held are bounded: a full store refuses to grow instead of swapping the machine to death.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class DataPlaneError(Exception):
    """A pull or publish that cannot be served. ``code``: not_found, forbidden, expired, full, bad_request
    (the holder's answers), timeout, unreachable (the consumer's own verdicts)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Entry:
    tensor: torch.Tensor | np.ndarray
    token: str
    expires_at: float
    remaining: int | None  # pulls left; None: until released or expired
    nbytes: int
    ready: object = None  # GPU tensors: a CUDA event after the work that produced it (``cuda_ipc.mark``)


LAPSED_KEYS = 4096  # expired keys remembered, so a late consumer hears "expired", not "not found"


class TensorStore:
    def __init__(self, max_bytes: int, lease_seconds: float):
        self.max_bytes = max_bytes
        self.lease_seconds = lease_seconds
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._lapsed: OrderedDict[str, None] = OrderedDict()
        self.served = 0  # pulls answered with the tensor (a remote one counts in ``pulls`` on its ack)
        self.pulls = 0
        self.expired = 0
        self.refused = 0  # publishes turned away because the store was full
        self.mapped = 0  # pulls answered with a CUDA IPC description instead of bytes (same GPU)
        self.pooled = 0  # of them, answered with a slot of the export pool (``cuda_ipc.ExportPool``)
        self.on_empty = lambda: None  # called (any thread, lock released) when the last tensor is freed

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tensor: torch.Tensor | np.ndarray, consumers: int | None = 1, lease: float | None = None,
            ready=None) -> tuple[str, str, float]:
        """Hold ``tensor`` for ``consumers`` pulls (None: until released or expired); returns (key, token,
        expires_at). ``ready``: a GPU tensor's CUDA event (``cuda_ipc.mark``). Raises DataPlaneError("full") rather
        than exceed ``max_bytes``."""
        if consumers is not None and consumers < 1:
            raise ValueError("a tensor is published for at least one consumer (or None: until released)")
        nbytes = tensor.nbytes
        expires_at = time.time() + (lease or self.lease_seconds)
        key, token = secrets.token_hex(8), secrets.token_urlsafe(24)
        with self._lock:
            self._sweep_locked()
            if self._bytes + nbytes > self.max_bytes:
                self.refused += 1
                raise DataPlaneError("full", f"data plane full: {self._bytes + nbytes} bytes would exceed "
                                             f"the limit of {self.max_bytes}")
            held = np.ascontiguousarray(tensor) if isinstance(tensor, np.ndarray) else tensor.contiguous()
            self._entries[key] = _Entry(held, token, expires_at, consumers, nbytes, ready)
            self._bytes += nbytes
        return key, token, expires_at

    def get(self, key: str, token: str, count: bool = True) -> torch.Tensor | np.ndarray:
        """The tensor, if ``token`` is right and the lease holds. Does not count as a completed pull
        (``count``: as served; a batch counts its tensors once it knows it serves them all)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if key in self._lapsed:
                    raise DataPlaneError("expired", "the tensor's lease expired before it was pulled")
                raise DataPlaneError("not_found", "no tensor under this key (never held, already pulled, or freed)")
            if not hmac.compare_digest(entry.token, token):
                raise DataPlaneError("forbidden", "wrong token for this tensor")
            if time.time() > entry.expires_at:
                self._expire_locked(key)
                raise DataPlaneError("expired", "the tensor's lease expired before it was pulled")
            self.served += count
            return entry.tensor

    def ready(self, key: str):
        """The CUDA event a GPU tensor was published with (None: none, or no longer held)."""
        entry = self._entries.get(key)
        return entry.ready if entry is not None else None

    def done(self, key: str) -> None:
        """One consumer finished pulling ``key``; free it after the last."""
        with self._lock:
            self.pulls += 1
            entry = self._entries.get(key)
            if entry is None or entry.remaining is None:
                return
            entry.remaining -= 1
            if entry.remaining <= 0:
                self._drop_locked(key)
        self._notify()

    def ack(self, key: str, token: str) -> None:
        """A remote consumer confirms it holds the bytes: ``done``, if it proves it was given the handle."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not hmac.compare_digest(entry.token, token):
                return  # already freed (lease, release) or not a consumer of it: nothing to count
        self.done(key)

    def release(self, key: str) -> None:
        with self._lock:
            self._drop_locked(key)
        self._notify()

    def stats(self) -> dict:
        return {"bytes_held": self._bytes, "tensors": len(self._entries), "served": self.served,
                "pulls": self.pulls, "expired": self.expired, "refused": self.refused, "mapped": self.mapped,
                "pooled": self.pooled}

    def sweep(self) -> int:
        with self._lock:
            swept = self._sweep_locked()
        self._notify()
        return swept

    def _notify(self) -> None:
        if not self._entries:
            self.on_empty()

    def _sweep_locked(self) -> int:
        now = time.time()
        stale = [k for k, e in self._entries.items() if now > e.expires_at]
        for key in stale:
            self._expire_locked(key)
        return len(stale)

    def _expire_locked(self, key: str) -> None:
        self._drop_locked(key)
        self.expired += 1
        self._lapsed[key] = None
        if len(self._lapsed) > LAPSED_KEYS:
            self._lapsed.popitem(last=False)

    def _drop_locked(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
