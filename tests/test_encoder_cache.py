"""Embedding caches: a repeated image skips the ViT on its encoder, is borrowed across encoders, is encoded
once however many requests carry it at the same time, and survives the death of the encoder holding it."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest
import torch
from PIL import Image

from services.encoder.cache import Embedding, EmbeddingCache
from services.encoder.fingerprint import encoder_fingerprint
from services.frontend.media import content_hash
from services.frontend.routing import EncoderRouter, assign
from shared.bus.watched import Target
from shared.bus.directory import Directory
from shared.bus.calls import call
from shared.bus.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.embedding_index import embedding_key
from shared.messages import pack, unpack
from shared.messages.encode import EncodeJob, EncodeResult
from tests.support import RunningStack, chat_messages, endpoint_data, make_image

# -- the cache key, the cache, the routing policy (no processes) ------------------------------------------


def test_same_pixels_in_other_dimensions_get_other_keys():
    pixels = np.asarray(make_image(1, 56, 112))
    transposed_shape = pixels.reshape(112, 56, 3)  # the very same bytes, other width and height
    assert pixels.tobytes() == transposed_shape.tobytes()
    a, b = content_hash(pixels), content_hash(transposed_shape)
    assert a != b
    assert embedding_key(a, "fp") != embedding_key(b, "fp")
    assert embedding_key(a, "fp") == embedding_key(content_hash(pixels.copy()), "fp")
    assert embedding_key(a, "fp") != embedding_key(a, "other-model")


def test_fingerprint_covers_preprocessing_weights_and_dtype(tiny_model, tmp_path):
    base = encoder_fingerprint(tiny_model, "auto", "torch.float32", "pil")
    assert base == encoder_fingerprint(tiny_model, "auto", "torch.float32", "pil")
    assert base != encoder_fingerprint(tiny_model, "auto", "torch.bfloat16", "pil")
    assert base != encoder_fingerprint(tiny_model, "auto", "torch.float32", "torch")  # PIL and torch round apart
    resized = shutil.copytree(tiny_model, tmp_path / "resized")
    config = json.loads((resized / "preprocessor_config.json").read_text())
    (resized / "preprocessor_config.json").write_text(json.dumps({**config, "image_mean": [0.5, 0.5, 0.5]}))
    assert base != encoder_fingerprint(resized, "auto", "torch.float32", "pil")
    on_device = encoder_fingerprint(tiny_model, "auto", "torch.float32", "torch")
    assert on_device != encoder_fingerprint(resized, "auto", "torch.float32", "torch")
    retrained = shutil.copytree(tiny_model, tmp_path / "retrained")
    weights = bytearray((retrained / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (retrained / "model.safetensors").write_bytes(bytes(weights))
    assert base != encoder_fingerprint(retrained, "auto", "torch.float32", "pil")


def test_preprocessing_on_the_device_loads_no_transformers(tiny_model):
    """A GPU encoder (``--preprocess torch``) reads its image settings itself: importing HF's image
    processor would cost ~2.5 s of CPU at every start."""
    probe = ("import sys; from pathlib import Path; "
             "from services.encoder.fingerprint import encoder_fingerprint; "
             "from shared.model.processor import TorchImagePreprocessor; "
             f"path = Path({str(tiny_model)!r}); TorchImagePreprocessor(path); "
             "encoder_fingerprint(path, 'auto', 'torch.float32', 'torch'); "
             "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1]).returncode == 0


def _embedding(tokens: int) -> Embedding:
    return Embedding(torch.zeros(tokens, 256), (1, 2, 2 * tokens))  # 1 KiB per token


def test_cache_is_lru_bounded_in_bytes():
    cache = EmbeddingCache(max_bytes=5 * 1024)
    assert cache.put("a", _embedding(2)) == [] and cache.put("b", _embedding(2)) == []
    assert cache.get("a") is not None  # "a" is now the most recently used
    evicted = cache.put("c", _embedding(2))
    assert [k for k, _ in evicted] == ["b"] and cache.bytes_held == 4 * 1024
    assert cache.get("b") is None and (cache.hits, cache.misses, cache.evictions) == (1, 1, 1)
    assert cache.put("huge", _embedding(6)) == [] and "huge" not in cache  # larger than the whole cache
    batch = torch.zeros(8, 256)
    cache.put("view", Embedding(batch[:1], (1, 2, 2)))  # a slice of a ViT batch keeps only its own bytes
    assert cache.peek("view").tensor.untyped_storage().nbytes() == 1024


def test_routing_prefers_the_live_holder_then_spreads_new_images():
    idle = {"a": 0, "b": 0}
    # A known holder gets its image even when busy; a dead holder is ignored.
    busy = {"a": 9, "b": 0}
    assert assign(["h1"], busy, ["a"]) == ["a"]
    assert assign(["h1"], busy, ["gone"]) == ["b"]
    # New images of one request spread over idle encoders; a repeated image stays with its first copy.
    targets = assign([f"img{i}" for i in range(4)] + ["img0"], idle, [None] * 5)
    assert {targets.count(x) for x in "ab"} <= {2, 3} and targets[4] == targets[0]
    # A margin keeps an image on its favourite although another encoder is a little less busy.
    favourite = assign(["x"], idle, [None])[0]
    loaded = {e: 2 if e == favourite else 0 for e in idle}
    assert assign(["x"], loaded, [None], margin=2) == [favourite]
    assert assign(["x"], loaded, [None], margin=1) != [favourite]


async def test_with_nothing_listed_images_go_to_the_queue_group(nats_url):
    """Before discovery has answered (or without it), NATS picks — and answers when nobody serves."""
    nc = await nats.connect(nats_url)
    try:
        router = EncoderRouter(nc, Directory(nc, "empty"), Subjects("empty"), margin=0)
        assert await router.targets(["x", "y"]) == [Target("empty.encode")] * 2
    finally:
        await nc.close()


async def test_a_failed_encode_goes_to_another_listed_encoder_it_can_watch(nats_url):
    """After a failure the image goes to the least loaded listed encoder not found gone (or failing it)
    — its own subject, so its death is noticed within a second — and to the queue group only when no
    other is listed: a queue group's job handed to a process that just died waits out the whole timeout."""
    from shared.bus.directory import Instance

    nc = await nats.connect(nats_url)
    try:
        directory = Directory(nc, "s")
        router = EncoderRouter(nc, directory, Subjects("s"), margin=0)
        directory.instances = [Instance("encoder", "encoder-a", data={"in_flight": 0}),
                               Instance("encoder", "encoder-b", data={"in_flight": 3}),
                               Instance("encoder", "encoder-c", data={"in_flight": 1, "draining": True})]
        assert router.retarget(set()) == Target("s.encode.encoder-a", "encoder-a")  # least loaded, not draining
        assert router.retarget({"encoder-a"}) == Target("s.encode.encoder-b", "encoder-b")
        assert router.retarget({"encoder-a", "encoder-b"}) == Target("s.encode")
    finally:
        await nc.close()


