"""Which encoder gets which image.

Live encoders are discovered through the NATS service API (their STATS carry instance id and load,
their metadata the fingerprint that keys their embedding cache), refreshed in the background. For each
image, in order:

1. the encoder the embedding index (JetStream KV) names as holding it, if alive: a hit there skips the
   ViT, and sending it anywhere else would only make that encoder borrow from the holder;
2. the image's rendezvous-hash favourite among live encoders (the same image keeps landing on the same
   encoder, so its cache serves it even without the index), unless that encoder is busier than the
   least-loaded one by more than ``margin`` images, which then takes it.

Images of one request count as load as they are placed, so a request's new images spread over idle
encoders; a request that carries the same image twice sends both to one encoder (which encodes it once).
With no discovery answer, images go to the plain queue group and NATS picks.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from shared.bus import Subjects, endpoint_data, service_stats
from shared.embedding_index import EmbeddingIndex, embedding_key
from shared.logging import get_logger

log = get_logger(__name__)

INDEX_LOOKUP_SECONDS = 0.25  # the index is an optimization: past this, route without it


@dataclass(frozen=True)
class EncoderInfo:
    instance: str
    load: int  # encode jobs in flight
    fingerprint: str = ""  # of its embedding cache keys ("" if it has no cache)


def rendezvous_score(content_hash: str, instance: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{content_hash}/{instance}".encode(), digest_size=8).digest(), "big")


class EncoderDirectory:
    def __init__(self, nc, subjects: Subjects, interval: float = 1.0):
        self.nc = nc
        self.subjects = subjects
        self.interval = interval
        self.encoders: list[EncoderInfo] = []
        self.index = EmbeddingIndex(nc, subjects.prefix, create=False, timeout=INDEX_LOOKUP_SECONDS, reopen=2.0)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever(), name="encoder-directory")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        found = []
        for stats in await service_stats(self.nc, "epd-encoder", wait=0.2):
            metadata = stats.get("metadata") or {}
            if metadata.get("prefix") != self.subjects.prefix:
                continue  # another stack sharing this NATS server
            data = endpoint_data(stats)
            instance = metadata.get("instance")
            if instance:
                found.append(EncoderInfo(instance, int(data.get("in_flight", 0)), metadata.get("cache_fingerprint", "")))
        self.encoders = sorted(found, key=lambda e: e.instance)

    async def holders(self, content_hashes: list[str]) -> list[str | None]:
        """For each image, the live encoder the embedding index says holds it (None: unknown)."""
        encoders = self.encoders
        fingerprints = sorted({e.fingerprint for e in encoders if e.fingerprint})
        if not fingerprints or not content_hashes:
            return [None] * len(content_hashes)
        alive = {e.instance for e in encoders}

        async def lookup(content_hash: str) -> str | None:
            for fingerprint in fingerprints:  # usually one: every encoder of a stack runs the same model
                holder = await self.index.holder(embedding_key(content_hash, fingerprint))
                if holder in alive:
                    return holder
            return None

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(lookup(h) for h in content_hashes)),
                                               INDEX_LOOKUP_SECONDS * 2))
        except asyncio.TimeoutError:
            return [None] * len(content_hashes)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                if self.nc.is_connected:
                    await self.refresh()
            except Exception as err:  # discovery is an optimization: keep serving through the queue group
                log.warning("encoder_directory.refresh_failed", error=str(err))
            await asyncio.sleep(self.interval)


def assign(content_hashes: list[str], encoders: list[EncoderInfo], subjects: Subjects,
           holders: list[str | None] | None = None, margin: int = 0) -> list[str]:
    """The subject each image's encode job goes to (see the module's docstring for the policy)."""
    if not encoders:
        return [subjects.encode] * len(content_hashes)
    holders = holders or [None] * len(content_hashes)
    load = {e.instance: e.load for e in encoders}
    placed: dict[str, str] = {}  # content hash → instance, for an image repeated within the request
    chosen = []
    for content_hash, holder in zip(content_hashes, holders):
        pick = placed.get(content_hash) or (holder if holder in load else None)
        if pick is None:
            pick = _by_load(content_hash, load, margin)
            load[pick] += 1  # a cache hit at its holder costs no ViT time: only new work counts
        placed[content_hash] = pick
        chosen.append(subjects.encode_on(pick))
    return chosen


def _by_load(content_hash: str, load: dict[str, int], margin: int) -> str:
    favourite = max(load, key=lambda inst: rendezvous_score(content_hash, inst))
    least = min(load, key=lambda inst: (load[inst], inst))
    return favourite if load[favourite] <= load[least] + margin else least
