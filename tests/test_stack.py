"""The stack as operators use it: encoders spread and scale out live; errors are fast and explicit."""

from __future__ import annotations

import signal
import struct
import time
import zlib

import httpx
import openai
import pytest

from tests.support import (RunningStack, chat_messages, endpoint_data, hf_image_embeds, image_embeds_part, make_image,
                           openai_chat)


def encoded_by_instance(stack) -> dict[str, int]:
    return {endpoint_data(s)["instance"]: endpoint_data(s)["images"] for s in stack.stats_sync("epd-encoder")}


def ask(stack, images, text="Describe.", **kwargs):
    client = stack.client()
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=chat_messages(text, images), max_tokens=4, temperature=0,
                                          **kwargs)


def test_one_requests_images_spread_over_both_encoders(stack):
    before = encoded_by_instance(stack)
    assert len(before) == 2
    ask(stack, [make_image(100 + i, 64, 64) for i in range(4)])
    after = encoded_by_instance(stack)
    assert all(after[k] > before[k] for k in before), (before, after)
    assert sum(after.values()) - sum(before.values()) == 4


def test_an_added_encoder_takes_work_without_restarting_anything(stack):
    process = stack.stack.spawn("encoder")
    try:
        stack.wait_for({"encoder": 3}, timeout=120)
        assert process.poll() is None
        before = encoded_by_instance(stack)
        ask(stack, [make_image(200 + i, 64, 64) for i in range(6)])
        after = encoded_by_instance(stack)
        new = (set(after) - {k for k, v in before.items() if v > 0}) or set(after)
        assert any(after[k] > before.get(k, 0) for k in new)
        assert all(after[k] > before[k] for k in before), "every encoder should take part"
    finally:
        process.send_signal(signal.SIGTERM)  # drains: leaves the queue group, finishes, exits
        exited = process.wait(30)
        stack.stack.processes = [(k, p) for k, p in stack.stack.processes if p is not process]
        assert exited == 0


def _post(stack, body, **kwargs):
    return httpx.post(f"{stack.base_url}/chat/completions", timeout=30, **kwargs,
                      **({"json": body} if body is not None else {}))