# -- a stack of two encoders whose processes the tests tell apart ------------------------------------------


class CacheStack:
    def __init__(self, running: RunningStack, first: str, second: str, second_process):
        self.running = running
        self.first = first  # encoder instance ids
        self.second = second
        self.second_process = second_process

    def encoders(self) -> dict[str, dict]:
        return {endpoint_data(s)["instance"]: endpoint_data(s) for s in self.running.stats_sync("epd-encoder")}

    def left_out(self) -> int:
        """Images the frontend left out of prefill jobs (the worker's prefix cache held them)."""
        return sum(f["images_cached"] for f in self.running.figures("frontend"))

    def vit_images(self) -> dict[str, int]:
        return {k: v["images"] for k, v in self.encoders().items()}

    def ask(self, images: list[Image.Image]):
        client = self.running.client()
        return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2, temperature=0,
                                              messages=chat_messages("Describe.", images))

    def encode_on(self, instance: str, image: Image.Image) -> tuple[EncodeResult, torch.Tensor]:
        """An encode job sent straight to one encoder, as the frontend would; returns the result and embeddings."""
        return asyncio.run(self._encode_on(instance, np.asarray(image)))

    async def _encode_on(self, instance: str, pixels: np.ndarray) -> tuple[EncodeResult, torch.Tensor]:
        nc = await nats.connect(self.running.stack.nats_url)
        plane = DataPlane("zmq")
        await plane.start()
        try:
            handle = plane.publish(torch.from_numpy(pixels.copy()), consumers=None)
            job = EncodeJob(request_id="test", image=handle, content_hash=content_hash(pixels))
            reply = await call(nc, Subjects(self.running.prefix).encode_on(instance), pack(job), 60, "encoder")
            result = unpack(EncodeResult, reply)
            return result, (await plane.pull(result.embedding)).clone()
        finally:
            await plane.stop()
            await nc.close()


