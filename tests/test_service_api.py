"""The NATS service API as standard tooling reads it: true request, error and processing-time counters,
instances pingable by id; and liveness that is NATS's own evidence, never a slow answer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import nats
from nats.micro.service import ServiceInfo, ServiceStats

from shared.bus.calls import gather_replies
from shared.bus.directory import Directory
from shared.bus.subjects import Subjects
from tests.support import chat_messages, make_image


async def listing(stack, verb: str, name: str) -> list[dict]:
    nc = await nats.connect(stack.stack.nats_url)
    try:
        replies = [json.loads(r) for r in await gather_replies(nc, f"$SRV.{verb}.{name}", wait=0.5)]
    finally:
        await nc.close()
    return [r for r in replies if (r.get("metadata") or {}).get("prefix") == stack.prefix]


def test_stats_count_requests_errors_and_time_truly(stack):
    client = stack.client()
    client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                   messages=chat_messages("count me", [make_image(41, 40, 40)]))

    async def bad_encode_job():
        nc = await nats.connect(stack.stack.nats_url)
        try:
            reply = await nc.request(Subjects(stack.prefix).encode, b"\x92not a job", timeout=10)
            return reply.headers
        finally:
            await nc.close()

    assert asyncio.run(bad_encode_job())["Nats-Service-Error-Code"] == "400"
    stats = [ServiceStats.from_dict(s) for s in asyncio.run(listing(stack, "STATS", "epd-encoder"))]
    encode = [e for s in stats for e in s.endpoints if e.name in ("encode", "encode-direct")]
    assert sum(e.num_requests for e in encode) >= 2
    assert sum(e.num_errors for e in encode) >= 1 and any(e.last_error.startswith("400") for e in encode)
    served = [e for e in encode if e.num_requests]
    assert all(e.processing_time > 0 and e.average_processing_time > 0 for e in served)
    prefill = [e for s in asyncio.run(listing(stack, "STATS", "epd-prefill")) for e in s["endpoints"]]
    assert sum(e["num_requests"] for e in prefill) >= 1 and all(e["processing_time"] >= 0 for e in prefill)


def test_every_instance_answers_ping_and_info_under_its_own_id(stack):
    infos = [ServiceInfo.from_dict(i) for i in asyncio.run(listing(stack, "INFO", "epd-decode"))]
    assert infos and all(i.id == i.metadata["instance"] and i.id.startswith("decode-") for i in infos)
    assert {"reserve", "kv", "start"} <= {e.name for i in infos for e in i.endpoints}

    async def ping(instance: str) -> dict:
        nc = await nats.connect(stack.stack.nats_url)
        try:
            return json.loads((await nc.request(f"$SRV.PING.epd-decode.{instance}", b"", timeout=5)).data)
        finally:
            await nc.close()

    assert asyncio.run(ping(infos[0].id))["id"] == infos[0].id


def test_a_stuck_worker_is_not_dead_and_a_killed_one_is_gone_at_once(stack):
    process = stack.stack.spawn("encoder")
    stack.wait_for({"encoder": 3})

    async def watch() -> tuple[bool, float]:
        nc = await nats.connect(stack.stack.nats_url)
        directory = Directory(nc, stack.prefix)
        directory.start()
        try:
            await directory.refreshed.wait()
            [mine] = [e for e in directory.of("encoder") if e.metadata.get("pid") == str(process.pid)]
            with directory.watching(mine.instance) as gone:
                os.kill(process.pid, signal.SIGSTOP)  # alive, answering nothing: slow is not dead
                stuck = not await _set_within(gone, 4.0)
                os.kill(process.pid, signal.SIGKILL)
                killed = time.monotonic()
                await asyncio.wait_for(gone.wait(), 5)
                return stuck, time.monotonic() - killed
        finally:
            await directory.stop()
            await nc.close()

    try:
        stuck, seconds = asyncio.run(watch())
    finally:
        process.kill()
        process.wait()
        stack.stack.processes = [(k, p) for k, p in stack.stack.processes if p is not process]
    assert stuck, "a frozen worker was declared gone"
    assert seconds < 3.5


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
