"""Conversations at text speed (issue 42): a chat resends its images every turn; an image whose KV a
language worker's prefix cache holds is routed to that worker and is neither decoded, encoded nor moved
again — counted through the services' own stats — and the answers stay HF's, token for token, when the
prefix is evicted after the frontend looked (the worker refuses, the frontend sends every image) and with
every encoder stopped. Stacks: E/PD with two language workers (small KV pools), E/P/D, aggregated.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
import uuid

import httpx
import nats
import numpy as np
import openai
import pytest

from services.frontend.routing import BALANCE_ABS, choose
from shared.bus.subjects import Subjects
from shared.messages.sampling import SamplingParams
from shared.messages import pack
from shared.messages.control import Cancel
from shared.messages.prefill import PrefillJob
from tests.support import Chat, RunningStack, data_url, endpoint_data, make_image

DESCRIBE = "Describe this picture in a few words, with as much detail as you can."


@pytest.fixture(scope="module")
def epd(nats_url, tiny_model):
    """One encoder, two language workers with 127-block KV pools, a frontend that waits 2 s for a missing
    worker (the last test's 503)."""
    env = {"EPD_KV_CACHE_MB": "1", "EPD_MAX_MODEL_LEN": "1024", "EPD_WORKER_WAIT": "2"}
    running = RunningStack(nats_url, tiny_model, env=env).start(
        encoders=1, prefills=0, decodes=0, languages=2)
    yield running
    running.stop()


def figures(running: RunningStack) -> dict[str, dict]:
    """Each instance's figures (its endpoints' data in the service API's STATS), by instance id."""
    return {endpoint_data(s)["instance"]: endpoint_data(s) | {"kind": s["name"].removeprefix("epd-")}
            for s in asyncio.run(running.stats(None))}


def change(before: dict, after: dict, stat: str, kind: str) -> dict[str, float]:
    return {i: after[i].get(stat, 0) - before.get(i, {}).get(stat, 0) for i in after if after[i]["kind"] == kind}


def served(before: dict, after: dict, kind: str = "language") -> list[str]:
    """The workers of ``kind`` that took prompts between the two readings."""
    return [i for i, n in change(before, after, "prompts", kind).items() if n]


def total(before: dict, after: dict, stat: str, kind: str) -> float:
    return sum(change(before, after, stat, kind).values())


# -- direct prompts: load on a chosen worker, eviction on a chosen worker ----------------------------------
async def _submit(running: RunningStack, instance: str, jobs: list[PrefillJob]) -> None:
    nc = await nats.connect(running.stack.nats_url)
    try:
        for job in jobs:
            await nc.request(Subjects(running.prefix).prefill_on(instance), pack(job), timeout=30)
    finally:
        await nc.close()


def text_job(tokens: int, max_tokens: int, seed: int) -> PrefillJob:
    ids = np.random.default_rng(seed).integers(20, 499, tokens).tolist()  # past the special ids
    return PrefillJob(request_id=uuid.uuid4().hex, token_ids=ids, stream=f"nobody.listens.{seed}",
                      sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def cancel(running: RunningStack, request_id: str) -> None:
    async def send():
        nc = await nats.connect(running.stack.nats_url)
        await nc.publish(Subjects(running.prefix).cancel, pack(Cancel(request_id=request_id, reason="test")))
        await nc.flush()
        await nc.close()
    asyncio.run(send())


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def metric(running: RunningStack, name: str, **labels: str) -> float:
    """The sum of a metric's series on the frontend's /metrics whose labels include ``labels``."""
    text = httpx.get(f"http://127.0.0.1:{running.port}/metrics", timeout=10).text
    found = 0.0
    for label_text, value in re.findall(rf'^{re.escape(name)}\{{(.*?)\}} (\S+)$', text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(have.get(k) == v for k, v in labels.items()):
            found += float(value)
    return found


# -- 1. route to the prefix, send only what is missing -------------------------------------------------------
def test_the_router_prefers_the_longest_prefix_unless_its_holder_is_overloaded():
    loads = {"a": (0, 10), "b": (0, 2), "c": (0, 4)}
    assert choose(loads, {}) == "b"  # nothing cached anywhere: the least loaded
    assert choose(loads, {"a": 64, "c": 32}) == "a"  # the longest prefix, though busier
    assert choose(loads, {"a": 64, "c": 64}) == "c"  # equal prefixes: the less loaded holder
    busy = {"a": (0, BALANCE_ABS * 3), "b": (0, BALANCE_ABS)}
    assert choose(busy, {"a": 1024}) == "b"  # past both margins: the least loaded
    assert choose({"a": (0, BALANCE_ABS * 2), "b": (0, BALANCE_ABS)}, {"a": 1024}) == "a"  # within 1.5x


async def test_an_image_is_recognised_by_its_bytes_and_decoded_only_when_sent():
    """The same data URL again: its content hash and size from memory, no decode — until it must be sent,
    when it decodes to what it did; other bytes of the same pixels are decoded; the oldest is forgotten."""
    from concurrent.futures import ThreadPoolExecutor

    from services.frontend.media import DecodedImage, MediaLoader
    from services.frontend.seen_images import RecognisedImage, SeenImages
    from services.frontend.settings import FrontendSettings

    image = make_image(60, 48, 64)
    png, jpeg, other = data_url(image), data_url(image, "JPEG"), data_url(make_image(61, 48, 64))
    loader = MediaLoader(FrontendSettings(), ThreadPoolExecutor(2), seen=SeenImages(capacity=2))
    first = await loader.load(png)
    again = await loader.load(png)
    assert isinstance(first, DecodedImage) and isinstance(again, RecognisedImage)
    assert (again.content_hash, again.height, again.width) == (first.content_hash, 48, 64)
    assert (loader.decoded, loader.recognised) == (1, 1)
    decoded = await loader.decode(again)
    assert decoded.content_hash == first.content_hash and np.array_equal(decoded.pixels, first.pixels)
    assert isinstance(await loader.load(jpeg), DecodedImage)  # other bytes: decoded (other pixels, too)
    assert isinstance(await loader.load(other), DecodedImage)  # a third: the least recently used goes
    assert isinstance(await loader.load(png), DecodedImage) and loader.decoded == 5
    await loader.close()


def test_a_returning_image_is_neither_decoded_encoded_nor_moved(epd, reference):
    """Turn 2 goes to the worker holding turn 1 — though it is the busier one — with the image left out:
    no decode at the frontend, no encode job, no embedding pulled; HF's answer."""
    chat = Chat("one").user(DESCRIBE, make_image(61, 112, 112))
    before = figures(epd)
    chat.assistant(chat.ask(epd))
    after_first = figures(epd)
    (holder,) = served(before, after_first)
    load = text_job(40, 100_000, seed=1)  # keeps the holder busy until cancelled
    threading.Thread(target=lambda: asyncio.run(_submit(epd, holder, [load])), daemon=True).start()
    until(lambda: metric(epd, "epd_service_stat", instance=holder, stat="running") >= 1,
          "the frontend to list the holder as busy")
    try:
        chat.user("And what colour is it mostly?")
        answer = chat.ask(epd)
    finally:
        cancel(epd, load.request_id)
    after = figures(epd)
    assert served(after_first, after) == [holder]
    assert total(after_first, after, "images_decoded", "frontend") == 0
    assert total(after_first, after, "images_recognised", "frontend") == 1
    assert total(after_first, after, "images_cached", "frontend") == 1
    assert total(after_first, after, "images_encoded", "frontend") == 0
    assert total(after_first, after, "pixel_bytes_published", "frontend") == 0
    assert total(after_first, after, "cache_hits", "encoder") + total(after_first, after, "images", "encoder") == 0
    assert total(after_first, after, "embedding_bytes_pulled", "language") == 0
    assert change(after_first, after, "images_cached", "language")[holder] == 1
    assert answer == chat.expected(reference)


def test_an_image_evicted_after_the_lookup_is_sent_again_exactly(epd, reference):
    """The frontend looks turn 2 up (turn 1's image is cached), then waits on the (stopped) encoder for the
    turn's new image while the holder's pool is turned over; the holder refuses the image it no longer
    holds, the frontend decodes and encodes it and sends both: HF's answer."""
    first, second = make_image(62, 112, 112), make_image(63, 84, 140)
    chat = Chat("two").user(DESCRIBE, first)
    before = figures(epd)
    chat.assistant(chat.ask(epd))
    after_first = figures(epd)
    (holder,) = served(before, after_first)
    chat.user("Compare it with this one.", second)
    encoder = next(p for kind, p in epd.stack.processes if kind == "encoder")
    encoder.send_signal(signal.SIGSTOP)
    answers: list = []
    try:
        asking = threading.Thread(target=lambda: answers.append(chat.ask(epd)), daemon=True)
        asking.start()
        until(lambda: total(after_first, figures(epd), "prefix_lookups", "frontend") >= 1
              and total(after_first, figures(epd), "images_decoded", "frontend") >= 1, "the lookup")
        evicted = after_first[holder]["kv_blocks_evicted"]
        pool = after_first[holder]["kv_blocks_total"]
        # 900 tokens take 57 of the 127 blocks: five such prompts evict at least 285 - 127 blocks, a whole pool
        # however many were free (four, on a worker that had served little, evicted as few as 101)
        asyncio.run(_submit(epd, holder, [text_job(900, 1, seed=10 + i) for i in range(5)]))
        until(lambda: figures(epd)[holder]["kv_blocks_evicted"] - evicted >= pool, "the holder's pool to turn over")
    finally:
        encoder.send_signal(signal.SIGCONT)
    asking.join(60)
    after = figures(epd)
    assert change(after_first, after, "prefix_refused", "language")[holder] == 1
    assert total(after_first, after, "images_decoded", "frontend") == 2  # the new image, then the returning one
    assert answers == [chat.expected(reference)]


def test_with_every_encoder_stopped_a_cached_conversation_is_answered(epd, reference):
    """The encoders stop; a conversation whose image a language worker holds is answered as before, one
    that brings a new image gets 503 naming the encoder."""
    chat = Chat("three").user(DESCRIBE, make_image(64, 112, 112))
    chat.assistant(chat.ask(epd))
    for kind, process in epd.stack.processes:
        if kind == "encoder":
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    until(lambda: metric(epd, "epd_workers", kind="encoder") == 0, "the frontend to list no encoder")
    chat.user("What else is in it?")
    assert chat.ask(epd) == chat.expected(reference)
    chat.assistant("Nothing else.").user("And in this one?", make_image(65, 56, 56))
    with pytest.raises(openai.APIStatusError) as err:
        chat.ask(epd)
    assert err.value.status_code == 503 and "encod" in err.value.response.json()["error"]["message"]


# -- the other layouts ----------------------------------------------------------------------------------------
def test_split_prefill_takes_a_returning_image_from_its_prefix_cache(stack, reference):
    """E/P/D: turn 2's image is not pulled by the prefill worker, whose cache holds it; HF's answer."""
    chat = Chat("split").user(DESCRIBE, make_image(66, 112, 112))
    chat.assistant(chat.ask(stack))
    before = figures(stack)
    chat.user("Is there any text in it?")
    assert chat.ask(stack) == chat.expected(reference)
    after = figures(stack)
    assert total(before, after, "images_pulled", "prefill") == 0
    assert total(before, after, "images_cached", "prefill") == 1
    assert total(before, after, "images_decoded", "frontend") == 0


@pytest.fixture(scope="module")
def aggregated(nats_url, tiny_model):
    running = RunningStack(nats_url, tiny_model).start(encoders=0, prefills=0, decodes=0, aggregated=1)
    yield running
    running.stop()


def test_an_aggregated_worker_encodes_only_the_new_image_of_a_turn(aggregated, reference):
    """Turn 2 brings a new image: it goes as pixels and is encoded in place, the returning one is left
    out (not decoded, not sent); HF's answer."""
    chat = Chat("aggregated").user(DESCRIBE, make_image(67, 112, 112))
    chat.assistant(chat.ask(aggregated))
    before = figures(aggregated)
    chat.user("And how does this one differ?", make_image(68, 84, 84))
    assert chat.ask(aggregated) == chat.expected(reference)
    after = figures(aggregated)
    assert total(before, after, "images_in_place", "aggregated") == 1
    assert total(before, after, "images_cached", "aggregated") == 1
    assert total(before, after, "images_decoded", "frontend") == 1
