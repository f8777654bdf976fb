"""The OpenAI-compatible HTTP API: /v1/chat/completions (streaming and not), /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.frontend.errors import ApiError
from services.frontend.pipeline import Finished, Generation, TextDelta
from services.frontend.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
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
        return await _api_error(_request, ApiError(400, _describe(err), _param(err)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return await _api_error(_request, ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        log.exception("http.unhandled", error=type(err).__name__)
        return await _api_error(_request, ApiError(500, "internal error"))

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        declared = request.headers.get("content-length")
        limit = frontend.settings.max_body_bytes
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return JSONResponse(ApiError(413, f"request body exceeds {limit} bytes").body(), status_code=413)
        return await call_next(request)

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
        if body.model not in (None, "", frontend.model_name):
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{frontend.model_name!r}", "model")
        if not frontend.admission.try_acquire():
            raise ApiError(429, "the server is at capacity; retry shortly")
        try:
            generation = await frontend.pipeline.start(body)
        except BaseException:
            frontend.admission.release()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _sse(frontend, generation, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await _complete(frontend, generation, request)
        finally:
            frontend.admission.release()

    return app


async def _complete(frontend, generation: Generation, request: Request) -> ChatCompletion:
    """Collect the whole answer; a client that disconnects meanwhile cancels the request."""
    watcher = asyncio.create_task(_wait_disconnect(request))
    collector = asyncio.create_task(_collect(generation))
    try:
        done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
        if collector not in done:
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
            raise ApiError(499, "client disconnected")
        text, finish = collector.result()
    finally:
        watcher.cancel()
    frontend.metrics.observe(generation, finish.reason)
    return ChatCompletion(
        id=f"chatcmpl-{generation.request_id}", model=frontend.model_name, created=int(generation.created),
        choices=[Choice(message=AssistantMessage(content=text), finish_reason=finish.reason)],
        usage=_usage(finish),
    )


async def _collect(generation: Generation) -> tuple[str, Finished]:
    parts: list[str] = []
    async for event in generation.events():
        if isinstance(event, TextDelta):
            parts.append(event.text)
        else:
            return "".join(parts), event
    raise ApiError(502, "the token stream ended without a finish")


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _sse(frontend, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: role chunk, content chunks, finish chunk, [usage chunk], [DONE].

    An error after streaming began is sent as an ``error`` event (never as a normal finish).
    """
    created = int(generation.created)
    cid = f"chatcmpl-{generation.request_id}"

    def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None, choices: bool = True) -> str:
        body = ChatCompletionChunk(id=cid, created=created, model=frontend.model_name, usage=usage,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish)] if choices else [])
        return f"data: {body.model_dump_json(exclude_none=usage is None)}\n\n"

    try:
        yield chunk(Delta(role="assistant", content=""))
        async for event in generation.events():
            if isinstance(event, TextDelta):
                yield chunk(Delta(content=event.text))
                continue
            yield chunk(Delta(), finish=event.reason)
            if include_usage:
                yield chunk(Delta(), usage=_usage(event), choices=False)
            frontend.metrics.observe(generation, event.reason)
        yield "data: [DONE]\n\n"
    except ApiError as err:
        frontend.metrics.failed(err.status)
        yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        frontend.admission.release()


def _usage(finish: Finished) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens)


def _describe(err: RequestValidationError) -> str:
    problems = []
    for e in err.errors()[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        problems.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    return "invalid request: " + "; ".join(problems)


def _param(err: RequestValidationError) -> str | None:
    errors = err.errors()
    if not errors:
        return None
    loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    return loc[0] if loc else None
