"""``epd up`` as most people first run it, under faults: any one worker killed (-9) or stopped (SIGTERM)
while requests run, a prefill worker lost before it accepted, an encoder leaving before its embeddings
were pulled, abandoned requests. Every admitted request ends with the exact greedy answer; the stack
restarts what crashed, treats a clean exit as scale-in, and keeps serving. Driven from the outside:
HTTP and /metrics, processes from /proc, the ``client`` role's credentials only."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import pytest

from tests.support import chat_messages, make_image, settled
from tests.up_stack import UpStack

TOKENS = 40


@pytest.fixture(scope="module")
def up(tiny_model):
    stack = UpStack(tiny_model, "--encoders", "2", "--pd", "split", "--prefills", "2", "--decodes", "2",
                    env={"EPD_DRAIN_SECONDS": "20", "EPD_ENCODER_CACHE_MB": "0", "EPD_WORKER_WAIT": "120"})
    yield stack
    assert stack.stop() == 0


def exact_answers(reference, images: list, ahead: bool = False, per: int = 1):
    """``answer(i)``: request i's images (``per`` of ``images``, in turn) and the exact answer it must get
    (HF greedy, EOS not stopping); ``ahead``: every answer computed now, before any burst runs."""
    cache = {}

    def answer(i: int) -> tuple[list, str]:
        key = i % len(images)
        mine = [images[(key + j) % len(images)] for j in range(per)]
        if key not in cache:
            cache[key] = reference.text(reference.generate(f"Picture {key}.", mine, TOKENS, ignore_eos=True))
        return mine, cache[key]

    for i in range(len(images) if ahead else 0):
        answer(i)
    return answer


@pytest.fixture(scope="module")
def want(reference):
    return exact_answers(reference, [make_image(500 + i, 56 + 8 * i, 64) for i in range(4)])


def burst(up: UpStack, want, n: int, action=None, after: float = 0.5, stream: bool = True) -> list[dict]:
    """``n`` concurrent image requests; ``action()`` runs ``after`` seconds in; every answer checked exact."""
    def one(i: int) -> dict:
        time.sleep(0.05 * i)
        images, expected = want(i)
        result = up.chat(f"Picture {i % 4}.", images, max_tokens=TOKENS, stream=stream)
        result["expected"] = expected
        return result

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        if action is not None:
            time.sleep(after)
            action()
        results = [f.result() for f in futures]
    for r in results:
        assert r["status"] == 200 and not r.get("error"), (r, up.errors())
        text = r["text"] if stream else r["choices"][0]["message"]["content"]
        assert text == r["expected"]
    return results


def test_an_image_request_right_after_ready_is_served(up, want):
    images, expected = want(0)
    assert up.chat("Picture 0.", images, max_tokens=TOKENS)["choices"][0]["message"]["content"] == expected
    health = httpx.get(f"{up.root}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize("kind", ["encoder", "prefill", "decode"])
def test_a_worker_killed_under_load_loses_nothing_and_is_restarted(up, want, kind):
    died = up.count("stack.worker_died")
    burst(up, want, 10, lambda: up.signal(kind, signal.SIGKILL))
    up.wait_for_workers(kind, 2)  # the supervisor restarted it
    assert up.count("stack.worker_died") == died + 1
    assert up.process.poll() is None
    up.wait_idle()


@pytest.mark.parametrize("kind", ["encoder", "prefill"])
def test_requests_that_find_no_worker_of_a_kind_wait_for_one_to_restart(up, reference, kind):
    """Every worker of a kind killed at once: the requests sent meanwhile wait for the supervisor to start
    one again (``--worker-wait``), then are answered exactly, each retry sent where its loss is noticed. Images not seen before: no prefix cache holds
    them, so they need the encoders."""
    seed = {"encoder": 700, "prefill": 710}[kind]
    fresh = exact_answers(reference, [make_image(seed + i, 48 + 8 * i, 56) for i in range(4)], ahead=True)
    died = up.count("stack.worker_died")
    started = time.monotonic()
    burst(up, fresh, 4, lambda: [os.kill(pid, signal.SIGKILL) for pid in up.pids(kind)], after=0)
    # none of them waited out a 60 s encode or prefill timeout on a job handed to a process just killed
    assert time.monotonic() - started < 40
    up.wait_for_workers(kind, 2)
    assert up.count("stack.worker_died") == died + 2
    up.wait_idle()


def test_a_prefill_lost_before_accepting_is_retried_at_once(up, want):
    """Jobs delivered to a prefill worker that then dies would wait out the 30 s prefill timeout: the
    frontend watches the worker it sent them to and sends them elsewhere as soon as NATS says it is gone."""
    frozen = up.signal("prefill", signal.SIGSTOP)
    started = time.monotonic()
    try:
        burst(up, want, 8, lambda: os.kill(frozen, signal.SIGKILL), after=2.0)
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert time.monotonic() - started < 20  # well inside the 30 s a lost job used to wait
    up.wait_for_workers("prefill", 2)
    up.wait_idle()


@pytest.fixture(scope="module")
def pairs(reference):
    """Requests of two new images each: the encoders share them, one image of a request on each."""
    return exact_answers(reference, [make_image(600 + i, 48 + 8 * i, 64) for i in range(4)], per=2)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_an_encoder_gone_before_its_embeddings_were_pulled(up, pairs, how):
    """Prefill is frozen, so every embedding waits at its encoder; then that encoder goes. Killed, its
    embeddings are encoded again elsewhere (and it is restarted), with the rest of their requests' images;
    stopped (SIGTERM: scale-in) it keeps serving them until they are pulled, then exits and is not
    restarted."""
    want = pairs
    left = up.count("stack.worker_left")
    prefills = up.pids("prefill")
    for pid in prefills:
        os.kill(pid, signal.SIGSTOP)

    def encoder_leaves():
        time.sleep(1.5)  # the images are encoded, their handles handed to the (frozen) prefill workers
        up.signal("encoder", how)
        time.sleep(0.3)
        for pid in prefills:
            os.kill(pid, signal.SIGCONT)

    try:
        burst(up, want, 6, encoder_leaves, after=0.2)
    finally:
        for pid in prefills:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    if how == signal.SIGKILL:
        up.wait_for_workers("encoder", 2)
    else:
        deadline = time.monotonic() + 30
        while up.count("stack.worker_left") == left:
            assert time.monotonic() < deadline, "the encoder did not drain and exit"
            time.sleep(0.2)
        time.sleep(2)
        assert len(up.pids("encoder")) == 1  # not restarted: the operator scaled in
        burst(up, want, 2)
    up.wait_idle()


def encoder_bytes_held(up: UpStack) -> float:
    return sum(v for labels, v in up.series("epd_service_stat")
               if labels.get("stat") == "bytes_held" and labels.get("instance", "").startswith("encoder"))


def test_a_client_that_leaves_before_prefill_accepts_frees_its_embeddings_at_once(up):
    """Prefill is frozen, so a new image's embeddings wait at its encoder; the client leaves. Nobody will
    pull them: the frontend discards them and the encoder frees them now, not at its lease's end (60 s)."""
    prefills = up.pids("prefill")
    for pid in prefills:
        os.kill(pid, signal.SIGSTOP)
    try:
        payload = {"messages": chat_messages("Leave early.", [make_image(800, 64, 72)]), "max_tokens": 4}
        leaving = ThreadPoolExecutor(1).submit(httpx.post, f"{up.api}/chat/completions", json=payload, timeout=4)
        deadline = time.monotonic() + 4
        while not encoder_bytes_held(up):  # encoded, waiting for the frozen workers
            assert time.monotonic() < deadline, "the image was not encoded"
            time.sleep(0.2)
        with pytest.raises(httpx.ReadTimeout):
            leaving.result()  # the client gives up
        deadline = time.monotonic() + 5
        while encoder_bytes_held(up):
            assert time.monotonic() < deadline, "the encoder still holds embeddings nobody will pull"
            time.sleep(0.2)
    finally:
        for pid in prefills:
            os.kill(pid, signal.SIGCONT)
    up.wait_idle()


