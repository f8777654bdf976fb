"""Precomputed image embeddings (vLLM's ``image_embeds`` content parts) through the shared stack (two
encoders, prefill, decode) and the official openai client: the rows HF's vision tower makes of an image,
sent with their grid, give the answer the image gives as pixels — which is HF generate()'s — with no
encoder touched; beside pixel images too. A payload that does not fit the model, or that is a pickle,
is a 400 that says why. (Without encoders: tests/test_stack.py; the aggregated process:
tests/test_video.py; Qwen3-VL's deepstack levels: tests/test_qwen3_stack.py.)"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch

from tests.support import chat_messages, data_url, hf_image_embeds, image_embeds_part, make_image, openai_chat

TEXT = "Describe the image in one sentence."
MAX_TOKENS = 12


def encoded_images(stack) -> int:
    """Images the frontend sent to the encoders (cache hits there included)."""
    [frontend] = stack.figures("frontend")
    return frontend["images_encoded"]


def left_out(stack) -> int:
    """Images the frontend did not send at all: the prefill worker's prefix cache held them."""
    [frontend] = stack.figures("frontend")
    return frontend["images_cached"]


def with_parts(parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": parts + [{"type": "text", "text": TEXT}]}]


@pytest.mark.parametrize("fmt,stream", [("safetensors", False), ("npy", True)])
def test_image_embeds_answer_as_the_image_does_without_an_encoder(stack, reference, fmt, stream):
    image = make_image(41, 100, 150)
    expected = reference.text(reference.generate(TEXT, [image], MAX_TOKENS))
    client = stack.client()
    encoded = encoded_images(stack)
    answer, usage = openai_chat(client, with_parts([image_embeds_part(*hf_image_embeds(reference, image), fmt)]),
                                MAX_TOKENS, stream)
    assert answer == expected
    assert usage.prompt_tokens == reference.inputs(TEXT, [image])["input_ids"].shape[1]
    assert encoded_images(stack) == encoded  # no encoder saw it
    skipped = left_out(stack)
    assert openai_chat(client, chat_messages(TEXT, [image]), MAX_TOKENS)[0] == expected  # the pixels agree
    # encoded, or (asked before, by the other case) left out: the prefill worker holds its KV
    assert encoded_images(stack) + left_out(stack) == encoded + skipped + 1


def test_image_embeds_beside_pixel_images(stack, reference):
    """Mixed parts: the pixel images go to the encoders, the embeddings straight to the prefill worker, each
    into its own place in the prompt."""
    first, second = make_image(42, 64, 96), make_image(43, 80, 80)
    expected = reference.text(reference.generate(TEXT, [first, second], MAX_TOKENS))
    parts = [image_embeds_part(*hf_image_embeds(reference, first)),
             {"type": "image_url", "image_url": data_url(second)}]
    assert openai_chat(stack.client(), with_parts(parts), MAX_TOKENS)[0] == expected
    counted = httpx.post(stack.base_url.removesuffix("/v1") + "/tokenize", json={"messages": with_parts(parts)},
                         timeout=60)
    assert counted.json()["count"] == reference.inputs(TEXT, [first, second])["input_ids"].shape[1]


def test_bfloat16_rows_are_read_exactly(stack, reference):
    """bfloat16 rows (numpy has no such type; read as their 16-bit words and widened) give the answer their
    float32 values give: the widening loses nothing."""
    rows, grid = hf_image_embeds(reference, make_image(44, 72, 90))
    rows = rows.to(torch.bfloat16)
    client = stack.client()
    as_bf16 = openai_chat(client, with_parts([image_embeds_part(rows, grid)]), MAX_TOKENS)[0]
    assert as_bf16 == openai_chat(client, with_parts([image_embeds_part(rows.float(), grid)]), MAX_TOKENS)[0]


def _refusal(stack, parts: list[dict]) -> str:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=with_parts(parts), max_tokens=2)
    return err.value.response.json()["error"]["message"]


def test_image_embeds_that_do_not_fit_the_model_are_a_400_saying_why(stack, reference):
    rows, grid = hf_image_embeds(reference, make_image(44, 64, 64))
    assert "4 rows" in _refusal(stack, [image_embeds_part(rows[:3], grid)])  # the grid takes 4
    assert "width" in _refusal(stack, [image_embeds_part(rows[:, :32], grid)])
    assert "image_grid_thw" in _refusal(stack, [image_embeds_part(rows, grid.float())])
    bare = {"type": "image_embeds", "image_embeds": image_embeds_part(rows, grid)["image_embeds"]["image_embeds"]}
    assert "needs its image_grid_thw" in _refusal(stack, [bare])
    many = [image_embeds_part(rows, grid)] * 17  # the image count limit (16) counts them as images
    assert "too many images" in _refusal(stack, many)


def test_a_torch_save_payload_is_refused_with_what_to_send_instead(stack, reference):
    """vLLM's clients send torch.save (pickle) bytes; a pickle from a client is never loaded here."""
    rows, grid = hf_image_embeds(reference, make_image(45, 64, 64))
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    part = image_embeds_part(rows, grid)
    part["image_embeds"]["image_embeds"] = base64.b64encode(buffer.getvalue()).decode()
    message = _refusal(stack, [part])
    assert "pickle" in message and "safetensors" in message and ".npy" in message
