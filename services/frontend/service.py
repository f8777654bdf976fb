"""The frontend: the OpenAI-compatible HTTP gateway, and the NATS chat API and durable jobs beside it.
It composes the parts and runs their lifecycle; the request path itself starts in ``gateway.py``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn
from prometheus_client import generate_latest

from services.frontend.app import ServedModel, create_app
from services.frontend.gateway import Admission, Gateway
from services.frontend.jobs import JobWorker
from services.frontend.media import MediaLoader
from services.frontend.metrics import FrontendMetrics
from services.frontend.nats_api import chat_endpoint
from services.frontend.pipeline import Pipeline
from services.frontend.prompt import PromptBuilder
from services.frontend.sampling import GenerationDefaults, SamplingBuilder
from services.frontend.seen_images import SeenImages
from services.frontend.settings import MEDIA_THREADS, FrontendSettings
from shared.bus.directory import Directory
from shared.bus.service_api import Endpoint
from shared.dataplane.plane import DataPlane
from shared.engine.grammar import Grammars
from shared.logging import get_logger
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry
from shared.model.tokenizer import load_tokenizer
from shared.model.video import VideoGeometry
from shared.service import Service

log = get_logger(__name__)
WORKERS_POLL_SECONDS = 0.2  # between listings while the port waits for the stack's workers


class _Server(uvicorn.Server):
    def capture_signals(self):  # the service owns SIGTERM/SIGINT and drains in order
        return contextlib.nullcontext()


class FrontendService(Service):
    kind = "frontend"
    description = "OpenAI-compatible gateway: renders, tokenizes, fetches media, fans out encode jobs"
    uses_torch = False

    def __init__(self, settings: FrontendSettings):
        super().__init__(settings)
        self.socket = bound_socket(settings.host, settings.port)
        self.port = self.socket.getsockname()[1]
        self.plane = DataPlane.from_settings(settings)
        self.metrics = FrontendMetrics()
        self.admission = Admission(settings.max_concurrent_requests, self.metrics.in_flight)
        self.directory: Directory | None = None
        self.pipeline: Pipeline | None = None
        self.gateway: Gateway | None = None
        self.jobs: JobWorker | None = None
        self._server: _Server | None = None
        self._server_task: asyncio.Task | None = None
        self._opened = False  # the stack has listed what a text request needs at least once
        self._listed = False  # every worker --wait-for-workers names was listed before the port opened

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "http": f"{self.settings.host}:{self.port}"}

    async def setup(self) -> None:
        s, nc = self.settings, self.nc
        path = s.model_path()
        config = ModelConfig.from_checkpoint(path)
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        model = ServedModel(s.served_model_name or served_name(s.model, path), int(time.time()),
                            min(s.max_model_len or config.text.max_position_embeddings,
                                config.text.max_position_embeddings), root=path.name)
        self.metrics.model_name = model.name
        grammars = await asyncio.to_thread(Grammars, tokenizer, config.text.vocab_size, config.eos_token_ids)
        sampling = SamplingBuilder(GenerationDefaults.from_checkpoint(path), model.max_model_len, s.max_output_tokens,
                                   config.text.vocab_size, grammars)
        await self.open_plane()
        self.directory = Directory(nc, self.subjects.prefix)
        self.directory.start()
        self.resources.push_async_callback(self.directory.stop)
        # Listed means ready: the first listing is in before this frontend registers (under ``epd up`` the port
        # opens once its workers are listed, so it serves from its first request); bounded, discovery is not a must.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.directory.refreshed.wait(), 5.0)
        executor = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="media")
        self.resources.callback(executor.shutdown, wait=False, cancel_futures=True)
        # images are recognised by their bytes only where they may be left out of a prompt
        media = MediaLoader(s, executor, VideoGeometry.from_checkpoint(path, config.family),
                            SeenImages() if s.prefix_routing else None)
        self.resources.push_async_callback(media.close)
        builder = PromptBuilder(tokenizer, config, ImageGeometry.from_checkpoint(path), media.video_geometry)
        self.pipeline = Pipeline(nc, self.subjects, self.plane, self.directory, media, builder, tokenizer, s,
                                 sampling, self.metrics.observe)
        self.resources.push_async_callback(self.pipeline.chores.drain)
        self.resources.callback(self.pipeline.prompts.shutdown, wait=False, cancel_futures=True)
        self.gateway = Gateway(self.pipeline, self.admission, model.name, self.metrics.ignored_fields)
        self.jobs = JobWorker(self.gateway, s)
        self.resources.push_async_callback(self.jobs.stop)
        if s.wait_for_workers:
            await self._wait_for_workers(s.wait_for_workers)
            self._listed = True  # a later listing that misses a busy worker's answer does not close /v1/models
        await self._serve_http(create_app(self.gateway, model, self._unready, self._unopened, self._metrics,
                                          s.max_body_bytes))
        log.info("frontend.listening", url=f"http://{s.host}:{self.port}", model=model.name)

    async def _wait_for_workers(self, wanted: dict[str, int]) -> None:
        """Until the stack lists ``wanted`` (kind → count): everything else is set up meanwhile, so the port
        opens as soon as the workers can serve."""
        def enough(seen: dict[str, int]) -> bool:
            return all(seen.get(kind, 0) >= n for kind, n in wanted.items())

        log.info("frontend.waiting_for_workers", **wanted)
        while not enough(self.directory.counts()):
            if self.nc.is_connected:
                await self.directory.refresh(enough=enough)
            if not enough(self.directory.counts()):
                await asyncio.sleep(WORKERS_POLL_SECONDS)

    async def _serve_http(self, app) -> None:
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=self.settings.drain_seconds)
        self._server = _Server(config)
        self._server_task = asyncio.create_task(self._server._serve(sockets=[self.socket]), name="http")
        self.resources.push_async_callback(self._stop_http)
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises why the server could not start
            await asyncio.sleep(0.01)

    def endpoints(self) -> list[Endpoint]:
        """The NATS door beside HTTP: ``<prefix>.chat`` requests."""
        return [chat_endpoint(self.gateway, self.subjects, self.settings.max_body_bytes,
                              2 * self.settings.max_concurrent_requests)]

    async def on_ready(self) -> None:
        """The third door: durable jobs from JetStream."""
        if self.settings.jobs:
            self.jobs.start(self.nc)

    def _unready(self) -> str | None:
        """Why ``/health`` is 503: this frontend is not registered or is off the bus, or its stack lacks a
        worker of a kind it needs."""
        if not self.ready:
            return f"the frontend is {self.readiness()}"
        return self.pipeline.workers.missing()

    def _unopened(self) -> str | None:
        """Why ``/v1/models`` is 503: until the stack first lists what a text request needs."""
        if not self._opened:
            if not self.ready:
                return f"the frontend is {self.readiness()}"
            if not self._listed and (reason := self.pipeline.workers.missing_for_text()) is not None:
                return reason
            self._opened = True
        return None

    async def _metrics(self) -> bytes:
        if self.nc.is_connected:
            await self.directory.refresh()  # what the services report now, not up to a second ago
        self.metrics.record_services(self.directory.raw, self.directory.counts())
        return generate_latest(self.metrics.registry)

    async def drain(self) -> None:
        self._server.should_exit = True  # stop accepting; finish in-flight HTTP requests
        await asyncio.gather(self._server_task, self.registration.drain(), self.jobs.drain(),
                             return_exceptions=True)

    async def _stop_http(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._server_task, return_exceptions=True)

    def stats(self) -> dict:
        return {"instance": self.instance, "in_flight": self.admission.count, "cpu_seconds": time.process_time(),
                **(self.pipeline.stats() if self.pipeline else {}),
                "nats_chat_errors": sum(e.errors for e in self.registration.endpoints) if self.registration else 0,
                **(self.pipeline.workers.stats() if self.pipeline else {}),
                **(self.jobs.stats() if self.jobs else {})}


def bound_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, bound (ours from the start, its number known) but not listening: connections are
    refused, not queued, until the server starts (asyncio's server calls ``listen``)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def served_name(model: str, path: Path) -> str:
    """The model's name by default: ``--model`` as the user gave it — a preset's name, a checkpoint
    directory's name — or the built-in model's directory name."""
    return Path(model).name if model else path.name
