"""The OpenAI-compatible HTTP API: /v1/chat/completions and /v1/completions (streaming and not),
/v1/models[/{id}], vLLM's /tokenize, /detokenize and /version, /health, /metrics.

``/health`` is 503, with the reason, while the stack lacks a worker of a kind this frontend needs
(``workers.py``); ``/v1/models`` is 503 until the stack has first listed what a text request needs (as
vLLM's API answers only once it can serve), and answers from then on: a worker that goes missing later
is waited for by each request.

A client's ``X-Request-Id`` is echoed on the response and becomes the request id's prefix; without
one, the response carries the id the server chose.

Every error is an OpenAI error body with the right status: a body that is not JSON, not UTF-8 or nested
too deeply is a 400 that says so; an unknown path a 404; anything unexpected a 500 "internal error"
(the details go to the log).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.frontend.errors import ApiError
from services.frontend.gateway import Gateway
from services.frontend.generation import FLUSH, Generation
from services.frontend.protocol import ChatCompletion, ChatCompletionRequest, ErrorResponse, ModelCard, ModelList
from services.frontend.responses import chunk_json, invalid_request
from services.frontend.text_protocol import (
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.frontend.tokenization import detokenize, tokenize
from shared import __version__
from shared.aio import cancel_until_done
from shared.logging import get_logger

log = get_logger(__name__)

JOINED_EVENTS = 64  # server-sent events one write carries at most (``_sse``)
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 429, 503, 504)}


@dataclass(frozen=True)
class ServedModel:
    name: str
    created: int
    max_model_len: int
    root: str = ""  # the checkpoint it was loaded from


def create_app(gateway: Gateway, model: ServedModel, unready: Callable[[], str | None],
               unopened: Callable[[], str | None], metrics: Callable[[], Awaitable[bytes]],
               max_body_bytes: int) -> FastAPI:
    """``unready``: why the frontend cannot serve every request now; ``unopened``: why the model is not
    served yet (None: it is)."""
    app = FastAPI(title="epd", version=__version__, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        if (reason := unready()) is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    card = ModelCard(id=model.name, created=model.created, root=model.root, max_model_len=model.max_model_len)

    def check_open() -> None:
        if (reason := unopened()) is not None:
            raise ApiError(503, f"the model is not served yet: {reason}")

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        check_open()
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def one_model(model_id: str) -> ModelCard:
        check_open()
        if model_id != model.name:
            raise ApiError(404, f"model {model_id!r} is not served here", "model")
        return card

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request):
        hint = request.headers.get("x-request-id")
        generation = await _unless_disconnected(gateway.start(body, hint), request)
        headers = {"X-Request-Id": hint or generation.request_id}
        if body.stream:
            return GenerationStream([generation], _sse(gateway.chunks(generation)), headers)
        try:
            return _json(await _unless_disconnected(gateway.complete(generation), request), headers)
        finally:
            generation.close()

    @app.post("/v1/completions", response_model=Completion, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        hint = request.headers.get("x-request-id")
        generations = await _unless_disconnected(gateway.start_text(body, hint), request)
        headers = {"X-Request-Id": hint or generations[0].request_id}
        if body.stream:
            return GenerationStream(generations, _sse(gateway.text_chunks(generations)), headers)
        try:
            return _json(await _unless_disconnected(gateway.complete_text(generations), request), headers)
        finally:
            for generation in generations:
                generation.close()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        gateway.check(body)
        return await tokenize(gateway.pipeline, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        gateway.check(body)
        return await detokenize(gateway.pipeline, body)

    return app


def _json(answer, headers: dict) -> JSONResponse:
    return JSONResponse(answer.model_dump(mode="json"), headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        if errors and errors[0].get("type") == "json_invalid":
            problem = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
            return await _api_error(request, ApiError(400, f"request body is not valid JSON: {problem}"))
        return await _api_error(request, invalid_request(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, ApiError(err.status_code, _http_message(err)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("http.unhandled", error=type(err).__name__)
        return await _api_error(request, ApiError(500, "internal error"))


def _http_message(err: StarletteHTTPException) -> str:
    """What went wrong, in words a client can act on (FastAPI's own are vague)."""
    cause = err.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "request body JSON is nested too deeply"
    if isinstance(cause, ValueError):
        return "request body is not valid JSON"
    if err.status_code == 404:
        return "no such endpoint: see /v1/models, /v1/chat/completions and /v1/completions"
    if err.status_code == 405:
        return "method not allowed on this endpoint"
    return str(err.detail)


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


class GenerationStream(StreamingResponse):
    """The SSE response of generations, which it closes however the response ends — also when the
    server cancels it before the body generator ever ran (a generator's own ``finally`` would not run)."""

    def __init__(self, generations: list[Generation], body: AsyncIterator[str], headers: dict):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.close()


async def _unless_disconnected(work, request: Request):
    """Await ``work`` (admission: encoding, prefill; or collecting a whole answer), abandoning it if the
    client hangs up meanwhile."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            # until it ends: one cancel can be lost (Python 3.11's wait_for, as under nats-py's next_msg,
            # returns a result that meets the cancel and drops the cancel), and the answer would be generated on
            if not await cancel_until_done(task, timeout=10.0, every=0.05):
                log.warning("request.work_would_not_end")
            raise ApiError(499, "client disconnected")
        return task.result()
    finally:
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _sse(chunks) -> AsyncIterator[str]:
    """Server-sent events: the chunks, then [DONE]; an error after streaming began is an ``error`` event.
    Events at hand go out in one write: each chunk's event waits for the next one's until the chunks say
    ``FLUSH`` (nothing more has arrived: they are about to wait for a token), up to ``JOINED_EVENTS`` a
    write. One write per token was ~40 % of the frontend's CPU per streamed token, so a frontend that
    falls behind its streams now catches up with fewer writes; one that keeps up writes each token as it
    comes, as before."""
    parts: list[str] = []
    try:
        async with aclosing(chunks) as stream:
            async for chunk in stream:
                if chunk is not FLUSH:
                    parts.append(f"data: {chunk_json(chunk)}\n\n")
                if parts and (chunk is FLUSH or len(parts) >= JOINED_EVENTS):
                    yield "".join(parts)
                    parts = []
        parts.append("data: [DONE]\n\n")
    except ApiError as err:
        parts += [f"data: {json.dumps(err.body())}\n\n", "data: [DONE]\n\n"]
    yield "".join(parts)
