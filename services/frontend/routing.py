"""Which encoder gets which image.

Live encoders are discovered through the NATS service API (their STATS carry instance id and load),
refreshed in the background. Each image goes to its rendezvous-hash favourite among live encoders (the
same image keeps landing on the same encoder, where its embeddings are cached), unless that encoder is
busier than the least-loaded one, which then takes it; images of one request count as load as they are
placed, so a request's images spread over idle encoders. With no discovery answer, images go to the
plain queue group and NATS picks.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from shared.bus import Subjects, service_stats
from shared.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class EncoderInfo:
    instance: str
    load: int  # images queued or in flight


def rendezvous_score(content_hash: str, instance: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{content_hash}/{instance}".encode(), digest_size=8).digest(), "big")


class EncoderDirectory:
    def __init__(self, nc, subjects: Subjects, interval: float = 1.0):
        self.nc = nc
        self.subjects = subjects
        self.interval = interval
        self.encoders: list[EncoderInfo] = []
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
            if (stats.get("metadata") or {}).get("prefix") != self.subjects.prefix:
                continue  # another stack sharing this NATS server
            data = next((e.get("data") or {} for e in stats.get("endpoints") or [] if e.get("data")), {})
            instance = (stats.get("metadata") or {}).get("instance")
            if instance:
                found.append(EncoderInfo(instance, int(data.get("queue_depth", 0)) + int(data.get("in_flight", 0))))
        self.encoders = sorted(found, key=lambda e: e.instance)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                if self.nc.is_connected:
                    await self.refresh()
            except Exception as err:  # discovery is an optimization: keep serving through the queue group
                log.warning("encoder_directory.refresh_failed", error=str(err))
            await asyncio.sleep(self.interval)


def assign(content_hashes: list[str], encoders: list[EncoderInfo], subjects: Subjects) -> list[str]:
    """The subject each image's encode job goes to."""
    if not encoders:
        return [subjects.encode] * len(content_hashes)
    load = {e.instance: e.load for e in encoders}
    chosen = []
    for content_hash in content_hashes:
        favourite = max(load, key=lambda inst: rendezvous_score(content_hash, inst))
        least = min(load, key=lambda inst: (load[inst], inst))
        pick = favourite if load[favourite] <= load[least] else least
        load[pick] += 1
        chosen.append(subjects.encode_on(pick))
    return chosen
