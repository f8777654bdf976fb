"""KV hand-off failures against a real decode worker (the test plays a prefill that dies half-way):
reserved blocks come back, and the request's stream gets an error — never a normal finish."""

from __future__ import annotations

import asyncio
import secrets
import time

import nats
import pytest
import torch

from launcher.stack import Stack
from shared.bus.calls import call, endpoint_data, service_stats
from shared.bus.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.messages.sampling import SamplingParams
from shared.messages import pack, unpack
from shared.messages.control import Cancel
from shared.messages.decode import DecodeStart, KVChunk, KVReservation, KVReserve
from shared.messages.stream import TokenEvent
from shared.model.config import ModelConfig


@pytest.fixture(scope="module")
def decode_worker(nats_url, tiny_model):
    prefix = "kv" + str(int(time.time() * 1000) % 10**8)
    env = {"EPD_MODEL": str(tiny_model), "EPD_SUBJECT_PREFIX": prefix, "EPD_KV_CACHE_MB": "16",
           "EPD_RESERVATION_TIMEOUT": "6", "EPD_LOG_LEVEL": "warning"}
    stack = Stack.start_nats({**__import__("os").environ, **env}, nats_url)
    stack.spawn("decode")
    asyncio.run(stack.wait_ready({"decode": 1}, timeout=120, prefix=prefix))
    yield Subjects(prefix), ModelConfig.from_checkpoint(tiny_model)
    stack.stop(grace=10)


async def _decode_stats(nc, subjects) -> dict:
    for stats in await service_stats(nc, "epd-decode", wait=0.3):
        if stats["metadata"]["prefix"] == subjects.prefix:
            return endpoint_data(stats)
    raise AssertionError("decode worker not found")


def _kv(config: ModelConfig, layers: int, tokens: int) -> torch.Tensor:
    t = config.text
    return torch.randn(layers, 2, tokens, t.num_kv_heads, t.head_dim)


async def test_prefill_dying_mid_transfer_frees_blocks_and_reports_an_error(decode_worker, nats_url):
    subjects, config = decode_worker
    nc = await nats.connect(nats_url)
    plane = DataPlane()
    await plane.start()
    try:
        stream = subjects.stream("half-way")
        events = await nc.subscribe(stream)
        reply = await call(nc, subjects.decode, pack(KVReserve(request_id="half-way", num_tokens=20, max_tokens=8,
                                                                   stream=stream)), 10, "decode")
        decode_id = unpack(KVReservation, reply).decode_id
        held = await _decode_stats(nc, subjects)
        assert held["reservations"] == 1 and held["kv_blocks_used"] > 0
        chunk = KVChunk(request_id="half-way", first_layer=0, last_layer=1, kv=plane.publish(_kv(config, 1, 20)))
        await call(nc, subjects.decode_kv(decode_id), pack(chunk), 10, "decode")
        # ... and the prefill dies: no second chunk, no start. The reservation expires (6 s here).
        event = unpack(TokenEvent, (await events.next_msg(timeout=10)).data)
        assert event.error is not None and event.error.status == 504 and event.finish_reason is None
        after = await _decode_stats(nc, subjects)
        assert after["reservations"] == 0 and after["kv_blocks_used"] == 0
        assert after["reservations_expired"] >= 1

        # a start arriving after the expiry is refused, not run on missing KV
        start = DecodeStart(request_id="half-way", token_ids=[5] * 21, prompt_len=20, rope_delta=0,
                            sampling=SamplingParams(temperature=0), stream=stream)
        with pytest.raises(Exception, match="no reservation"):
            await call(nc, subjects.decode_start(decode_id), pack(start), 10, "decode")
    finally:
        await plane.stop()
        await nc.close()


