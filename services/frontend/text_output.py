"""Text-completion generations as OpenAI answers: one ``Completion`` or the stream's chunks.

A request with several prompts runs one generation per prompt, concurrently; choice ``i`` of prompt
``p`` is answered as index ``p * n + i``. ``echo`` puts the prompt's text before the answer. Chunks
follow chat's rules (``finish_reason`` and ``logprobs`` keys always present, one per released delta).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from services.frontend.errors import ApiError
from services.frontend.generation import FLUSH, Finished, Flush, Generation, TextDelta
from services.frontend.logprobs import TokenText
from services.frontend.responses import usage_of
from services.frontend.text_protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from shared.aio import cancel_until_done


class TextOutput:
    def __init__(self, model_name: str, token_text: TokenText, tokenizer):
        self.model_name = model_name
        self.token_text = token_text
        self.tokenizer = tokenizer

    def _echo(self, generation: Generation, request: CompletionRequest) -> str:
        return self.tokenizer.decode(generation.prompt.token_ids, skip_special_tokens=False) if request.echo else ""

    async def complete(self, generations: list[Generation], request: CompletionRequest) -> Completion:
        try:
            answers = await asyncio.gather(*(self._collect(g, request) for g in generations))
        finally:
            for generation in generations:
                generation.close()
        choices = [choice for answer in answers for choice in answer]
        first = generations[0]
        return Completion(id=completion_id(first), model=self.model_name, created=int(first.timing.arrived),
                          choices=choices, usage=usage_of(generations))

    async def _collect(self, generation: Generation, request: CompletionRequest) -> list[CompletionChoice]:
        n = len(generation.choices)
        base = generation.prompt_index * n
        echo = self._echo(generation, request)
        texts: list[list[str]] = [[echo] for _ in range(n)]
        logprobs = [CompletionLogprobs() if request.logprobs is not None else None for _ in range(n)]
        offsets = [len(echo)] * n
        finishes: list[Finished | None] = [None] * n
        async with aclosing(generation.events()) as events:
            async for event in events:
                if isinstance(event, Finished):
                    finishes[event.choice] = event
                    continue
                texts[event.choice].append(event.text)
                if logprobs[event.choice] is not None and event.logprobs is not None:
                    self.token_text.completion(event.token_ids, event.logprobs, offsets[event.choice],
                                               logprobs[event.choice])
                offsets[event.choice] += len(event.text)
        if any(f is None for f in finishes):
            raise ApiError(502, "the token stream ended without a finish")
        return [CompletionChoice(index=base + i, text="".join(texts[i]), logprobs=logprobs[i],
                                 finish_reason=finishes[i].reason, stop_reason=finishes[i].stop_reason)
                for i in range(n)]

    async def chunks(self, generations: list[Generation], request: CompletionRequest) -> AsyncIterator[dict | Flush]:
        first = generations[0]
        head = {"id": completion_id(first), "object": "text_completion", "created": int(first.timing.arrived),
                "model": self.model_name}
        usage, continuous = request.include_usage(), request.continuous_usage()
        offsets: dict[int, int] = {}

        def chunk(index: int, text: str, finish: Finished | None = None, logprobs=None) -> dict:
            entry = {"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": None if finish is None else finish.reason}
            if finish is not None and finish.stop_reason is not None:
                entry["stop_reason"] = finish.stop_reason
            out = {**head, "choices": [entry]}
            if usage:
                out["usage"] = usage_of(generations).model_dump() if continuous else None
            return out

        try:
            async for generation, event in _merged(generations):
                if event is FLUSH:
                    yield FLUSH
                    continue
                index = generation.prompt_index * len(generation.choices) + event.choice
                if index not in offsets:
                    echo = self._echo(generation, request)
                    offsets[index] = len(echo)
                    if echo:
                        yield chunk(index, echo)
                if isinstance(event, Finished):
                    yield chunk(index, "", finish=event)
                    continue
                logprobs = None
                if request.logprobs is not None and event.logprobs is not None:
                    logprobs = self.token_text.completion(event.token_ids, event.logprobs, offsets[index]).model_dump()
                offsets[index] += len(event.text)
                yield chunk(index, event.text, logprobs=logprobs)
            if usage:
                yield {**head, "choices": [], "usage": usage_of(generations).model_dump()}
        finally:
            for generation in generations:
                generation.close()


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[Generation, TextDelta | Finished | Flush]]:
    """Every generation's events as they come, interleaved, with ``FLUSH`` where none is at hand; the first
    error ends them all."""
    if len(generations) == 1:
        async with aclosing(generations[0].events(flushes=True)) as events:
            async for event in events:
                yield generations[0], event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(generation: Generation) -> None:
        try:
            async with aclosing(generation.events()) as events:
                async for event in events:
                    await queue.put((generation, event))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((generation, err))
        finally:
            await queue.put((generation, done))

    tasks = [asyncio.create_task(pump(g)) for g in generations]
    try:
        remaining = len(tasks)
        while remaining:
            if queue.empty():  # about to wait
                yield generations[0], FLUSH
            generation, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield generation, item
    finally:
        await cancel_until_done(*tasks, timeout=5.0)


def completion_id(generation: Generation) -> str:
    return f"cmpl-{generation.request_id}"
