"""A frontend and the workers its stack needs, as a deployment starts them in any order: ``/health`` and
``/v1/models`` say what is missing until it can serve; a request that finds no worker of a kind it needs
waits for one (``--worker-wait``) and is served once it is listed; a text-only frontend refuses images at
once and needs no encoder. (Giving up after the wait, with the kind named in the stack's own terms:
tests/test_stack.py's lean stack.)"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.frontend.service import served_name
from services.frontend.workers import StackWorkers
from shared.bus.directory import Directory
from tests.support import RunningStack, chat_messages, make_image


def _frontend(running: RunningStack, *args: str) -> str:
    """One more frontend on ``running``'s prefix; its base URL once it is listed."""
    before = {p.pid for _, p in running.stack.processes}
    running.spawn("frontend", "--port", "0", *args)
    (process,) = [p for k, p in running.stack.processes if k == "frontend" and p.pid not in before]

    async def address() -> str:
        from shared.bus.calls import service_stats

        nc = await running.stack.connect()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for s in await service_stats(nc, "epd-frontend", wait=0.3):
                    if (s.get("metadata") or {}).get("pid") == str(process.pid):
                        return "http://" + s["metadata"]["http"]
                await asyncio.sleep(0.3)
            raise AssertionError("the frontend did not start")
        finally:
            await nc.close()

    return asyncio.run(address())


def _until(predicate, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return found


def _reason(url: str) -> str | None:
    health = httpx.get(f"{url}/health", timeout=10)
    return None if health.status_code == 200 else health.json()["reason"]


@pytest.fixture(scope="module")
def early(nats_url, tiny_model):
    """A frontend started before any worker of its stack (a request waits up to a minute for one)."""
    running = RunningStack(nats_url, tiny_model, env={"EPD_WORKER_WAIT": "60"})
    yield running
    running.stop()


def test_a_frontend_started_before_its_workers_waits_for_them_and_says_what_is_missing(early, reference):
    url = _frontend(early)
    lm = "no language-model worker (language, prefill or aggregated) is available"
    assert _reason(url) == lm
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert models.status_code == 503 and models.json()["error"]["message"] == f"the model is not served yet: {lm}"

    answer: dict = {}
    payload = {"messages": chat_messages("Early bird.", []), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    asking = threading.Thread(target=lambda: answer.update(httpx.post(f"{url}/v1/chat/completions", json=payload,
                                                                      timeout=120).json()))
    asking.start()  # before any worker exists: it waits for them
    time.sleep(1.0)
    early.spawn("prefill")
    half = _until(lambda: reason if (reason := _reason(url)) != lm else None)
    assert half == "no decode worker is available"  # a split stack, half there
    early.spawn("decode")
    asking.join(120)
    want = reference.text(reference.generate("Early bird.", [], 5, ignore_eos=True))
    assert answer["choices"][0]["message"]["content"] == want, answer

    # what a text request needs is there: the model is served; images would still wait for an encoder
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == Path(early.stack.env["EPD_MODEL"]).name
    assert _reason(url) == "no encoder is available"
    early.spawn("encoder")
    _until(lambda: _reason(url) is None)


def test_a_text_only_frontend_refuses_images_at_once_and_needs_no_encoder(early):
    for kind in ("prefill", "decode"):
        if not any(k == kind for k, _ in early.stack.processes):  # run alone
            early.spawn(kind)
    early.wait_for({"prefill": 1, "decode": 1})
    url = _frontend(early, "--limit-mm-per-prompt", "image=0,video=0")
    _until(lambda: _reason(url) is None)  # prefill and decode listed: all a text-only stack needs
    started = time.monotonic()
    refused = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": chat_messages("What is it?", [make_image(7, 32, 32)]), "max_tokens": 2})
    assert refused.status_code == 400 and time.monotonic() - started < 5
    assert refused.json()["error"]["message"] == "this server serves text only: image input is not accepted"


def test_a_worker_that_misses_a_listing_after_the_port_opened_does_not_close_the_model(early):
    """`epd up`'s frontend opens its port once the stack lists every worker it started: a worker too busy to
    answer the next listing in time (here: stopped) leaves /v1/models served (a client polling it for
    readiness saw 503 right after `stack.ready`, on a loaded host), and /health names what is missing."""
    for kind in ("prefill", "decode"):
        if not any(k == kind for k, _ in early.stack.processes):  # run alone
            early.spawn(kind)
    early.wait_for({"prefill": 1, "decode": 1})
    url = _frontend(early, "--wait-for-workers", "prefill=1,decode=1")
    [decode] = [p for k, p in early.stack.processes if k == "decode"]
    decode.send_signal(signal.SIGSTOP)
    try:
        _until(lambda: _reason(url) == "no decode worker is available", 30)
        models = httpx.get(f"{url}/v1/models", timeout=10)  # the first time this frontend is asked
        assert models.status_code == 200, models.text
    finally:
        decode.send_signal(signal.SIGCONT)
    _until(lambda: _reason(url) in (None, "no encoder is available"), 30)


def test_the_served_model_name_is_the_model_as_given(tmp_path):
    assert served_name("qwen2.5-vl-7b", tmp_path / "preset-qwen2.5-vl-7b-v3") == "qwen2.5-vl-7b"  # a preset
    assert served_name("/models/Qwen2.5-VL-7B-Instruct/", tmp_path) == "Qwen2.5-VL-7B-Instruct"  # a directory
    assert served_name("", tmp_path / "tiny-qwen2_5_vl-v4") == "tiny-qwen2_5_vl-v4"  # the built-in model


def test_a_missing_intake_worker_is_named_in_its_stacks_own_terms():
    directory = Directory(None, "p")
    workers = StackWorkers(directory, 1.0, media=True)
    for seen, name in ((set(), "language-model worker (language, prefill or aggregated)"),
                       ({"aggregated"}, "aggregated worker"), ({"encoder", "language"}, "language worker"),
                       ({"encoder", "decode"}, "prefill worker"), ({"language", "aggregated"}, "aggregated or "
                                                                  "language worker")):
        directory.seen = seen
        assert workers.intake_name() == name
