"""A chat generation's events as OpenAI answers: one ``ChatCompletion``, or the stream's chunks.

Chunks are plain dicts written once: every choice carries ``finish_reason`` and ``logprobs`` keys (null
until they apply), the first chunk of a choice its role, each later one what a ``TextDelta`` released
(content, tool calls, the logprobs of its tokens), then a finish chunk per choice, then — when asked —
the usage chunk (``continuous_usage_stats``: usage in every chunk, too). With tools, text that may
start a ``<tool_call>`` block is held like a stop string, and a complete block is one tool-call delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from services.frontend.errors import ApiError
from services.frontend.generation import FLUSH, Finished, Flush, Generation, TextDelta
from services.frontend.logprobs import TokenText
from services.frontend.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    FunctionCall,
    ToolCall,
)
from services.frontend.responses import usage_of
from services.frontend.tools import ParsedCall, ToolCallParser


def echoed(request: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the answer starts with the last message when it is the assistant's."""
    last = request.messages[-1]
    return "".join(last.texts()) if request.echo and last.role == "assistant" else ""


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(finish: Finished, calls: list) -> str:
    return "tool_calls" if calls and finish.reason == "stop" else finish.reason


class ChatOutput:
    def __init__(self, model_name: str, token_text: TokenText):
        self.model_name = model_name
        self.token_text = token_text

    async def complete(self, generation: Generation, request: ChatCompletionRequest) -> ChatCompletion:
        n = len(generation.choices)
        texts: list[list[str]] = [[echoed(request)] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finishes: list[Finished | None] = [None] * n
        async with aclosing(generation.events()) as events:  # closed now, not when collected: the cancel goes out
            async for event in events:
                if isinstance(event, TextDelta):
                    texts[event.choice].append(event.text)
                    if event.logprobs is not None:
                        logprobs[event.choice] += self.token_text.chat(event.token_ids, event.logprobs).content
                else:
                    finishes[event.choice] = event
        if any(f is None for f in finishes):
            raise ApiError(502, "the token stream ended without a finish")
        choices = [self._choice(i, "".join(texts[i]), finishes[i], logprobs[i], request) for i in range(n)]
        return ChatCompletion(id=completion_id(generation), model=self.model_name,
                              created=int(generation.timing.arrived), choices=choices, usage=usage_of([generation]))

    def _choice(self, index: int, text: str, finish: Finished, logprobs: list, request) -> Choice:
        calls: list[ParsedCall] = []
        if request.uses_tools():
            parser = ToolCallParser()
            content, calls = parser.push(text)
            text = content + parser.finish()
        message = AssistantMessage(content=text if text or not calls else None, tool_calls=[_tool_call(c) for c in calls])
        lp = ChoiceLogprobs(content=logprobs) if request.logprobs else None
        return Choice(index=index, message=message, finish_reason=_finish_reason(finish, calls), logprobs=lp,
                      stop_reason=finish.stop_reason)

    async def chunks(self, generation: Generation, request: ChatCompletionRequest) -> AsyncIterator[dict | Flush]:
        head = {"id": completion_id(generation), "object": "chat.completion.chunk",
                "created": int(generation.timing.arrived), "model": self.model_name}
        usage, continuous = request.include_usage(), request.continuous_usage()
        parsers = [ToolCallParser() if request.uses_tools() else None for _ in generation.choices]
        calls: list[list[ParsedCall]] = [[] for _ in generation.choices]

        def chunk(choice: int, delta: dict, finish: Finished | None = None, logprobs=None) -> dict:
            entry = {"index": choice, "delta": delta, "logprobs": logprobs,
                     "finish_reason": None if finish is None else _finish_reason(finish, calls[choice])}
            if finish is not None and finish.stop_reason is not None:
                entry["stop_reason"] = finish.stop_reason
            out = {**head, "choices": [entry]}
            if usage:
                out["usage"] = usage_of([generation]).model_dump() if continuous else None
            return out

        try:
            for choice in range(len(generation.choices)):
                yield chunk(choice, {"role": "assistant", "content": echoed(request)})
            async with aclosing(generation.events(flushes=True)) as events:
                async for event in events:
                    if event is FLUSH:
                        yield FLUSH
                        continue
                    if isinstance(event, Finished):
                        parser = parsers[event.choice]
                        rest = parser.finish() if parser is not None else ""
                        if rest:
                            yield chunk(event.choice, {"content": rest})
                        yield chunk(event.choice, {}, finish=event)
                        continue
                    delta = self._delta(event, parsers[event.choice], calls[event.choice])
                    logprobs = self.token_text.chat(event.token_ids, event.logprobs)
                    if delta or logprobs is not None:
                        yield chunk(event.choice, delta or {"content": ""},
                                    logprobs=None if logprobs is None else logprobs.model_dump())
            if usage:
                yield {**head, "choices": [], "usage": usage_of([generation]).model_dump()}
        finally:
            generation.close()  # also when the consumer stops early

    @staticmethod
    def _delta(event: TextDelta, parser: ToolCallParser | None, calls: list[ParsedCall]) -> dict:
        if parser is None:
            return {"content": event.text}
        content, done = parser.push(event.text)
        calls += done
        delta: dict = {}
        if content:
            delta["content"] = content
        if done:
            delta["tool_calls"] = [{"index": c.index, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in done]
        return delta


def completion_id(generation: Generation) -> str:
    return f"chatcmpl-{generation.request_id}"
