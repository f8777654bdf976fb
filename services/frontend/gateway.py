"""The one object every door calls — HTTP, the NATS chat API, durable jobs — so a request is admitted,
answered and ended the same way whichever way it came in.

- ``start(request)``: the model name (404), unknown fields (logged and counted, then ignored), a free
  admission slot (429), then the pipeline; the returned ``Generation`` holds the slot until it closes;
  ``start_text`` does the same for each prompt of a text completion;
- ``complete`` / ``complete_text``: the whole answer;
- ``chunks`` / ``text_chunks``: the stream's chunks (dicts, see ``chat_output.py``); an error after the
  first chunk is raised for the door to frame (an SSE ``error`` event, a NATS error message), never as
  a normal finish;
- ``answer(request)``: start + complete.
Every path ends in ``Generation.close`` (idempotent), which frees the slot and the stream.

Request ids are the frontend's: a client's ``X-Request-Id`` (sanitized, shortened) becomes their
prefix, never the whole id, so ids that reach workers stay unique and well-formed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

from prometheus_client import Counter, Gauge

from services.frontend.chat_output import ChatOutput
from services.frontend.errors import ApiError
from services.frontend.generation import Flush, Generation
from services.frontend.logprobs import TokenText
from services.frontend.options import GenerationOptions
from services.frontend.pipeline import Pipeline
from services.frontend.protocol import ChatCompletion, ChatCompletionRequest
from services.frontend.text_output import TextOutput
from services.frontend.text_protocol import Completion, CompletionRequest
from shared.logging import get_logger

log = get_logger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
MAX_ID_PREFIX = 48


def request_id(hint: str | None = None) -> str:
    """A fresh request id, prefixed with the client's own id when it gave one."""
    prefix = _UNSAFE.sub("", hint or "")[:MAX_ID_PREFIX]
    return f"{prefix}-{uuid.uuid4().hex}" if prefix else uuid.uuid4().hex


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
    def __init__(self, pipeline: Pipeline, admission: Admission, model_name: str, ignored: Counter):
        self.pipeline = pipeline
        self.admission = admission
        self.model_name = model_name
        self.ignored = ignored  # requests that carried fields we ignore
        token_text = TokenText(pipeline.tokenizer)
        self.chat_output = ChatOutput(model_name, token_text)
        self.text_output = TextOutput(model_name, token_text, pipeline.tokenizer)

    def check(self, request: GenerationOptions) -> None:
        if request.model not in (None, "", self.model_name):
            raise ApiError(404, f"model {request.model!r} is not served here; this server serves "
                                f"{self.model_name!r}", "model")
        if request.ignored_fields:
            self.ignored.inc()
            log.warning("request.ignored_fields", fields=request.ignored_fields[:16])

    async def start(self, request: ChatCompletionRequest, hint: str | None = None) -> Generation:
        self.check(request)
        return await self._start(request, request_id(hint))

    async def start_text(self, request: CompletionRequest, hint: str | None = None) -> list[Generation]:
        self.check(request)
        if request.echo and request.logprobs is not None:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        base = request_id(hint)
        prompts = request.prompts()
        generations: list[Generation] = []
        try:
            for index in range(len(prompts)):
                generations.append(await self._start(request, base if len(prompts) == 1 else f"{base}-{index}", index))
        except BaseException:
            for generation in generations:
                generation.close()
            raise
        return generations

    async def _start(self, request, rid: str, prompt_index: int = 0) -> Generation:
        slot = self.admission.take()
        try:
            return await self.pipeline.start(request, slot, rid, prompt_index)
        except BaseException:
            slot.release()
            raise

    async def answer(self, request: ChatCompletionRequest) -> ChatCompletion:
        return await self.complete(await self.start(request))

    async def complete(self, generation: Generation) -> ChatCompletion:
        return await self.chat_output.complete(generation, generation.request)

    def chunks(self, generation: Generation) -> AsyncIterator[dict | Flush]:
        """The answer's chunks, with ``FLUSH`` wherever none is at hand (``Generation.events``)."""
        return self.chat_output.chunks(generation, generation.request)

    async def complete_text(self, generations: list[Generation]) -> Completion:
        return await self.text_output.complete(generations, generations[0].request)

    def text_chunks(self, generations: list[Generation]) -> AsyncIterator[dict | Flush]:
        return self.text_output.chunks(generations, generations[0].request)
