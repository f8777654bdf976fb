"""What a producer holds for its consumers: tensors under keys, each with a token, a lease and a pull count.

A tensor is freed when it has been pulled by every consumer it was published for, when its lease
expires (so a crashed consumer cannot leak the holder's memory), or when the producer releases it.
Bytes held are bounded: a full store refuses to grow instead of swapping the machine to death.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass

import torch


class DataPlaneError(Exception):
    """A pull or publish that cannot be served; ``code`` is one of not_found, forbidden, expired, full, bad_request."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Entry:
    tensor: torch.Tensor
    token: str
    expires_at: float
    remaining: int | None  # pulls left; None: until released or expired
    nbytes: int


class TensorStore:
    def __init__(self, max_bytes: int, lease_seconds: float):
        self.max_bytes = max_bytes
        self.lease_seconds = lease_seconds
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.pulls = 0
        self.expired = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tensor: torch.Tensor, consumers: int | None = 1, lease: float | None = None) -> tuple[str, str, float]:
        """Hold ``tensor``; returns (key, token, expires_at)."""
        nbytes = tensor.numel() * tensor.element_size()
        expires_at = time.time() + (lease or self.lease_seconds)
        key, token = secrets.token_hex(8), secrets.token_urlsafe(24)
        with self._lock:
            self._sweep_locked()
            if self._bytes + nbytes > self.max_bytes:
                raise DataPlaneError("full", f"data plane full: {self._bytes + nbytes} bytes would exceed "
                                             f"the limit of {self.max_bytes}")
            self._entries[key] = _Entry(tensor.contiguous(), token, expires_at, consumers, nbytes)
            self._bytes += nbytes
        return key, token, expires_at

    def get(self, key: str, token: str) -> torch.Tensor:
        """The tensor, if ``token`` is right and the lease holds. Does not count as a completed pull."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise DataPlaneError("not_found", "no tensor under this key (never held, already pulled, or freed)")
            if not hmac.compare_digest(entry.token, token):
                raise DataPlaneError("forbidden", "wrong token for this tensor")
            if time.time() > entry.expires_at:
                self._drop_locked(key)
                self.expired += 1
                raise DataPlaneError("expired", "the tensor's lease expired before it was pulled")
            return entry.tensor

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

    def release(self, key: str) -> None:
        with self._lock:
            self._drop_locked(key)

    def sweep(self) -> int:
        with self._lock:
            return self._sweep_locked()

    def _sweep_locked(self) -> int:
        now = time.time()
        stale = [k for k, e in self._entries.items() if now > e.expires_at]
        for key in stale:
            self._drop_locked(key)
        self.expired += len(stale)
        return len(stale)

    def _drop_locked(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
