"""Greedy output through the HTTP API (official openai client, streaming and not) equals HF generate()."""

from __future__ import annotations

import pytest

from tests.support import chat_messages, make_image

MAX_TOKENS = 24

CASES = {
    "text-only": ("Hello! How are you today?", []),
    "one-image": ("Describe the image in one sentence.", [(11, 100, 150)]),
    "three-images": ("What colour is the square?", [(21, 60, 200), (22, 90, 90), (23, 140, 70)]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_output_equals_hf(stack, reference, case, stream):
    text, specs = CASES[case]
    images = [make_image(*spec) for spec in specs]
    expected_ids = reference.generate(text, images, MAX_TOKENS)
    expected = reference.text(expected_ids)
    client = stack.client()
    kwargs = dict(model=client.models.list().data[0].id, messages=chat_messages(text, images),
                  max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        response = client.chat.completions.create(**kwargs)
        content = response.choices[0].message.content
        finish = [response.choices[0].finish_reason]
        usage = response.usage
    assert content == expected
    assert usage.completion_tokens == len(expected_ids)
    assert usage.prompt_tokens == reference.inputs(text, images)["input_ids"].shape[1]
    eos = reference.model.generation_config.eos_token_id
    assert finish == ["stop" if expected_ids[-1] == eos else "length"]
