"""Aggregated: encode, prefill and decode in one process — the baseline every EPD layout is measured
against, so it must itself run near its floor.

It is the joined language worker plus an ``Encoder`` that answers the encoder's subjects (so the
unchanged frontend talks to it as to a disaggregated stack). Its ViT forwards run in the engine's
thread, between two engine steps (``VisionBatcher.step``), or with ``--vit-thread`` in a thread and on a
CUDA stream of their own beside the engine, as an encoder's do (docs/architecture.md says which and why).
Embeddings its own encoder holds come from its data plane's store without a copy.
"""

from __future__ import annotations

from services.aggregated.settings import AggregatedSettings
from services.encoder.encoder import Encoder
from services.language.service import LanguageService
from shared.bus.service_api import Endpoint


class AggregatedService(LanguageService):
    kind = "aggregated"
    description = "Encoder + prefill + decode in one process and one engine (the aggregated baseline)"

    def __init__(self, settings: AggregatedSettings):
        super().__init__(settings)
        self.encoder = Encoder(settings, self.subjects, self.instance, self.plane)

    async def start_worker(self) -> None:
        # the vision tower first: the KV pool is sized from the memory that is left
        beside = self.settings.vit_thread
        await self.encoder.start(self.nc, self.resources, own_thread=beside, own_stream=beside)
        await self.worker.start(self.nc, self.resources, side=None if beside else self.encoder.batcher,
                                handoff_s=self.settings.vit_handoff_wait_ms / 1e3)

    def endpoints(self) -> list[Endpoint]:
        return [*self.encoder.endpoints(), *super().endpoints()]

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), **self.encoder.metadata()}  # the encoder's cache fingerprint

    async def drain(self) -> None:
        await super().drain()
        await self.plane.handed_out()

    def stats(self) -> dict:
        return {**self.encoder.stats(), **super().stats()}
