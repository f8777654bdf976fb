"""An admitted request from its first token to its end: ordered tokens in, text and finishes out.

A ``Generation`` owns what the request holds at the frontend — its admission slot, its token stream —
and frees both in one idempotent ``close``, whichever way it ends (finished, failed, the client gone,
the response cancelled before it started). ``events`` yields ``TextDelta``s and one ``Finished`` per
choice; when the worker producing the tokens is lost, the pipeline resumes the request on other
workers and the client sees one uninterrupted stream.

The chunk rule: a ``TextDelta`` is yielded for each token event whose text can be released; a token
whose text cannot be yet (an incomplete UTF-8 character, or text that may begin a stop string) is
carried — its id and logprobs — into the next delta. So without stop strings a stream has one delta per
token, except where a character spans tokens.
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
from shared.errors import ServiceError
from shared.messages.sampling import SamplingParams
from shared.messages.stream import TokenEvent, TokenLogprob


@dataclass
class TextDelta:
    choice: int
    text: str
    token_ids: list[int]  # the tokens this text completes (carried ones first)
    logprobs: list[TokenLogprob] | None  # one per token id, when asked for


@dataclass
class Finished:
    choice: int
    reason: str
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class Flush:
    """What ``Generation.events(flushes=True)`` yields before it waits for a token: what a streaming
    response holds can go out now (``services.frontend.app``), nothing more is at hand."""


FLUSH = Flush()


@dataclass
class Timing:
    """Wall-clock seconds: TTFT and E2E count from arrival. ``stages``: media (fetch, decode), encode
    (every image, through the encoder subjects), first_token (prefill submitted → first token: prefill
    queue, prefill, KV hand-off; for a worker that encodes in place, the images' encoding too).
    ``token_times``: when each token event of choice 0 arrived (inter-token latency)."""

    arrived: float
    first_token_at: float | None = None
    submitted: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)


@dataclass
class OutputOptions:
    """How the frontend turns tokens into text."""

    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop: bool = False


class ChoiceState:
    def __init__(self, index: int, tokenizer, options: OutputOptions, sampling: SamplingParams):
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, options.stop, options.skip_special_tokens, options.include_stop)
        self.stop_token_ids = set(sampling.stop_token_ids)
        self.include_stop = options.include_stop
        self.generated: list[int] = []
        self.done = False
        self.cut_short = False  # a stop string ended it while the model was still generating
        self._carried: list[int] = []
        self._carried_logprobs: list[TokenLogprob] = []

    def consume(self, event: TokenEvent) -> list[TextDelta | Finished]:
        self.generated += event.token_ids
        self._carried += event.token_ids
        self._carried_logprobs += event.logprobs or []
        # The token that stopped the engine (EOS, a stop token id) keeps its id and logprobs, but its text
        # is left out, unless include_stop_str_in_output: vLLM's rule for stop tokens and strings alike.
        stopped_by_token = event.finish_reason == "stop" and not self.include_stop
        text = self.detok.push(event.token_ids[:-1] if stopped_by_token else event.token_ids)
        ended = self.detok.stopped or event.finish_reason is not None
        if ended:
            text += self.detok.finish()
        out: list[TextDelta | Finished] = []
        if text or (ended and self._carried):
            logprobs = self._carried_logprobs if event.logprobs is not None else None
            out.append(TextDelta(self.index, text, self._carried, logprobs))
            self._carried, self._carried_logprobs = [], []
        if ended:
            self.done = True
            self.cut_short = self.detok.stopped and event.finish_reason is None
            out.append(self._finish(event.finish_reason))
        return out

    def _finish(self, reason: str | None) -> Finished:
        if self.detok.stopped:
            return Finished(self.index, "stop", self.detok.stop_reason)
        last = self.generated[-1] if self.generated else None
        return Finished(self.index, reason, last if reason == "stop" and last in self.stop_token_ids else None)


class Generation:
    def __init__(self, pipeline, request_id: str, prompt: Prompt, images: list[DecodedImage],
                 sampling: SamplingParams, output: OutputOptions, stream: TokenStream, slot, timing: Timing):
        self.pipeline = pipeline
        self.request_id = request_id
        self.prompt = prompt
        self.images = images
        self.sampling = sampling
        self.stream = stream
        self.slot = slot  # the admission slot, released by ``close``
        self.timing = timing
        self.choices = [ChoiceState(i, pipeline.tokenizer, output, sampling) for i in range(sampling.n)]
        self.cached_tokens = 0  # prompt tokens a worker's prefix cache served (usage.prompt_tokens_details)
        self.request = None  # the request it answers (set by the pipeline), and which prompt of it
        self.prompt_index = 0
        self.resumes = 0
        self.outcome = ""  # how it ended: a finish reason, or error_<status>
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.generated) for c in self.choices)

    @property
    def generated(self) -> list[int]:
        """Choice 0's tokens so far (what a resume continues from)."""
        return self.choices[0].generated

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    async def events(self, flushes: bool = False) -> AsyncIterator[TextDelta | Finished | Flush]:
        """The choices' text and finishes; with ``flushes``, ``FLUSH`` before each wait for a token."""
        try:
            while not self.done:
                try:
                    if flushes and not self.stream.ready():
                        yield FLUSH
                    async for event in self.stream.tokens():
                        for output in self._consume(event):
                            yield output
                        if self.done:
                            return
                        if flushes and not self.stream.ready():
                            yield FLUSH
                except WorkerLost as lost:
                    if flushes:  # what is held goes out before the resume's wait
                        yield FLUSH
                    await self.pipeline.resume(self, str(lost))
        except ServiceError as err:
            self.outcome = f"error_{err.status}"
            raise ApiError(err.status, err.message) from None
        finally:
            self.close()

    def _consume(self, event: TokenEvent) -> list[TextDelta | Finished]:
        now = time.time()
        if self.timing.first_token_at is None:
            self.cached_tokens = event.cached_tokens
            self.timing.first_token_at = now
            self.timing.stages["first_token"] = now - self.timing.submitted
        if event.choice == 0:
            self.timing.token_times.append(now)
        if event.choice >= len(self.choices) or self.choices[event.choice].done:
            return []
        out = self.choices[event.choice].consume(event)
        if self.done:
            self.outcome = out[-1].reason if len(self.choices) == 1 else "stop"
        return out

    def close(self, reason: str = "request ended early") -> None:
        """Free the slot and the stream; tell the workers to stop unless they finished (``reason`` says
        why, in the cancel). Idempotent, and synchronous so that a cancelled response (whose cleanup
        cannot await) still runs it whole."""
        if self._closed:
            return
        self._closed = True
        self.slot.release()
        cut_short = any(c.cut_short for c in self.choices)
        running = any(not c.done or c.cut_short for c in self.choices)
        if running:
            self.pipeline.cancel_soon(self.stream.attempt or self.request_id,
                                      "stop string" if cut_short and self.done else reason)
        self.pipeline.finished(self)
