"""Borrowing embeddings from the encoder that holds them, instead of running the ViT again.

Each encoder answers ``<prefix>.encode.<instance>.fetch`` (``EmbeddingFetch`` → ``EmbeddingLoan``, a
fresh one-pull handle to its cached embeddings, or 404). A borrower that gets no loan (holder gone,
evicted, slow) says so with ``None`` and encodes the image itself.
"""

from __future__ import annotations

import asyncio

from services.encoder.cache import Embedding
from shared.bus.calls import ServiceCallError, call
from shared.bus.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.dataplane.store import DataPlaneError
from shared.logging import get_logger
from shared.messages import ProtocolError, pack, unpack
from shared.messages.encode import EmbeddingFetch, EmbeddingLoan

log = get_logger(__name__)


class PeerEncoders:
    def __init__(self, nc, subjects: Subjects, plane: DataPlane, timeout: float):
        self.nc = nc
        self.subjects = subjects
        self.plane = plane
        self.timeout = timeout  # per step (ask, pull): a dead or stuck holder costs at most this, twice
        self.borrowed = 0
        self.failures = 0

    async def borrow(self, holder: str, key: str) -> Embedding | None:
        """``holder``'s embeddings for ``key``, pulled here; None if it cannot lend them."""
        try:
            reply = await call(self.nc, self.subjects.encode_fetch(holder), pack(EmbeddingFetch(key=key)),
                               self.timeout, "encoder holding the image")
            loan = unpack(EmbeddingLoan, reply)
            tensor = await asyncio.wait_for(self.plane.pull(loan.embedding), self.timeout)
        except (ServiceCallError, DataPlaneError, ProtocolError, asyncio.TimeoutError) as err:
            self.failures += 1
            log.info("peer.borrow_failed", holder=holder, error=getattr(err, "message", repr(err)))
            return None
        self.borrowed += 1
        return Embedding(tensor, tuple(loan.grid), owned=False)
