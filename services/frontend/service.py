"""The frontend: the OpenAI-compatible HTTP gateway (and the NATS chat API) in front of the stack."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from services.frontend.app import create_app
from services.frontend.jobs import JobWorker
from services.frontend.media import MediaLoader
from services.frontend.metrics import Admission, FrontendMetrics
from services.frontend.nats_api import ChatEndpoint
from services.frontend.pipeline import ChatPipeline
from services.frontend.prompt import PromptBuilder
from services.frontend.liveness import LiveWorkers
from services.frontend.routing import EncoderDirectory
from services.frontend.settings import FrontendSettings
from shared import __version__
from shared.bus import gather_replies
from shared.dataplane.plane import DataPlane
from shared.logging import get_logger
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry
from shared.model.processor import load_tokenizer
from shared.service import ServiceBase

log = get_logger(__name__)


class _Server(uvicorn.Server):
    def capture_signals(self):  # the service owns SIGTERM/SIGINT and drains in order
        return contextlib.nullcontext()


class FrontendService(ServiceBase):
    kind = "frontend"
    description = "OpenAI-compatible gateway: renders, tokenizes, fetches media, fans out encode jobs"
    version = __version__

    def __init__(self, settings: FrontendSettings):
        super().__init__(settings)
        self.socket = socket.create_server((settings.host, settings.port), reuse_port=False)
        self.port = self.socket.getsockname()[1]
        self.plane = DataPlane.from_settings(settings)
        self.executor = ThreadPoolExecutor(settings.media_threads, thread_name_prefix="media")
        self.metrics = FrontendMetrics()
        self.admission = Admission(settings.max_concurrent_requests, self.metrics.in_flight)
        self.started = int(time.time())
        self._server: _Server | None = None
        self._server_task: asyncio.Task | None = None
        self.chat_endpoint = ChatEndpoint(self)
        self.jobs = JobWorker(self, settings)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "http": f"{self.settings.host}:{self.port}"}

    async def setup(self, nc) -> None:
        s = self.settings
        path = s.model_path()
        config = ModelConfig.from_checkpoint(path)
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        self.model_name = s.served_model_name or path.name
        self.max_model_len = min(s.max_model_len or config.text.max_position_embeddings,
                                 config.text.max_position_embeddings)
        await self.plane.start()
        self.media = MediaLoader(s, self.executor)
        builder = PromptBuilder(tokenizer, config, ImageGeometry.from_checkpoint(path))
        self.encoders = EncoderDirectory(nc, self.subjects)
        self.encoders.start()
        self.workers = LiveWorkers(nc, self.subjects)
        self.workers.start()
        self.pipeline = ChatPipeline(nc, self.subjects, self.plane, self.media, builder, tokenizer, s,
                                     self.max_model_len, self.encoders, self.workers)
        self.app = create_app(self)
        config_http = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                     timeout_graceful_shutdown=s.drain_seconds)
        self._server = _Server(config_http)
        self._server_task = asyncio.create_task(self._server._serve(sockets=[self.socket]), name="http")
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises why the server could not start
            await asyncio.sleep(0.01)
        log.info("frontend.listening", url=f"http://{s.host}:{self.port}", model=self.model_name)

    async def serve(self, service) -> None:
        """The NATS doors, beside HTTP: ``<prefix>.chat`` requests and, with JetStream, durable jobs."""
        await self.chat_endpoint.add_to(service)
        if self.settings.jobs:
            self.jobs.start(self.nc)

    async def refresh_metrics(self) -> None:
        if self.nc is not None and self.nc.is_connected:
            self.metrics.record_service_stats(await gather_replies(self.nc, "$SRV.STATS", wait=0.2))

    async def drain(self) -> None:
        if self._server is not None:
            self._server.should_exit = True  # stop accepting; finish in-flight HTTP requests
        http = self._server_task if self._server_task is not None else asyncio.sleep(0)
        await asyncio.gather(http, self.chat_endpoint.drain(), self.jobs.drain(), return_exceptions=True)

    async def close(self) -> None:
        await self.jobs.stop()
        await self.encoders.stop()
        await self.workers.stop()
        await self.media.close()
        await self.plane.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {"instance": self.instance, "in_flight": self.admission.count,
                "images_encoded": self.pipeline.encoded_images if hasattr(self, "pipeline") else 0,
                "nats_chat_errors": self.chat_endpoint.errors, **self.jobs.stats()}