SPARE_CACHE_MB = 512  # the encoder the last test kills is told apart by its cache size


@pytest.fixture(scope="module")
def cache_stack(nats_url, tiny_model):
    running = RunningStack(nats_url, tiny_model)
    try:
        spare = running.stack.spawn("encoder", "--encoder-cache-mb", str(SPARE_CACHE_MB))
        running.start(encoders=1)
        running.wait_for({"encoder": 2})
        by_capacity = {endpoint_data(s)["cache_capacity_bytes"]: endpoint_data(s)["instance"]
                       for s in running.stats_sync("epd-encoder")}
        second = by_capacity.pop(SPARE_CACHE_MB << 20)
        yield CacheStack(running, by_capacity.popitem()[1], second, spare)
    finally:
        running.stop()


def test_a_repeated_image_is_encoded_once_and_counted_at_metrics(cache_stack):
    image = make_image(500, 64, 64)
    before = cache_stack.encoders()
    cache_stack.ask([image])
    middle = cache_stack.encoders()
    assert sum(middle[k]["images"] - before[k]["images"] for k in before) == 1
    cache_stack.ask([image])
    after = cache_stack.encoders()
    assert sum(after[k]["images"] - middle[k]["images"] for k in before) == 0, "the second request ran the ViT"
    hits = {k: after[k]["cache_hits"] - middle[k]["cache_hits"] for k in before}
    assert sum(hits.values()) == 1
    assert all(v["jobs_arriving"] == 0 for v in after.values())  # a cache hit leaves no job counted arriving

    holder = next(k for k, v in hits.items() if v == 1)
    service_id = next(s["id"] for s in cache_stack.running.stats_sync("epd-encoder")
                      if endpoint_data(s)["instance"] == holder)
    metrics = httpx.get(cache_stack.running.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = re.search(rf'epd_service_stat\{{instance="{service_id}",service="epd-encoder",stat="cache_hits"\}} (\S+)',
                      metrics)
    assert found and float(found.group(1)) >= 1, metrics[-2000:]
    for stat in ("cache_misses", "cache_bytes", "batch_size_le_1", "images_per_s", "queue_depth", "bytes_held"):
        assert f'stat="{stat}"' in metrics
    for stage in ("media", "encode", "first_token"):  # the frontend's own per-stage timings
        found = re.search(rf'epd_stage_seconds_count\{{stage="{stage}"\}} (\S+)', metrics)
        assert found and float(found.group(1)) >= 2, stage


def test_an_encoder_borrows_an_image_another_encoder_holds(cache_stack):
    image = make_image(501, 72, 96)
    before = cache_stack.encoders()
    cache_stack.ask([image])
    after = cache_stack.encoders()
    holder = next(k for k in before if after[k]["images"] > before[k]["images"])
    other = cache_stack.second if holder == cache_stack.first else cache_stack.first

    borrowed, embeds = cache_stack.encode_on(other, image)
    assert borrowed.cached and borrowed.encoder_id == other
    final = cache_stack.encoders()
    assert final[other]["images"] == after[other]["images"], "the other encoder ran the ViT instead of borrowing"
    assert final[other]["cache_borrowed"] == after[other]["cache_borrowed"] + 1
    assert final[holder]["cache_lent"] == after[holder]["cache_lent"] + 1

    held, held_embeds = cache_stack.encode_on(holder, image)
    assert held.cached and tuple(held.grid) == tuple(borrowed.grid)
    assert torch.equal(embeds, held_embeds)
    again, _ = cache_stack.encode_on(other, image)  # now in the borrower's own cache
    assert again.cached and cache_stack.encoders()[other]["cache_borrowed"] == final[other]["cache_borrowed"]


def test_same_pixels_in_other_dimensions_are_both_encoded(cache_stack):
    pixels = np.asarray(make_image(502, 56, 112))
    wide, tall = Image.fromarray(pixels), Image.fromarray(pixels.reshape(112, 56, 3))
    before = cache_stack.vit_images()
    assert cache_stack.ask([wide, tall]).choices[0].finish_reason == "length"
    after = cache_stack.vit_images()
    assert sum(after.values()) - sum(before.values()) == 2


def test_ten_concurrent_requests_for_one_new_image_run_the_vit_once(cache_stack):
    image = make_image(503, 80, 80)
    before, left_out = cache_stack.encoders(), cache_stack.left_out()
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: cache_stack.ask([image]), range(10)))
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    after = cache_stack.encoders()

    def added(stat: str) -> int:
        return sum(after[k][stat] - before[k][stat] for k in before)

    assert added("images") == 1
    # The other nine: joined the encoding under way, hit the cache after it, or borrowed from its encoder —
    # or, routed once the first prompt was in the prefill worker's prefix cache, were not sent at all.
    others = added("cache_joined") + added("cache_hits") + added("cache_borrowed")
    assert others + cache_stack.left_out() - left_out == 9
    assert all(v["jobs_arriving"] == 0 for v in after.values())  # every way out counts the job out once