def test_abandoned_requests_are_cancelled_everywhere(up):
    """Clients that leave — streaming or not — free their sequences on every worker at once."""
    def leave_early(stream: bool) -> None:
        payload = {"messages": chat_messages(f"go on {stream}", []), "max_tokens": 1500, "temperature": 0,
                   "ignore_eos": True, "stream": stream}
        if stream:  # read a few chunks, then hang up
            with httpx.stream("POST", f"{up.api}/chat/completions", json=payload, timeout=30) as response:
                assert response.status_code == 200
                deadline = time.monotonic() + 1.5
                for _ in response.iter_lines():
                    if time.monotonic() > deadline:
                        return
            pytest.fail("the stream ended before the client left")
        try:
            response = httpx.post(f"{up.api}/chat/completions", json=payload, timeout=1.5)
        except httpx.TimeoutException:
            return  # left while it generated
        pytest.fail(f"answered before the client left: {response.status_code} {response.text[:300]}")

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(leave_early, [False, True] * 3))
    up.wait_idle(timeout=5)


def test_the_client_role_reads_only_its_own(up):
    """With the credentials ``stack.ready`` names, a client can chat and submit jobs, but cannot read
    other roles' replies (their data-plane tokens) nor touch JetStream beyond its job and result streams."""
    creds = dict(line.split("=", 1) for line in Path(up.ready["nats_client_credentials"]).read_text().split())

    async def probe() -> list[str]:
        violations: list[str] = []

        async def on_error(err):
            violations.append(str(err).lower())

        nc = await nats.connect(creds["EPD_NATS_URL"], user=creds["EPD_NATS_USER"],
                                password=creds["EPD_NATS_PASSWORD"], error_cb=on_error, allow_reconnect=False,
                                inbox_prefix="_INBOX.epd.client")
        try:
            for subject in ("_INBOX.>", "_INBOX.epd.frontend.>", "epd.stream.>", "$SRV.>"):
                await nc.subscribe(subject)
            await settled(nc)  # the server has read the SUBs: its refusals are on the way
            for api in ("$JS.API.STREAM.NAMES", "$JS.API.STREAM.DELETE.KV_EPD_EMBEDDINGS_epd",
                        "$JS.API.STREAM.PURGE.EPD_RESULTS_epd"):
                with pytest.raises(Exception):  # refused: the request never reaches JetStream
                    await nc.request(api, b"{}", timeout=1)
            from shared.client import chat

            answer = await chat(nc, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert answer["usage"]["completion_tokens"] == 3
        finally:
            await nc.close()
        return violations

    violations = asyncio.run(probe())
    assert sum("permissions violation" in v for v in violations) >= 4, violations
