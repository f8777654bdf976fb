"""Hostile input at every door: pickles on every port, SSRF through image URLs, property-based API
fuzzing from the OpenAPI schema. Nothing is executed, nothing leaks, the stack keeps serving."""

from __future__ import annotations

import asyncio
import http.server
import os
import pickle
import threading

import httpx
import nats
import pytest
import zmq

from shared.bus.calls import gather_replies
from shared.bus.subjects import Subjects
from tests.support import chat_messages, make_image


class Exploit:
    """Unpickling this creates a file: proof of execution if it ever appears."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


async def _service_infos(nc, prefix):
    import json

    return [i for i in map(json.loads, await gather_replies(nc, "$SRV.INFO", wait=0.4))
            if (i.get("metadata") or {}).get("prefix") == prefix]


def test_pickle_payloads_are_rejected_everywhere(stack, tmp_path):
    marker = tmp_path / "executed"
    payload = pickle.dumps(Exploit(str(marker)))
    subjects = Subjects(stack.prefix)

    async def nats_doors():
        nc = await nats.connect(stack.stack.nats_url)
        try:
            infos = await _service_infos(nc, stack.prefix)
            endpoints = {e["subject"] for info in infos for e in info.get("endpoints") or []}
            assert {subjects.encode, subjects.prefill, subjects.decode, subjects.chat} <= endpoints
            for subject in sorted(endpoints):
                reply = await nc.request(subject, payload, timeout=10)
                assert reply.headers and reply.headers.get("Nats-Service-Error-Code", "").startswith("4"), subject
            return [info["metadata"]["data"] for info in infos if info["metadata"].get("data")]
        finally:
            await nc.close()

    data_addresses = asyncio.run(nats_doors())
    assert len(data_addresses) >= 5  # every service's data plane
    context = zmq.Context()
    try:
        for address in data_addresses:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 3000)
            sock.connect(address)
            sock.send_multipart([b"\x00" * 8, payload])
            header = sock.recv_multipart()[1]
            assert b"bad_request" in header  # a typed refusal, not a crash and not an execution
            sock.close()
    finally:
        context.term()
    response = httpx.post(f"{stack.base_url}/chat/completions", content=payload,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400
    assert not marker.exists()
    assert stack.client().models.list().data  # still serving


@pytest.fixture(scope="module")
def local_image_server():
    """An HTTP server on loopback, the kind of target an SSRF aims at."""
    import io

    buf = io.BytesIO()
    make_image(9, 32, 32).save(buf, format="PNG")
    body = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


SSRF_URLS = [
    "http://{local}/image.png",  # plain http is off by default
    "https://{local}/image.png",  # loopback
    "https://127.0.0.1\\@example.com/x.png",  # the backslash-at confusion
    "https://user:pass@{local}/x.png",  # credentials in the URL
    "https://169.254.169.254/latest/meta-data/",  # cloud metadata
    "https://[::1]/x.png",  # IPv6 loopback
    "https://10.0.0.1/x.png",  # private network
    "https://localhost/x.png",  # resolves to loopback
    "file:///etc/passwd",  # no local media directory configured
    "file:///../../etc/passwd",
]


@pytest.mark.parametrize("template", SSRF_URLS)
def test_image_urls_cannot_reach_private_addresses(stack, local_image_server, template):
    url = template.format(local=local_image_server)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "hi"}]}]}
    response = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "127.0.0.1" not in message and "passwd" not in message


def test_local_media_directory_refuses_traversal(tmp_path):
    """file:// works inside the configured directory only (checked in-process against the loader)."""
    from concurrent.futures import ThreadPoolExecutor

    from services.frontend.errors import ApiError
    from services.frontend.media import MediaLoader
    from services.frontend.settings import FrontendSettings

    media = tmp_path / "media"
    media.mkdir()
    make_image(1, 20, 30).save(media / "ok.png")
    (tmp_path / "secret.png").write_bytes((media / "ok.png").read_bytes())
    os.symlink(tmp_path / "secret.png", media / "link.png")
    loader = MediaLoader(FrontendSettings(local_media_dir=str(media)), ThreadPoolExecutor(1))

    async def load(url):
        return await loader.load(url)

    assert asyncio.run(load("file:///ok.png")).width == 30
    for url in ("file:///../secret.png", "file:///%2e%2e/secret.png", "file:///link.png", "file://evil/ok.png"):
        with pytest.raises(ApiError):
            asyncio.run(load(url))


def test_the_stack_serves_after_hostile_input(stack):
    reply = stack.client().chat.completions.create(model=stack.client().models.list().data[0].id,
                                                   messages=chat_messages("still there?", []), max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_a_prompts_image_slots_carry_embeddings_or_pixels_where_they_are_encoded(tiny_model):
    """A prefill job's image slot carries its embeddings, its pixels or neither (cached, with its content
    hash), never two; pixels only to a worker that encodes them (aggregated), a frame sampling only with a
    clip's pixels, embeddings only as floats (a client's precomputed ones pass through here too). Each is a
    400."""
    from services.language.intake import validate_prompt
    from shared.dataplane.handle import TensorHandle
    from shared.messages.sampling import SamplingParams
    from shared.errors import ServiceError
    from shared.messages.encode import VideoSampling
    from shared.messages.prefill import ImageSlot, PrefillJob
    from shared.model.config import ModelConfig

    config = ModelConfig.from_checkpoint(tiny_model)
    grid, tokens = (1, 4, 4), 4  # merge 2: 16 patches, 4 placeholder tokens

    def handle(dtype: str, shape: list[int]) -> TensorHandle:
        size = {"uint8": 1, "float32": 4, "int32": 4}[dtype]
        n = size
        for d in shape:
            n *= d
        return TensorHandle(transport="zmq", address="tcp://127.0.0.1:1", key="k", token="t", dtype=dtype,
                            shape=shape, nbytes=n, expires_at=0)

    embedding = handle("float32", [tokens, config.embedding_width])
    pixels = handle("uint8", [56, 56, 3])
    sampling = VideoSampling(source_fps=10, total_frames=2, frame_indices=[0, 1])

    def job(**slot) -> PrefillJob:
        ids = [1, config.vision_start_token_id, *[config.image_token_id] * tokens, config.vision_end_token_id, 2]
        return PrefillJob(request_id="r", token_ids=ids, images=[ImageSlot(offset=2, grid=grid, **slot)],
                          sampling=SamplingParams(), stream="s")

    validate_prompt(job(embedding=embedding), config)
    validate_prompt(job(pixels=pixels, content_hash="h" * 16), config, pixels=True)
    validate_prompt(job(cached=True, content_hash="h" * 16), config)  # its KV in the prefix cache: checked there
    for slot, worker_encodes, message in [
        (dict(), True, "either its embeddings or its pixels"),
        (dict(embedding=embedding, pixels=pixels), True, "either its embeddings or its pixels"),
        (dict(embedding=embedding, cached=True, content_hash="h" * 16), False, "either its embeddings or its pixels"),
        (dict(cached=True), False, "needs its content hash"),
        (dict(pixels=pixels), False, "does not encode images"),
        (dict(pixels=pixels, sampling=sampling), True, "only a video slot's pixels"),
        (dict(embedding=embedding, sampling=sampling, video=True), True, "only a video slot's pixels"),
        (dict(embedding=handle("int32", [tokens, config.embedding_width])), False, "float32, float16 or bfloat16"),
    ]:
        with pytest.raises(ServiceError) as err:
            validate_prompt(job(**slot), config, pixels=worker_encodes)
        assert err.value.status == 400 and message in err.value.message, slot
