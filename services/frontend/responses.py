"""OpenAI answers built from a generation, whichever way the request came in (HTTP, NATS, a durable job).

Every door runs the same steps: ``parse_request`` (400/413, the messages HTTP gives), ``admit`` (404,
429, then the pipeline's own errors), then ``complete`` for one ChatCompletion or ``chunks`` for the
stream, and finally ``frontend.admission.release()``. Only the framing differs per door.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from pydantic import ValidationError

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
    Usage,
)


def parse_request(data: bytes, limit: int) -> ChatCompletionRequest:
    """A chat request from its JSON body, validated exactly as the HTTP route validates it."""
    if len(data) > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes")
    try:
        return ChatCompletionRequest.model_validate_json(data)
    except ValidationError as err:
        raise invalid_request(err.errors()) from None


def invalid_request(errors: list[dict]) -> ApiError:
    """A 400 naming the first problems (pydantic error dicts; FastAPI's carry a leading "body")."""
    problems = []
    for e in errors[:5]:
        where = ".".join(_location(e))
        problems.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    first = _location(errors[0]) if errors else []
    return ApiError(400, "invalid request: " + "; ".join(problems), first[0] if first else None)


def _location(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body"]


async def admit(frontend, request: ChatCompletionRequest) -> Generation:
    """Check the model name and capacity, then start the generation.

    On success the caller holds an admission slot and must ``frontend.admission.release()`` once the
    generation is done with (the HTTP stream releases it only when the last event was sent).
    """
    if request.model not in (None, "", frontend.model_name):
        raise ApiError(404, f"model {request.model!r} is not served here; this server serves "
                            f"{frontend.model_name!r}", "model")
    if not frontend.admission.try_acquire():
        raise ApiError(429, "the server is at capacity; retry shortly")
    try:
        return await frontend.pipeline.start(request)
    except BaseException:
        frontend.admission.release()
        raise


async def answer(frontend, request: ChatCompletionRequest) -> ChatCompletion:
    """admit → complete → release: the whole non-streaming answer (NATS request, durable job)."""
    generation = await admit(frontend, request)
    try:
        return await complete(frontend, generation)
    finally:
        frontend.admission.release()


async def complete(frontend, generation: Generation) -> ChatCompletion:
    text, finish = await _collect(generation)
    frontend.metrics.observe(generation, finish.reason)
    return ChatCompletion(
        id=_completion_id(generation), model=frontend.model_name, created=int(generation.created),
        choices=[Choice(message=AssistantMessage(content=text), finish_reason=finish.reason)],
        usage=usage(finish),
    )


async def _collect(generation: Generation) -> tuple[str, Finished]:
    parts: list[str] = []
    async with aclosing(generation.events()) as events:  # closed now, not when collected: the cancel goes out
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            else:
                return "".join(parts), event
    raise ApiError(502, "the token stream ended without a finish")


async def chunks(frontend, generation: Generation, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk, content chunks, finish chunk, [usage chunk].

    An error after the first chunk is counted and raised: the caller frames it for its transport
    (an SSE ``error`` event, a NATS error message), never as a normal finish.
    """
    def chunk(delta: Delta, finish: str | None = None, use: Usage | None = None,
              choices: bool = True) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=_completion_id(generation), created=int(generation.created),
                                   model=frontend.model_name, usage=use,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish)] if choices else [])

    try:
        yield chunk(Delta(role="assistant", content=""))
        async with aclosing(generation.events()) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    yield chunk(Delta(content=event.text))
                    continue
                yield chunk(Delta(), finish=event.reason)
                if include_usage:
                    yield chunk(Delta(), use=usage(event), choices=False)
                frontend.metrics.observe(generation, event.reason)
    except ApiError as err:
        frontend.metrics.failed(err.status)
        raise


def chunk_json(chunk: ChatCompletionChunk) -> str:
    """The wire form of a chunk: unset fields left out, except in the usage chunk (as OpenAI sends it)."""
    return chunk.model_dump_json(exclude_none=chunk.usage is None)


def include_usage(request: ChatCompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def usage(finish: Finished) -> Usage:
    return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                 total_tokens=finish.prompt_tokens + finish.completion_tokens)


def _completion_id(generation: Generation) -> str:
    return f"chatcmpl-{generation.request_id}"
