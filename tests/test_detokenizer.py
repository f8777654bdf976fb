"""Streamed text equals decoding the whole output at once, whatever the token boundaries.

The properties at the end draw token ids (byte fragments, special tokens and ordinary tokens mixed), how
they arrive (one event at a time or several), a stop string and the output options, for both kinds of
vocabulary a checkpoint may ship: byte-level BPE (every supported family's: Qwen2-VL, Qwen2.5-VL and
Qwen3-VL all use Qwen2's tokenizer, as the tiny checkpoints do) and byte fallback (SentencePiece style:
``<0xE6>`` tokens). The text the frontend's detokenizer releases, and the content a generation assembles
from its events, must be ``tokenizer.decode(ids, skip_special_tokens=...)`` cut at the stop string.
``PROPERTY_EXAMPLES=N`` runs N random examples of each instead of CI's fixed ones.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.generation import ChoiceState, OutputOptions, TextDelta
from shared.messages.sampling import SamplingParams
from shared.messages.stream import TokenEvent
from tests.mixes import budget


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


# -- properties -----------------------------------------------------------------------------------------
def byte_fallback_tokenizer():
    """A SentencePiece-style vocabulary: ``▁`` for spaces, the 256 ``<0xNN>`` byte tokens beside BPE merges,
    and the Llama decoder (spaces back, byte runs fused into text, the leading space stripped)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shared.model.tiny import _CORPUS, SPECIAL_TOKENS

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                                 special_tokens=["<unk>", *SPECIAL_TOKENS]))
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])


def test_a_byte_token_that_decoded_to_a_letter_may_still_turn_into_replacement_characters():
    """Byte fallback: ``<0x58>`` alone is "X", but followed by ``<0x85>`` the run is no UTF-8 and decodes as
    one U+FFFD per byte, the X's too: the stream must not release the X (it did: text shifted by one
    character from decode's after every such run)."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<0x58>", "<0x85>"]) + tokenizer.encode("the", add_special_tokens=False)
    expected = tokenizer.decode(ids)
    assert expected.startswith("\ufffd\ufffd") and "X" not in expected
    text, parts, _ = stream(tokenizer, ids)
    assert text == expected and parts[0] == ""


@pytest.fixture(scope="module", params=["byte-level", "byte-fallback"])
def any_tokenizer(request, tokenizer):
    return tokenizer if request.param == "byte-level" else byte_fallback_tokenizer()


def _token_kinds(tokenizer) -> dict[str, list[int]]:
    """Ids by kind: special, byte fragments (their bytes are no whole UTF-8 text), ordinary."""
    special = sorted(tokenizer.all_special_ids)
    fragments, ordinary = [], []
    for i in range(len(tokenizer)):
        if i not in special:
            (fragments if "\ufffd" in tokenizer.decode([i]) else ordinary).append(i)
    return {"special": special, "fragment": fragments, "ordinary": ordinary}


@st.composite
def outputs(draw, kinds: dict[str, list[int]]):
    """Ids (byte fragments twice as likely as either other kind), how they arrive, the output options."""
    kind = st.sampled_from(["fragment", "fragment", "special", "ordinary"])
    ids = draw(st.lists(kind.flatmap(lambda k: st.sampled_from(kinds[k])), min_size=1, max_size=40))
    events = draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    return ids, events, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**16))


def expected_text(tokenizer, ids: list[int], skip: bool, stop: str | None, include_stop: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    at = text.find(stop) if stop else -1
    return text if at < 0 else text[:at + (len(stop) if include_stop else 0)]


def draw_stop(tokenizer, ids: list[int], skip: bool, seed: int) -> str | None:
    """None, or a piece of the decoded text (it may hold U+FFFD), or text that never appears."""
    rng = random.Random(seed)
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    choice = rng.randrange(3)
    if choice == 0 or not text:
        return None
    if choice == 1:
        start = rng.randrange(len(text))
        return text[start:start + rng.randint(1, 4)]
    return "\x00never"


def chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, at = [], 0
    for size in sizes:
        if at >= len(ids):
            break
        out.append(ids[at:at + size])
        at += size
    return out


def test_streamed_text_is_decode_of_the_ids(any_tokenizer):
    kinds = _token_kinds(any_tokenizer)
    assert kinds["fragment"] and kinds["special"]

    @given(outputs(kinds))
    @budget(ci=150)
    def check(output):
        ids, sizes, skip, include_stop, seed = output
        stop = draw_stop(any_tokenizer, ids, skip, seed)
        detok = IncrementalDetokenizer(any_tokenizer, [stop] if stop else None, skip, include_stop)
        parts = [detok.push(chunk) for chunk in chunks(ids, sizes)]
        text = "".join(parts) + detok.finish()
        assert text == expected_text(any_tokenizer, ids, skip, stop, include_stop)
        assert detok.stopped == (stop is not None and stop in any_tokenizer.decode(ids, skip_special_tokens=skip))

    check()


def test_a_generations_content_is_decode_of_its_ids(any_tokenizer):
    """What the chat and completions answers are assembled from: the ``TextDelta``s of a choice's token
    events, the last one carrying the finish."""
    kinds = _token_kinds(any_tokenizer)

    @given(outputs(kinds))
    @budget(ci=60)
    def check(output):
        ids, sizes, skip, include_stop, seed = output
        stop = draw_stop(any_tokenizer, ids, skip, seed)
        options = OutputOptions(stop=[stop] if stop else [], skip_special_tokens=skip, include_stop=include_stop)
        choice = ChoiceState(0, any_tokenizer, options, SamplingParams(temperature=0, max_tokens=len(ids)))
        events, index, content = chunks(ids, sizes), 0, []
        for n, chunk in enumerate(events):
            last = n == len(events) - 1
            event = TokenEvent(request_id="r", index=index, token_ids=chunk, finish_reason="length" if last else None)
            index += len(chunk)
            content += [out.text for out in choice.consume(event) if isinstance(out, TextDelta)]
            if choice.done:
                break
        assert choice.done
        assert "".join(content) == expected_text(any_tokenizer, ids, skip, stop, include_stop)

    check()
