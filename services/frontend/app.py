"""The OpenAI-compatible HTTP API: /v1/chat/completions (streaming and not), /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.frontend.errors import ApiError
from services.frontend.pipeline import Generation
from services.frontend.protocol import ChatCompletion, ChatCompletionRequest, ErrorResponse, ModelCard, ModelList
from services.frontend.responses import admit, chunk_json, chunks, complete, include_usage, invalid_request
from shared.logging import get_logger

log = get_logger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 413, 429, 503, 504)}


def create_app(frontend) -> FastAPI:
    """``frontend`` is the running FrontendService (pipeline, admission, metrics, model name)."""
    app = FastAPI(title="epd", version=frontend.version, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        return await _api_error(_request, invalid_request(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return await _api_error(_request, ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        log.exception("http.unhandled", error=type(err).__name__)
        return await _api_error(_request, ApiError(500, "internal error"))

    app.add_middleware(BodyLimit, limit=frontend.settings.max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = frontend.nc is not None and frontend.nc.is_connected
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await frontend.refresh_metrics()
        return Response(generate_latest(frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=frontend.model_name, created=frontend.started, max_model_len=frontend.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request):
        generation = await _unless_disconnected(admit(frontend, body), request)
        if body.stream:
            stream = _sse(frontend, generation, include_usage(body))
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await _unless_disconnected(complete(frontend, generation), request)
        finally:
            frontend.admission.release()

    return app


class BodyLimit:
    """Refuses bodies over ``limit`` bytes: by Content-Length up front, and while a body without one
    streams in (it is read here, then handed on whole). Plain ASGI on purpose: an
    ``@app.middleware("http")`` wrapper would hide client disconnects from the endpoints, which cancel
    abandoned requests; after the body, ``receive`` is the server's own again."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = JSONResponse(ApiError(413, f"request body exceeds {self.limit} bytes").body(), status_code=413)
        await response(scope, receive, send)


async def _unless_disconnected(work, request: Request):
    """Await ``work`` (admission: encoding, prefill; or collecting a whole answer), abandoning it if the
    client hangs up meanwhile."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(499, "client disconnected")
        return task.result()
    finally:
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _sse(frontend, generation: Generation, usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the chunks, then [DONE]; an error after streaming began is an ``error`` event."""
    try:
        async with aclosing(chunks(frontend, generation, usage)) as stream:
            async for chunk in stream:
                yield f"data: {chunk_json(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except ApiError as err:
        yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        frontend.admission.release()
