"""Streamed text equals decoding the whole output at once, whatever the token boundaries."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from services.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def stream(tokenizer, ids, stop=None, chunk=1):
    detok = IncrementalDetokenizer(tokenizer, stop)
    parts = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(detok.finish())
    return "".join(parts), parts, detok


@pytest.mark.parametrize("seed", range(20))
def test_random_token_sequences(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
    text, _, _ = stream(tokenizer, ids, chunk=rng.choice([1, 1, 2, 3]))
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_split_across_tokens(tokenizer):
    text = "東京 😀 naïve Пример"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the byte-level vocabulary splits these characters over several tokens
    assert len(ids) > len(text.split())
    joined, parts, _ = stream(tokenizer, ids)
    assert joined == text
    assert all("\ufffd" not in p for p in parts)  # never a half character on the wire


def test_stop_string_cuts_text_and_is_never_emitted(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    text, _, detok = stream(tokenizer, ids, stop=["fox"])
    assert text == "The quick brown "
    assert detok.stopped


def test_stop_string_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello! How are you today?", add_special_tokens=False)
    text, _, detok = stream(tokenizer, ids, stop=["are you", "never"])
    assert text == "Hello! How " and detok.stopped
