"""Prefill: language model only. Pulls image embeddings by handle, reserves room on a decode worker,
computes the prompt (batched across requests) while streaming its KV to that worker layer group by
layer group, sends the first token straight to the request's stream, and starts the decode."""

from __future__ import annotations

from services.language.intake import PromptIntake, intake_endpoints
from services.language.worker import LanguageWorker
from services.prefill.handoff import Handoffs
from services.prefill.settings import PrefillSettings
from shared.bus.directory import Directory
from shared.bus.service_api import Endpoint, Request
from shared.dataplane.plane import DataPlane
from shared.messages import pack, unpack
from shared.messages.prefill import PrefillAccepted, PrefillJob
from shared.service import Service


class PrefillService(Service):
    kind = "prefill"
    description = "Language-model prefill: prompt + image embeddings in, first token and KV out"

    def __init__(self, settings: PrefillSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.worker = LanguageWorker(settings, "prefill", self.subjects, self.instance,
                                     on_layer_done=lambda layer, spans: self.handoffs.on_layer_done(layer, spans))
        self.handoffs: Handoffs | None = None
        self.intake: PromptIntake | None = None

    async def setup(self) -> None:
        await self.open_plane()
        self.directory = Directory(self.nc, self.subjects.prefix)
        self.directory.start()
        self.resources.push_async_callback(self.directory.stop)
        self.handoffs = Handoffs(self.worker, self.nc, self.subjects, self.plane, self.directory)
        await self.worker.start(self.nc, self.resources)
        self.resources.push_async_callback(self.handoffs.tasks.cancel)
        engine = self.worker.engine
        self.intake = PromptIntake(self.worker.config, self.plane, engine.runner.device, engine.max_model_len,
                                   engine.blocks)

    def endpoints(self) -> list[Endpoint]:
        return intake_endpoints(self.subjects, self.instance, self.handle_prefill, self.settings.max_concurrent_jobs,
                                self.intake)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), **(self.intake.metadata() if self.intake else {})}

    async def handle_prefill(self, request: Request) -> bytes:
        job = unpack(PrefillJob, request.data)
        self.worker.refuse_cancelled(job.request_id)
        seq = await self.intake.sequence(job)
        tracked = await self.handoffs.reserve(job)  # before any compute: no decode worker, no prefill
        if job.request_id in self.worker.cancelled:  # cancelled while it waited for room
            self.handoffs.abandon(job.request_id)
            self.worker.refuse_cancelled(job.request_id)
        await self.worker.add_prompt(seq, tracked)
        return pack(PrefillAccepted(prefill_id=self.instance))

    async def drain(self) -> None:
        await self.registration.drain()
        await self.worker.drained()
        await self.handoffs.tasks.drain()

    def stats(self) -> dict:
        intake = self.intake
        return {"instance": self.instance, **self.worker.stats(), **(self.handoffs.stats() if self.handoffs else {}),
                **(intake.stats() if intake else {}),
                "prompts_in_flight": sum(e.in_flight for e in self.registration.endpoints if e.name.startswith("prefill"))
                if self.registration else 0,
                "errors": sum(e.errors for e in self.registration.endpoints) if self.registration else 0,
                "bytes_held": self.plane.store.bytes_held, "pulls_mapped": self.plane.store.mapped}
