"""Where one image's embeddings come from, cheapest first:

1. this encoder's cache (a hit skips the ViT);
2. a job on this encoder already encoding the same image (concurrent duplicates await one future);
3. the encoder the index names as holder, or as encoding it right now (borrowed over the data plane);
4. the ViT, after claiming the image in the index so other encoders borrow instead of encoding it too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine

from services.encoder.cache import Embedding, EmbeddingCache
from services.encoder.peers import PeerEncoders
from shared.embedding_index import EmbeddingIndex
from shared.logging import get_logger

log = get_logger(__name__)

Encode = Callable[[], Awaitable[Embedding]]

_MAX_CHORES = 1024  # index updates queued in the background at most; beyond, they are skipped


class EncodeAbandoned(Exception):
    """The job encoding an image was cancelled (shutdown): jobs waiting on it encode their own copy."""


class EmbeddingSource:
    def __init__(self, cache: EmbeddingCache, index: EmbeddingIndex | None, peers: PeerEncoders, instance: str):
        self.cache = cache
        self.index = index
        self.peers = peers
        self.instance = instance
        self.in_flight: dict[str, asyncio.Future] = {}
        self.joined = 0  # jobs served by another job's encoding of the same image
        self.computed = 0
        self.lent = 0
        self.chores_skipped = 0
        self._chores: set[asyncio.Task] = set()

    async def obtain(self, key: str, encode: Encode) -> tuple[Embedding, str]:
        """The embeddings for ``key`` and where they came from: cache, joined, peer or computed.

        ``encode`` runs the ViT on this job's own pixels; it is called only when nothing else has them.
        """
        for _ in range(3):  # a failed leader's followers look again before encoding themselves
            found = self.cache.get(key)
            if found is not None:
                self._touch(key, found)
                return found, "cache"
            pending = self.in_flight.get(key)
            if pending is None:
                break
            try:
                embedding = await asyncio.shield(pending)
            except Exception:  # the leader's failure was about its pixels, not ours
                continue
            self.joined += 1
            return embedding, "joined"
        return await self._lead(key, encode)

    async def lend(self, key: str) -> Embedding | None:
        """For a peer: what this encoder holds for ``key``, waiting for an encoding under way."""
        found = self.cache.peek(key)
        if found is None and (pending := self.in_flight.get(key)) is not None:
            try:
                found = await asyncio.shield(pending)
            except Exception:
                return None
        if found is not None:
            self.lent += 1
        return found

    async def _lead(self, key: str, encode: Encode) -> tuple[Embedding, str]:
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self.in_flight[key] = future
        try:
            embedding, origin = await self._borrow_or_encode(key, encode)
        except asyncio.CancelledError:
            future.set_exception(EncodeAbandoned())
            raise
        except Exception as err:
            future.set_exception(err)
            self._chore(self._forget(key))
            raise
        finally:
            if self.in_flight.get(key) is future:
                del self.in_flight[key]
        if embedding.owned:
            embedding.announced_at = time.monotonic()  # claimed (or taken over) before encoding
        for old_key, old in self.cache.put(key, embedding):
            if old.owned:
                self._chore(self._forget(old_key))
        if embedding.owned and key not in self.cache:  # larger than the whole cache: nothing to lend
            self._chore(self._forget(key))
        future.set_result(embedding)
        return embedding, origin

    async def _borrow_or_encode(self, key: str, encode: Encode) -> tuple[Embedding, str]:
        holder = await self.index.claim(key, self.instance) if self.index else None
        if holder is not None:
            borrowed = await self.peers.borrow(holder, key)
            if borrowed is not None:
                return borrowed, "peer"
            await self.index.announce(key, self.instance)  # the named holder failed us: we hold it next
        embedding = await encode()
        self.computed += 1
        return embedding, "computed"

    def _touch(self, key: str, embedding: Embedding) -> None:
        """Restart the index entry's TTL for an image still in demand here (at most twice per TTL)."""
        if self.index is None or not embedding.owned:
            return
        now = time.monotonic()
        if now - embedding.announced_at > self.index.ttl / 2:
            embedding.announced_at = now
            self._chore(self.index.announce(key, self.instance))

    async def _forget(self, key: str) -> None:
        if self.index is not None:
            await self.index.forget(key, self.instance)

    def _chore(self, work: Coroutine) -> None:
        """Index upkeep off the request path; the index logs and counts its own failures."""
        if len(self._chores) >= _MAX_CHORES:
            self.chores_skipped += 1
            work.close()
            return
        task = asyncio.create_task(work, name="embedding-index")
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def close(self) -> None:
        if self._chores:
            await asyncio.gather(*self._chores, return_exceptions=True)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # a failure nobody joined is not "never retrieved": the leader reported it
