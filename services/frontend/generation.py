"""An admitted request from its first token to its end: ordered tokens in, text and a finish out.

A ``Generation`` owns what the request holds at the frontend — its admission slot, its token stream —
and frees both in one idempotent ``close``, whichever way it ends (finished, failed, the client gone,
the response cancelled before it started). ``events`` yields ``TextDelta``s and one ``Finished``; when
the worker producing the tokens is lost, the pipeline resumes the request on other workers and the
client sees one uninterrupted stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.errors import ApiError
from services.frontend.media import DecodedImage
from services.frontend.prompt import Prompt
from services.frontend.stream import TokenStream, WorkerLost
from shared.engine.sampling import SamplingParams
from shared.errors import ServiceError
from shared.messages.stream import TokenEvent


@dataclass
class TextDelta:
    text: str


@dataclass
class Finished:
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens a worker's prefix cache served


@dataclass
class Timing:
    """Wall-clock seconds: TTFT and E2E count from arrival. ``stages``: media (fetch, decode), encode
    (every image), first_token (prefill submitted → first token: prefill queue, prefill, KV hand-off)."""

    arrived: float
    first_token_at: float | None = None
    submitted: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)


class Generation:
    def __init__(self, pipeline, request_id: str, prompt: Prompt, images: list[DecodedImage],
                 sampling: SamplingParams, stop: list[str], stream: TokenStream, slot, timing: Timing):
        self.pipeline = pipeline
        self.request_id = request_id
        self.prompt = prompt
        self.images = images
        self.sampling = sampling
        self.stream = stream
        self.slot = slot  # the admission slot, released by ``close``
        self.timing = timing
        self.detok = IncrementalDetokenizer(pipeline.tokenizer, stop)
        self.generated: list[int] = []
        self.cached_tokens = 0
        self.resumes = 0
        self.outcome = ""  # how it ended: a finish reason, or error_<status>
        self._done = False  # the stream ended normally
        self._cut_short = False  # a stop string ended it while the model was still generating
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    async def events(self) -> AsyncIterator[TextDelta | Finished]:
        try:
            while not self._done:
                try:
                    async for event in self.stream.tokens():
                        for output in self._consume(event):
                            yield output
                        if self._done:
                            return
                except WorkerLost as lost:
                    await self.pipeline.resume(self, str(lost))
        except ServiceError as err:
            self.outcome = f"error_{err.status}"
            raise ApiError(err.status, err.message) from None
        finally:
            self.close()

    def _consume(self, event: TokenEvent) -> list[TextDelta | Finished]:
        if self.timing.first_token_at is None:
            self.cached_tokens = event.cached_tokens
            self.timing.first_token_at = time.time()
            self.timing.stages["first_token"] = self.timing.first_token_at - self.timing.submitted
        self.generated += event.token_ids
        out: list[TextDelta | Finished] = []
        text = self.detok.push(event.token_ids)
        ended = self.detok.stopped or event.finish_reason is not None
        if ended:
            text += self.detok.finish()
        if text:
            out.append(TextDelta(text))
        if ended:
            self._cut_short = self.detok.stopped and event.finish_reason is None
            self._done = True
            self.outcome = "stop" if self.detok.stopped else event.finish_reason
            out.append(Finished(self.outcome, self.prompt_tokens, self.completion_tokens, self.cached_tokens))
        return out

    def close(self, reason: str = "request ended early") -> None:
        """Free the slot and the stream; tell the workers to stop unless they finished (``reason`` says
        why, in the cancel). Idempotent, and synchronous so that a cancelled response (whose cleanup
        cannot await) still runs it whole."""
        if self._closed:
            return
        self._closed = True
        self.slot.release()
        if not self._done or self._cut_short:
            self.pipeline.cancel_soon(self.stream.attempt or self.request_id,
                                      "stop string" if self._cut_short else reason)
        self.pipeline.finished(self)