async def test_a_prefill_gone_after_reserving_ends_its_reservation_at_once(decode_worker, nats_url):
    """The decode worker watches the prefill that reserved: once NATS has nobody at its service PING
    (the process is gone), the reservation ends and the stream hears why within about a second — not
    after --reservation-timeout, which a request used to wait out before it resumed elsewhere."""
    subjects, _ = decode_worker
    nc = await nats.connect(nats_url)
    prefill_id = f"prefill-{secrets.token_hex(6)}"

    async def pong(msg):
        await msg.respond(b"{}")

    alive = await nc.subscribe(f"$SRV.PING.epd-prefill.{prefill_id}", cb=pong)
    try:
        stream = subjects.stream("sender-gone")
        events = await nc.subscribe(stream)
        await call(nc, subjects.decode, pack(KVReserve(request_id="sender-gone", num_tokens=20, max_tokens=8,
                                                         stream=stream, prefill_id=prefill_id)), 10, "decode")
        await asyncio.sleep(1.5)  # pinged and answering: a slow prefill keeps its reservation
        assert (await _decode_stats(nc, subjects))["reservations"] == 1
        await alive.unsubscribe()
        gone = time.monotonic()
        event = unpack(TokenEvent, (await events.next_msg(timeout=4)).data)
        assert event.error is not None and event.error.status == 504 and "is gone" in event.error.message
        assert time.monotonic() - gone < 4  # the reservation timeout here is 6 s
        after = await _decode_stats(nc, subjects)
        assert after["reservations"] == 0 and after["kv_blocks_used"] == 0
    finally:
        await nc.close()


async def test_cancel_frees_a_reservation_at_once(decode_worker, nats_url):
    subjects, _ = decode_worker
    nc = await nats.connect(nats_url)
    try:
        await call(nc, subjects.decode, pack(KVReserve(request_id="cancelled", num_tokens=30, max_tokens=4,
                                                         stream=subjects.stream("cancelled"))), 10, "decode")
        assert (await _decode_stats(nc, subjects))["kv_blocks_used"] > 0
        await nc.publish(subjects.cancel, pack(Cancel(request_id="cancelled")))
        deadline = time.monotonic() + 1.0
        while (stats := await _decode_stats(nc, subjects))["kv_blocks_used"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert stats["kv_blocks_used"] == 0 and stats["reservations"] == 0
    finally:
        await nc.close()


async def test_a_cancel_racing_its_reservation_leaves_nothing_reserved(decode_worker, nats_url):
    """A cancel that lands while the decode worker is still reserving (its engine thread takes the
    blocks, the cancel's abort runs right after) must not leave a reservation behind: none is held a
    moment later, not one per race until ``--reservation-timeout``."""
    from shared.bus.calls import ServiceCallError

    subjects, _ = decode_worker
    nc = await nats.connect(nats_url)
    try:
        async def reserve_and_cancel(i: int) -> None:
            rid = f"race-{i}"
            reply = asyncio.ensure_future(call(nc, subjects.decode, pack(KVReserve(
                request_id=rid, num_tokens=30, max_tokens=4, stream=subjects.stream(rid))), 10, "decode"))
            await asyncio.sleep(i * 0.0002)  # the reserves queue for the engine thread: some cancels land
            await nc.publish(subjects.cancel, pack(Cancel(request_id=rid)))  # before, some during, some after
            try:
                await reply
            except ServiceCallError as err:
                assert err.status == 499, err  # refused: cancelled first
        await asyncio.gather(*(reserve_and_cancel(i) for i in range(60)))  # before the fix: 31 of 60 left held
        deadline = time.monotonic() + 2.0
        while ((stats := await _decode_stats(nc, subjects))["reservations"] or stats["kv_blocks_used"]) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert stats["reservations"] == 0 and stats["kv_blocks_used"] == 0, stats
    finally:
        await nc.close()


def test_requests_wait_for_room_on_a_full_decode_worker(nats_url, tiny_model):
    """Overload queues instead of failing: a decode worker whose KV pool holds one of these prompts at a
    time serves three sent together, one after the other; prefill counts the waits."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support import RunningStack

    running = RunningStack(nats_url, tiny_model)
    try:
        running.spawn("decode", "--kv-cache-mb", "1", "--max-model-len", "2000")  # 127 blocks of 16 tokens
        running.start(encoders=0, decodes=0)  # the others start beside it
        running.wait_for({"decode": 1})
        client = running.client()
        model = client.models.list().data[0].id
        prompt = " ".join(["stack"] * 290)

        def ask(i: int):
            return client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                  messages=[{"role": "user", "content": f"{i} {prompt}"}])

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, range(3)))
        assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 4 for a in answers)
        assert min(a.usage.prompt_tokens for a in answers) > 127 * 16 // 2  # two never fit together
        prefill = endpoint_data(running.stats_sync("epd-prefill")[0])
        assert prefill["decode_full_waits"] >= 1
    finally:
        running.stop()
