"""Aggregated: encode, prefill and decode in one process — the baseline every EPD layout is measured
against, so it must itself run near its floor.

It is the joined language worker plus an ``Encoder``. A frontend sends it a request's prompt with its
images' pixels (metadata ``encodes_in_place``): the worker encodes them and its engine thread places the
embeddings into the prompt right after the forward (``in_place``), with no trip back through the
frontend. It also answers the encoder's subjects and takes prompts with embeddings, as a disaggregated
stack's workers do. Its ViT forwards run in the engine's thread between two engine steps
(``VisionBatcher.step``): one thread drives the GPU (docs/architecture.md says why).
Embeddings its own encoder holds come from its data plane's store without a copy. Between steps, while
sequences decode, its ViT batches get what the engine's time budget leaves (``--target-itl-ms``), cut by a
model of forward time it fits at start (``services.encoder.forward_time``).
"""

from __future__ import annotations

from services.aggregated.in_place import InPlacePrompts
from services.aggregated.settings import AggregatedSettings
from services.encoder.encoder import Encoder
from services.encoder.forward_time import ForwardTimes, calibrate
from services.language.service import LanguageService
from services.language.worker import Tracked
from shared.bus.service_api import Endpoint
from shared.messages.prefill import PrefillJob


class AggregatedService(LanguageService):
    kind = "aggregated"
    description = "Encoder + prefill + decode in one process and one engine (the aggregated baseline)"

    def __init__(self, settings: AggregatedSettings):
        super().__init__(settings)
        self.encoder = Encoder(settings, self.subjects, self.instance, self.plane)
        self.in_place: InPlacePrompts | None = None

    async def setup(self) -> None:
        await super().setup()
        self.in_place = InPlacePrompts(self.encoder, self.worker, self.intake)
        self.resources.push_async_callback(self.in_place.settling.cancel)

    async def start_worker(self) -> None:
        # the vision tower first: the KV pool is sized from the memory that is left
        await self.encoder.start(self.nc, self.resources, own_thread=False)
        await self.worker.start(self.nc, self.resources, side=self.encoder.vision.batcher)
        if self.worker.engine.step_times is not None:
            await self.worker.loop.call(self._time_forwards)

    def _time_forwards(self, engine) -> None:
        """The engine thread, before serving: the ViT's forward-time model, fitted to timed forwards, so its
        batches between steps fit the engine's time budget while sequences decode."""
        batcher = self.encoder.vision.batcher
        pieces = batcher.tower.pieces
        batcher.forward_times = ForwardTimes(graphs=pieces.layouts if pieces is not None else None)
        calibrate(batcher.tower, batcher.forward_times, batcher.max_patches)

    def endpoints(self) -> list[Endpoint]:
        return [*self.encoder.endpoints(), *super().endpoints()]

    async def admit(self, job: PrefillJob, tracked: Tracked) -> None:
        if any(slot.pixels is not None for slot in job.images):
            await self.in_place.admit(job, tracked)  # the prompt enters the engine once its images are encoded
        else:
            await super().admit(job, tracked)

    def metadata(self) -> dict[str, str]:
        # the encoder's cache fingerprint; frontends send prompts here with their images' pixels
        return {**super().metadata(), **self.encoder.metadata(), "encodes_in_place": "true"}

    async def drain(self) -> None:
        await super().drain()
        await self.plane.handed_out()

    def stats(self) -> dict:
        batcher = self.encoder.vision.batcher
        forward_times = batcher.forward_times if batcher else None
        return {**self.encoder.stats(), **super().stats(), **(self.in_place.stats() if self.in_place else {}),
                **(forward_times.stats() if forward_times else {})}
