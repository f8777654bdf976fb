"""Input that used to end in a 500 or a vague message: each now gets the right status and a body that
says what is wrong, and the edge cases that are valid get the exact answer."""

from __future__ import annotations

import httpx
import pytest

from tests.support import chat_messages, make_image


def post(stack, content: bytes, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(f"{stack.base_url}/chat/completions", content=content,
                      headers={"content-type": content_type}, timeout=30)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


@pytest.mark.parametrize("size", [(1, 1), (3, 50), (50, 3)], ids=["1x1", "3xN", "Nx3"])
def test_tiny_images_are_answered_exactly_like_hf(stack, reference, size):
    image = make_image(7, *size)
    expected = reference.text(reference.generate("What is this?", [image], 6))
    client = stack.client()
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=6, temperature=0,
                                           messages=chat_messages("What is this?", [image]))
    assert reply.choices[0].message.content == expected


@pytest.mark.parametrize("text", ['"\\ud800"', '"a\\udfffb"'], ids=["high", "low"])
def test_a_lone_surrogate_is_a_400(stack, text):
    response = post(stack, b'{"messages": [{"role": "user", "content": %s}]}' % text.encode())
    assert response.status_code == 400
    assert "surrogate" in error_of(response)["message"]


@pytest.mark.parametrize("content, words", [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "UTF-8"),
    (b'{"messages": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
], ids=["invalid-utf8", "deep-json", "truncated-json"])
def test_unparsable_bodies_say_why(stack, content, words):
    response = post(stack, content)
    assert response.status_code == 400
    error = error_of(response)
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_paths_and_methods_get_openai_error_bodies(stack):
    root = stack.base_url.removesuffix("/v1")
    missing = httpx.get(f"{root}/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and error_of(missing)["type"] == "not_found_error"
    wrong = httpx.get(f"{stack.base_url}/chat/completions", timeout=10)
    assert wrong.status_code == 405 and error_of(wrong)["code"] == 405
    assert stack.client().models.list().data  # still serving
