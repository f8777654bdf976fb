"""The one object every door calls — HTTP, the NATS chat API, durable jobs — so a request is admitted,
answered and ended the same way whichever way it came in.

- ``start(request)``: the model name (404), a free admission slot (429), then the pipeline; the
  returned ``Generation`` holds the slot until it closes;
- ``complete(generation)``: the whole ChatCompletion;
- ``chunks(generation, usage)``: the ChatCompletionChunks (role, content…, finish, [usage]); an error
  after the first chunk is raised for the door to frame (an SSE ``error`` event, a NATS error message),
  never as a normal finish;
- ``answer(request)``: start + complete.
Every path ends in ``Generation.close`` (idempotent), which frees the slot and the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from prometheus_client import Gauge

from services.frontend.errors import ApiError
from services.frontend.generation import Finished, Generation, TextDelta
from services.frontend.pipeline import Pipeline
from services.frontend.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
)
from services.frontend.responses import usage


class Admission:
    """Requests in flight, bounded: a full frontend answers 429 at once instead of queueing."""

    def __init__(self, limit: int, gauge: Gauge):
        self.limit = limit
        self.count = 0
        self.gauge = gauge

    def take(self) -> "Slot":
        if self.count >= self.limit:
            raise ApiError(429, "the server is at capacity; retry shortly")
        self.count += 1
        self.gauge.set(self.count)
        return Slot(self)


class Slot:
    def __init__(self, admission: Admission):
        self._admission = admission

    def release(self) -> None:
        """Idempotent: only the first call gives the place back."""
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.count -= 1
            admission.gauge.set(admission.count)


class Gateway:
    def __init__(self, pipeline: Pipeline, admission: Admission, model_name: str):
        self.pipeline = pipeline
        self.admission = admission
        self.model_name = model_name

    async def start(self, request: ChatCompletionRequest) -> Generation:
        if request.model not in (None, "", self.model_name):
            raise ApiError(404, f"model {request.model!r} is not served here; this server serves "
                                f"{self.model_name!r}", "model")
        slot = self.admission.take()
        try:
            return await self.pipeline.start(request, slot)
        except BaseException:
            slot.release()
            raise

    async def answer(self, request: ChatCompletionRequest) -> ChatCompletion:
        return await self.complete(await self.start(request))

    async def complete(self, generation: Generation) -> ChatCompletion:
        parts: list[str] = []
        finish: Finished | None = None
        async with aclosing(generation.events()) as events:  # closed now, not when collected: the cancel goes out
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                else:
                    finish = event
        if finish is None:
            raise ApiError(502, "the token stream ended without a finish")
        return ChatCompletion(
            id=_completion_id(generation), model=self.model_name, created=int(generation.timing.arrived),
            choices=[Choice(message=AssistantMessage(content="".join(parts)), finish_reason=finish.reason)],
            usage=usage(finish),
        )

    async def chunks(self, generation: Generation, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(delta: Delta, finish: str | None = None, use=None, choices: bool = True) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=_completion_id(generation), created=int(generation.timing.arrived),
                                       model=self.model_name, usage=use,
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
        finally:
            generation.close()  # also when the consumer stops early


def _completion_id(generation: Generation) -> str:
    return f"chatcmpl-{generation.request_id}"