def _huge_png_header(width: int, height: int) -> str:
    """A PNG that declares a huge size but carries almost no data: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    import base64
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _encoded(image, fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _b64_url(data: bytes, mime: str) -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _animated_gif() -> bytes:
    import io

    frames = [make_image(i, 16, 16) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def _image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "hi"}]}]


BAD_REQUESTS = {
    "missing messages": {"model": "x"},
    "empty messages": {"messages": []},
    "a field we do not honour": {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}},
    "wrong type": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    "bad role": {"messages": [{"role": "robot", "content": "hi"}]},
    "unreadable image": {"messages": _image_message("data:image/png;base64," + "A" * 400)},
    "not base64": {"messages": _image_message("data:image/png;base64,@@@@")},
    "svg image": {"messages": _image_message("data:image/svg+xml;base64,PHN2Zy8+")},
    "oversize image": {"messages": _image_message(_huge_png_header(30000, 30000))},
    "unsupported scheme": {"messages": _image_message("ftp://example.com/a.png")},
    "too many images": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 17}]},
    "max_tokens too large": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7},
    "max_tokens zero": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    "temperature out of range": {"messages": [{"role": "user", "content": "hi"}], "temperature": 5},
    "top_p zero": {"messages": [{"role": "user", "content": "hi"}], "top_p": 0},
    "seed beyond 64 bits": {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64},
    "too many stop strings": {"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 17},
    "content of the wrong type": {"messages": [{"role": "user", "content": 42}]},
    "image part without url": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    "n > 16": {"messages": [{"role": "user", "content": "hi"}], "n": 17},
    "top_logprobs without logprobs": {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    "top_logprobs > 20": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
    "truncated png": {"messages": _image_message(_b64_url(_encoded(make_image(1, 64, 64), "PNG")[:300], "image/png"))},
    "corrupt jpeg": {"messages": _image_message(_b64_url(b"\xff\xd8\xff\xe0" + b"\x00" * 200, "image/jpeg"))},
    "animated gif": {"messages": _image_message(_b64_url(_animated_gif(), "image/gif"))},
    "not an image mime": {"messages": _image_message("data:text/plain;base64,aGVsbG8=")},
    "1,000 image parts": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 1000}]},
    "prompt longer than the context": {"messages": [{"role": "user", "content": "word " * 6000}]},
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_get_400_with_a_message(stack, case):
    response = _post(stack, BAD_REQUESTS[case])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    leaks = ("Traceback", 'File "', "/tmp", "/work", "/home", "site-packages", "tcp://", "127.0.0.1")
    assert not any(leak in error["message"] for leak in leaks), error["message"]


def test_oversize_body_gets_413(stack):
    response = _post(stack, None, content=b"x" * 4_100_000, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(50):
            yield b"x" * 100_000

    response = _post(stack, None, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["message"]


def test_malformed_json_and_wrong_model(stack):
    response = _post(stack, None, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]
    response = _post(stack, {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404 and "gpt-9" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def lean_stack(nats_url, tiny_model):
    """No encoder, one prefill and one decode; the frontend gives prefill 2 s to accept a request, a request
    0.5 s to find a worker of a kind it needs, and takes media (precomputed embeddings too) of 4 KiB at most."""
    running = RunningStack(nats_url, tiny_model, env={"EPD_PREFILL_TIMEOUT": "2", "EPD_WORKER_WAIT": "0.5",
                                                      "EPD_MAX_MEDIA_BYTES": "4096"}).start(encoders=0)
    yield running
    running.stop()


def _kind_process(running, kind):
    return next(p for k, p in running.stack.processes if k == kind)


def test_a_stack_without_encoders_serves_precomputed_image_embeds(lean_stack, reference):
    """Image requests need an encoder; a request with the image's embeddings does not: its answer is the
    image's (HF generate()). The embeddings' byte limit is a setting (here 4 KiB: 16 rows of 64 floats)."""
    image = make_image(46, 64, 64)
    part = image_embeds_part(*hf_image_embeds(reference, image))
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}]
    answer = openai_chat(lean_stack.client(), messages, 4)[0]
    assert answer == reference.text(reference.generate("Describe.", [image], 4))
    too_big = image_embeds_part(*hf_image_embeds(reference, make_image(47, 160, 160)))
    with pytest.raises(openai.BadRequestError) as err:
        openai_chat(lean_stack.client(), [{"role": "user", "content": [too_big]}], 4)
    assert "exceeds 4096 bytes" in err.value.response.json()["error"]["message"]


def test_missing_and_stalled_stages_fail_fast(lean_stack):
    image = make_image(1, 16, 16)  # within the stack's 4 KiB media cap
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        ask(lean_stack, [image])
    assert err.value.status_code == 503 and time.monotonic() - started < 2.0
    assert err.value.response.json()["error"]["message"] == "image encoding failed: no encoder is available"

    assert ask(lean_stack, [], text="Text needs no encoder.").choices[0].finish_reason == "length"

    prefill = _kind_process(lean_stack, "prefill")
    prefill.send_signal(signal.SIGSTOP)  # alive but stuck: the stage times out
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            ask(lean_stack, [], text="stuck")
        assert err.value.status_code == 504 and time.monotonic() - started < 10
    finally:
        prefill.send_signal(signal.SIGCONT)

    decode = _kind_process(lean_stack, "decode")
    decode.send_signal(signal.SIGTERM)
    assert decode.wait(30) == 0
    with pytest.raises(openai.APIStatusError) as err:
        ask(lean_stack, [], text="no decode worker")
    assert err.value.status_code == 503 and "decode" in err.value.response.json()["error"]["message"]

    prefill.send_signal(signal.SIGTERM)
    assert prefill.wait(30) == 0
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        ask(lean_stack, [], text="no prefill worker")
    assert err.value.status_code == 503 and time.monotonic() - started < 2.0
    assert err.value.response.json()["error"]["message"] == "no prefill worker is available"
