"""KV reservations of a decode worker: blocks held for a prompt whose KV is still on its way.

A reservation is made (``KVReserve``), filled layer group by layer group (``KVChunk``), and either
started (``DecodeStart``, once every layer has landed) or ended: cancelled, or expired when its
transfer or start did not come within ``--reservation-timeout``, or at once when the prefill sending it
is gone (the decode service watches it). Expiry is a timer per reservation, not a sweep. Whoever ends a
reservation frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.sequence import Sequence


@dataclass
class Reservation:
    seq: Sequence  # prompt-length placeholder until the start fills in the real tokens
    stream: str
    landed: dict[int, int] = field(default_factory=dict)  # layer → tokens of its KV in the blocks
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # taken: started, cancelled or expired
    timer: asyncio.TimerHandle | None = None


class Reservations:
    def __init__(self, timeout: float, on_expired: Callable[[str, Reservation, str], None]):
        self.timeout = timeout
        self.on_expired = on_expired  # frees the blocks and tells the request's stream (and why)
        self.held: dict[str, Reservation] = {}
        self.none_held = asyncio.Event()
        self.none_held.set()
        self.expired = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def __len__(self) -> int:
        return len(self.held)

    def get(self, request_id: str) -> Reservation | None:
        return self.held.get(request_id)

    def hold(self, request_id: str, reservation: Reservation) -> None:
        loop = asyncio.get_running_loop()
        reservation.timer = loop.call_later(self.timeout, self.expire, request_id, reservation,
                                            "the KV transfer from prefill did not complete")
        self.held[request_id] = reservation
        self.none_held.clear()

    def take(self, request_id: str, reservation: Reservation | None = None) -> Reservation | None:
        """End the reservation (``reservation``: only if it is still that one); the caller owns its blocks."""
        current = self.held.get(request_id)
        if current is None or (reservation is not None and current is not reservation):
            return None
        del self.held[request_id]
        if not self.held:
            self.none_held.set()
        if current.timer is not None:
            current.timer.cancel()
        current.ended.set()
        return current

    def land(self, reservation: Reservation, layers: range, tokens: int, num_layers: int) -> None:
        """``tokens`` more tokens of ``layers`` are in the blocks; complete once every layer holds them all
        (prefill sends each range once)."""
        for layer in layers:
            reservation.landed[layer] = reservation.landed.get(layer, 0) + tokens
        if all(reservation.landed.get(i, 0) == reservation.seq.num_computed for i in range(num_layers)):
            reservation.complete.set()

    def remaining(self, reservation: Reservation) -> float:
        """Seconds left before ``reservation`` expires."""
        return max(0.0, reservation.timer.when() - asyncio.get_running_loop().time()) if reservation.timer else 0.0

    def expire(self, request_id: str, reservation: Reservation, reason: str) -> None:
        """End ``reservation`` (if it is still held) as failed: its KV or its start will not come."""
        if self.take(request_id, reservation) is not None:
            self.expired += 1
            self.on_expired(request_id, reservation, reason)
