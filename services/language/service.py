"""The joined language worker (E/PD): language model only, fed by the encoder tier; it prefills a prompt
and keeps decoding it in the same engine, streaming every token — no KV hand-off, no third process on
the GPU. It answers the prefill subjects, so the frontend treats it as a prefill worker that never hands
off."""

from __future__ import annotations

import time

from services.encoder.metrics import StageTimes
from services.language.intake import PromptIntake, intake_endpoints
from services.language.settings import LanguageSettings
from services.language.worker import LanguageWorker, Tracked
from shared.bus.service_api import Endpoint, Request
from shared.dataplane.plane import DataPlane
from shared.messages import pack, unpack
from shared.messages.prefill import PrefillAccepted, PrefillJob
from shared.service import Service


class LanguageService(Service):
    kind = "language"
    description = "Language model, prefill and decode in one engine: prompts + image embeddings in, tokens out"
    role = "both"

    def __init__(self, settings: LanguageSettings):
        super().__init__(settings)
        self.plane = DataPlane.from_settings(settings)
        self.worker = LanguageWorker(settings, self.role, self.subjects, self.instance)
        self.intake: PromptIntake | None = None
        # a job in → its prompt in the engine (pulls, checks, the step); of it, the checks and pulls, and
        # from there to the engine thread taking the prompt (the step it was running then)
        self.times = StageTimes(("prompt_intake", "prompt_pull", "prompt_handoff"))

    async def setup(self) -> None:
        await self.open_plane()
        await self.start_worker()
        engine = self.worker.engine
        self.intake = PromptIntake(self.worker.config, self.plane, engine.runner.device, engine.max_model_len,
                                   engine.blocks)

    async def start_worker(self) -> None:
        await self.worker.start(self.nc, self.resources)

    def endpoints(self) -> list[Endpoint]:
        return intake_endpoints(self.subjects, self.instance, self.handle_prompt, self.settings.max_concurrent_jobs,
                                self.intake)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), **(self.intake.metadata() if self.intake else {})}

    async def handle_prompt(self, request: Request) -> bytes:
        job = unpack(PrefillJob, request.data)
        self.worker.refuse_cancelled(job.request_id)
        await self.admit(job, Tracked(job.stream, self.instance, choices=job.sampling.n))
        return pack(PrefillAccepted(prefill_id=self.instance))

    async def admit(self, job: PrefillJob, tracked: Tracked) -> None:
        """The job's prompt into the engine (its embeddings pulled first)."""
        started = time.monotonic()
        seq = await self.intake.sequence(job)
        pulled = time.monotonic()
        self.times.add("prompt_pull", pulled - started)
        self.worker.refuse_cancelled(job.request_id)  # cancelled while its embeddings came
        taken = await self.worker.add_prompt(seq, tracked)
        self.times.add("prompt_handoff", taken - pulled)
        self.times.add("prompt_intake", time.monotonic() - started)

    async def drain(self) -> None:
        await self.registration.drain()
        await self.worker.drained()

    def stats(self) -> dict:
        intake = self.intake
        return {"instance": self.instance, **self.worker.stats(), **self.times.stats(),
                **(intake.stats() if intake else {}),
                "prompts_in_flight": sum(e.in_flight for e in self.registration.endpoints if e.name.startswith("prefill"))
                if self.registration else 0,
                "errors": sum(e.errors for e in self.registration.endpoints) if self.registration else 0}