def test_when_the_holder_dies_the_image_is_encoded_elsewhere(cache_stack):
    image = make_image(504, 64, 80)
    result, _ = cache_stack.encode_on(cache_stack.second, image)  # the second encoder holds it now
    assert not result.cached
    before = cache_stack.encoders()[cache_stack.first]
    cache_stack.second_process.send_signal(signal.SIGKILL)
    assert cache_stack.second_process.wait(10) == -signal.SIGKILL

    started = time.monotonic()
    answer = cache_stack.ask([image])  # the index (and maybe the directory) still name the dead encoder
    assert answer.choices[0].finish_reason == "length"
    assert time.monotonic() - started < 15
    encoders = cache_stack.encoders()
    assert list(encoders) == [cache_stack.first]
    survivor = encoders[cache_stack.first]
    assert survivor["images"] == before["images"] + 1
    # It found the dead encoder named in the index, failed to borrow from it, and encoded the image itself.
    assert survivor["cache_borrow_failures"] == before["cache_borrow_failures"] + 1


@pytest.mark.parametrize("mode, fmt", [("RGB", "JPEG"), ("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"),
                                       ("CMYK", "JPEG"), ("LA", "PNG"), ("I;16", "PNG")])
def test_decoded_pixels_are_pils_rgb_conversion_in_every_mode(mode, fmt):
    """The frontend's pixels for any mode are what PIL's ``convert("RGB")`` gives (as HF's processor takes
    them); an RGB image skips that copy, which must change nothing."""
    import io

    from PIL import Image

    from services.frontend.media import decode_image

    rng = np.random.default_rng(3)
    base = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    image = base.convert(mode) if mode != "I;16" else Image.fromarray(rng.integers(0, 65536, (37, 53), dtype=np.uint16))
    buf = io.BytesIO()
    image.save(buf, fmt)
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as again:
        expected = np.array(again.convert("RGB"))
    decoded = decode_image(data, 1 << 20)
    assert decoded.pixels.dtype == np.uint8 and decoded.pixels.shape == (37, 53, 3) and decoded.pixels.flags.writeable
    assert np.array_equal(decoded.pixels, expected)
