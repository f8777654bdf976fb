"""A streaming answer's writes: tokens already at hand go out in one write, none waits for a later token.

Real parts: a nats-server, the frontend's TokenStream subscribed on it, a Generation detokenizing with
the tiny checkpoint's tokenizer, ChatOutput's chunks and the app's server-sent events; token events
are published on the request's subject as a worker publishes them. The pipeline around the
generation (admission slot, cancels, resumes) is a stand-in: nothing here cancels or resumes.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from transformers import AutoTokenizer

from services.frontend.app import _sse
from services.frontend.chat_output import ChatOutput
from services.frontend.generation import Generation, OutputOptions, Timing
from services.frontend.logprobs import TokenText
from services.frontend.protocol import ChatCompletionRequest
from services.frontend.stream import TokenStream
from shared.messages.sampling import SamplingParams
from shared.messages import pack
from shared.messages.stream import TokenEvent

ATTEMPT = "req-1"


class Pipeline:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ended: list[str] = []

    def cancel_soon(self, request_id: str, reason: str) -> None:
        self.ended.append(f"cancel {request_id}")

    def finished(self, generation) -> None:
        self.ended.append("finished")


class Slot:
    def release(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


async def open_answer(nats_url, tokenizer, subject: str):
    """(client, the answer's writes as an async iterator): a streaming chat answer read from ``subject``."""
    nc = await nats.connect(nats_url)
    stream = TokenStream(nc, subject, directory=None, token_timeout=10)
    await stream.open()
    stream.expect(ATTEMPT, "")
    generation = Generation(Pipeline(tokenizer), ATTEMPT, prompt=None, images=[], sampling=SamplingParams(max_tokens=64),
                            output=OutputOptions(), stream=stream, slot=Slot(), timing=Timing(arrived=time.time()))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    return nc, _sse(ChatOutput("tiny", TokenText(tokenizer)).chunks(generation, request))


def token(index: int, token_id: int, attempt: str = ATTEMPT, finish: str | None = None) -> bytes:
    return pack(TokenEvent(request_id=attempt, index=index, token_ids=[token_id], finish_reason=finish))


def events(writes: list[str]) -> list[dict | str]:
    """The server-sent events of ``writes``, in order (``[DONE]`` as a string)."""
    out = []
    for data in "".join(writes).split("\n\n"):
        if data:
            assert data.startswith("data: ")
            body = data.removeprefix("data: ")
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def content(writes: list[str]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events(writes) if isinstance(e, dict))


async def test_tokens_already_arrived_go_out_in_one_write(nats_url, tokenizer):
    subject = "test.stream.joined"
    ids = tokenizer("the quick brown fox jumps over the lazy dog again and again")["input_ids"][:12]
    nc, answer = await open_answer(nats_url, tokenizer, subject)
    try:
        for i, token_id in enumerate(ids):  # all of them before the answer is read
            await nc.publish(subject, token(i, token_id, finish="length" if i == len(ids) - 1 else None))
        await nc.flush()
        await asyncio.sleep(0.2)
        writes = [w async for w in answer]
    finally:
        await nc.close()
    # nothing to wait for: the role chunk, the twelve tokens, their finish and [DONE] in one write
    assert len(writes) == 1, writes
    assert events(writes)[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content(writes) == tokenizer.decode(ids, skip_special_tokens=True)
    tail = events(writes)
    assert tail[-1] == "[DONE]" and tail[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in tail if isinstance(e, dict) and e["choices"][0]["delta"].get("content")) >= 6  # one event a token


async def test_a_token_is_written_before_the_next_one_arrives(nats_url, tokenizer):
    subject = "test.stream.paced"
    ids = tokenizer("one two three four")["input_ids"][:4]
    nc, answer = await open_answer(nats_url, tokenizer, subject)
    writes: list[str] = []

    async def read():
        async for w in answer:
            writes.append(w)

    reader = asyncio.create_task(read())
    try:
        # a superseded attempt's late words and a repeat before the first token: skipped, no wait on them
        await nc.publish(subject, token(0, ids[1], attempt="req-0"))
        for i, token_id in enumerate(ids):
            await nc.publish(subject, token(i, token_id, finish="length" if i == len(ids) - 1 else None))
            if i == 1:
                await nc.publish(subject, token(0, ids[0]))  # a repeat of token 0
            await nc.flush()
            await asyncio.sleep(0.3)
            if i < len(ids) - 1:  # each token out while the next one is still to come
                assert content(writes) == tokenizer.decode(ids[:i + 1], skip_special_tokens=True), (i, writes)
        await asyncio.wait_for(reader, 5)
    finally:
        reader.cancel()
        await nc.close()
    assert content(writes) == tokenizer.decode(ids, skip_special_tokens=True)
    assert events(writes)[-1] == "[DONE]"


async def test_a_token_ahead_of_its_turn_is_not_at_hand(nats_url, tokenizer):
    subject = "test.stream.ahead"
    nc = await nats.connect(nats_url)
    try:
        stream = TokenStream(nc, subject, directory=None, token_timeout=10)
        await stream.open()
        stream.expect(ATTEMPT, "")
        await nc.publish(subject, token(1, 5))  # index 1 before 0
        await nc.flush()
        await asyncio.sleep(0.1)
        assert not stream.ready()
        await nc.publish(subject, token(0, 4, attempt="req-0"))  # another attempt's: never at hand
        await nc.publish(subject, token(0, 4))
        await nc.flush()
        await asyncio.sleep(0.1)
        assert not stream.ready()  # the head is still index 1
        got = []
        async for event in stream.tokens():
            got.append((event.index, event.token_ids))
            if len(got) == 2:
                break
        assert got == [(0, [4]), (1, [5])]
        await stream.close()
    finally:
        await nc.close()
