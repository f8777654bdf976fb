"""The NATS way in (shared/client.py against a real stack): same answers and errors as HTTP, durable jobs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import openai
import pytest

from shared.client import ChatError, chat, chat_stream, submit_job, wait_result
from tests.support import RunningStack, chat_messages, endpoint_data, make_image

MAX_TOKENS = 16


def request(text: str, images=(), **extra) -> dict:
    return {"messages": chat_messages(text, list(images)), "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def http_answer(stack: RunningStack, body: dict):
    return stack.client().chat.completions.create(**{"model": "", **body})  # "": the served model


def assert_same_answer(completion: dict, http) -> None:
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"] == http.choices[0].message.content
    assert completion["choices"][0]["finish_reason"] == http.choices[0].finish_reason
    usage = {k: completion["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": http.usage.prompt_tokens, "completion_tokens": http.usage.completion_tokens,
                     "total_tokens": http.usage.total_tokens}


async def collect(chunks) -> list[dict]:
    return [chunk async for chunk in chunks]


def test_chat_over_nats_equals_http(stack):
    body = request("Describe the image in one sentence.", [make_image(31, 80, 120)])
    completion = asyncio.run(chat(stack.stack.nats_url, body, stack.prefix, timeout=120))
    assert_same_answer(completion, http_answer(stack, body))


def test_stream_over_nats_concatenates_to_the_http_answer(stack):
    body = request("What is in this picture?", [make_image(32, 64, 96)])
    streamed = {**body, "stream_options": {"include_usage": True}}
    chunks = asyncio.run(collect(chat_stream(stack.stack.nats_url, streamed, stack.prefix, timeout=120)))
    http = http_answer(stack, body)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == http.choices[0].message.content
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == [http.choices[0].finish_reason]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == http.usage.completion_tokens


BAD = {
    "no messages": ({"messages": []}, 400),
    "max_tokens beyond the context": ({"messages": chat_messages("hi", []), "max_tokens": 10**9}, 400),
    "another model": ({"messages": chat_messages("hi", []), "model": "not-this-one"}, 404),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("stream", [False, True], ids=["reply", "stream"])
def test_bad_request_over_nats_gets_the_http_error(stack, case, stream):
    body, status = BAD[case]
    with pytest.raises(openai.APIStatusError) as http:
        http_answer(stack, body)
    with pytest.raises(ChatError) as err:
        if stream:
            asyncio.run(collect(chat_stream(stack.stack.nats_url, body, stack.prefix, timeout=30)))
        else:
            asyncio.run(chat(stack.stack.nats_url, body, stack.prefix, timeout=30))
    assert err.value.status == http.value.status_code == status
    assert err.value.body["error"]["code"] == status
    assert err.value.body["error"]["message"] == http.value.body["message"]


def test_nobody_serving_the_prefix_is_503(stack):
    with pytest.raises(ChatError) as err:
        asyncio.run(chat(stack.stack.nats_url, request("hi"), prefix="nobody-here", timeout=10))
    assert err.value.status == 503


def test_job_answer_equals_http_and_resubmitting_is_a_no_op(stack):
    body = request("Name three colours.")
    url = stack.stack.nats_url

    async def run() -> tuple[str, str, dict]:
        first = await submit_job(url, body, stack.prefix, job_id="colours-1")
        again = await submit_job(url, body, stack.prefix, job_id="colours-1")
        return first, again, await wait_result(url, first, stack.prefix, timeout=120)

    first, again, result = asyncio.run(run())
    assert first == again == "colours-1"
    assert_same_answer(result, http_answer(stack, body))
    jobs = endpoint_data(stack.stats_sync("epd-frontend")[0])
    assert jobs["jobs_done"] >= 1


def test_job_that_can_never_succeed_gets_an_error_result(stack):
    url = stack.stack.nats_url
    job_id = asyncio.run(submit_job(url, {"messages": []}, stack.prefix))
    with pytest.raises(ChatError) as err:
        asyncio.run(wait_result(url, job_id, stack.prefix, timeout=60))
    assert err.value.status == 400 and "messages" in err.value.message


def test_epd_submit_durable_wait_prints_the_answer(stack):
    body = request("Count to five.")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", "--nats-url", stack.stack.nats_url,
                           "--subject-prefix", stack.prefix, "--durable", "--wait", "--timeout", "120", "-"],
                          input=json.dumps(body), capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    assert_same_answer(json.loads(done.stdout), http_answer(stack, body))


def test_job_submitted_before_any_service_runs_completes_once_they_start(nats_url, tiny_model, stack):
    fresh = RunningStack(nats_url, tiny_model, env={"EPD_WORKER_WAIT": "1"})  # gives up on a worker soon: retried
    body = request("Tell me a short story.")  # text only: no encoder needed
    try:
        job_id = asyncio.run(submit_job(nats_url, body, fresh.prefix))
        fresh.spawn("frontend", "--port", "0")
        fresh.wait_for({"frontend": 1})
        wait_until(lambda: endpoint_data(fresh.stats_sync("epd-frontend")[0]).get("jobs_retried", 0) >= 1)
        fresh.spawn("prefill")
        fresh.spawn("decode")
        result = asyncio.run(wait_result(nats_url, job_id, fresh.prefix, timeout=180))
    finally:
        fresh.stop()
    assert_same_answer(result, http_answer(stack, body))


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
