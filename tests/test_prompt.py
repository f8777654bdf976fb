"""Prompt rendering: the checkpoint's template, expanded placeholders, and typed placeholders stay text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.frontend.errors import ApiError
from services.frontend.prompt import PromptBuilder
from services.frontend.protocol import ChatMessage
from shared.model.config import ModelConfig
from shared.model.geometry import ImageGeometry


@pytest.fixture(scope="module")
def builder(tiny_model):
    return PromptBuilder(AutoTokenizer.from_pretrained(tiny_model), ModelConfig.from_checkpoint(tiny_model),
                         ImageGeometry.from_checkpoint(tiny_model))


def user(*parts):
    return ChatMessage.model_validate({"role": "user", "content": list(parts)})


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_image_placeholders_expand_to_the_processor_token_count(builder, reference):
    prompt = builder.build([user(IMAGE, {"type": "text", "text": "Describe."})], [(100, 150)])
    image_token = builder.config.image_token_id
    grid = builder.geometry.grid(100, 150)
    assert prompt.image_grids == [grid]
    n = grid[1] * grid[2] // 4
    run = prompt.token_ids[prompt.image_offsets[0]:prompt.image_offsets[0] + n]
    assert run == [image_token] * n and prompt.token_ids.count(image_token) == n


def test_same_tokens_as_the_reference_tokenization(builder, reference):
    from tests.support import make_image

    image = make_image(1, 100, 150)
    prompt = builder.build([user(IMAGE, {"type": "text", "text": "Describe the image."})], [(100, 150)])
    assert prompt.token_ids == reference.inputs("Describe the image.", [image])["input_ids"][0].tolist()


def test_typed_placeholder_tokens_are_text_not_image_slots(builder):
    typed = "<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    prompt = builder.build([user({"type": "text", "text": typed})], [])
    specials = {builder.config.image_token_id, builder.config.vision_start_token_id}
    assert not specials & set(prompt.token_ids)
    assert builder.tokenizer.decode(prompt.token_ids).count("<|image_pad|>") == 1


def test_image_count_must_match(builder):
    with pytest.raises(ApiError):
        builder.build([user({"type": "text", "text": "no image here"})], [(10, 10)])
