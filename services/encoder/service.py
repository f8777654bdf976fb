"""The encoder service: vision tower only (it never loads the language model). One ``Encoder`` with a
ViT thread of its own, its data plane, and its three endpoints; on SIGTERM it leaves the queue group,
finishes its jobs, and keeps serving the embeddings it handed out until they are pulled or their lease
ends, so a scale-in loses nothing."""

from __future__ import annotations

from services.encoder.encoder import Encoder
from services.encoder.settings import EncoderSettings
from shared.bus.service_api import Endpoint
from shared.dataplane.plane import DataPlane
from shared.service import Service


class EncoderService(Service):
    kind = "encoder"
    description = "Vision encoder: pixels in, embedding handles out"

    def __init__(self, settings: EncoderSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.encoder = Encoder(settings, self.subjects, self.instance, self.plane)

    async def setup(self) -> None:
        await self.open_plane()
        await self.encoder.start(self.nc, self.resources)

    def endpoints(self) -> list[Endpoint]:
        return self.encoder.endpoints()

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), **self.encoder.metadata()}

    async def drain(self) -> None:
        await self.registration.drain()
        await self.plane.handed_out()  # what prefill has not pulled yet (bounded by the leases)

    def stats(self) -> dict:
        return {"instance": self.instance, **self.encoder.stats(),
                "errors": sum(e.errors for e in self.registration.endpoints) if self.registration else 0}
