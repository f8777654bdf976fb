"""Prefix caching against HF generate(), token for token (fp32, CPU, tiny checkpoint): what hits, what
must not, eviction, and block references given back on every way out; and the chain hashes themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.engine.scheduler import PrefixUnavailable
from shared.engine.prefix import ImageSpan, block_hashes
from shared.messages.sampling import SamplingParams
from shared.engine.sequence import ImageInput, Sequence
from tests.engine_support import (assistant, engine_prompt, hf_generate, make_engine, model_parts,  # noqa: F401
                                  requests_with_reference, run_to_completion, sequence, user)
from tests.support import make_image

BS = 16


def _run(engine, rid: str, ids: list[int], images: list[ImageInput], max_tokens: int) -> Sequence:
    seq = Sequence(rid, list(ids), len(ids), SamplingParams(temperature=0, max_tokens=max_tokens), images=images)
    engine.add_prompt(seq)
    first = []
    while engine.has_work():
        first += [o for o in engine.step() if o.seq is seq and o.index == 0]
    assert first[0].cached_tokens == seq.num_cached  # what usage.prompt_tokens_details.cached_tokens reports
    return seq


# -- the chain hashes ---------------------------------------------------------------------------------
def test_block_hashes_name_text_and_images_by_content():
    ids = list(range(100, 164))  # four blocks; an image of 20 tokens at 10..30 covers blocks 0 and 1
    image = ImageSpan(10, 20, "aaaa")
    hashes = block_hashes(ids, [image], BS)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    assert block_hashes(ids + [1, 2, 3], [image], BS) == hashes  # a partial block gets no hash
    other_image = block_hashes(ids, [ImageSpan(10, 20, "bbbb")], BS)
    assert other_image[0] != hashes[0] and not set(other_image) & set(hashes)  # and every block after it
    later_text = block_hashes(ids[:40] + [7] + ids[41:], [image], BS)
    assert later_text[:2] == hashes[:2] and later_text[2] != hashes[2] and later_text[3] != hashes[3]
    assert block_hashes(ids, [], BS)[2:] != hashes[2:]  # the same ids as plain text are another prefix
    assert block_hashes(ids, [(10, 20, "")], BS) == []  # an image without a content hash ends the chain
    assert block_hashes(ids, [(40, 20, "")], BS) == block_hashes(ids, [], BS)[:2]
    assert block_hashes(ids, [image], BS, start_block=2, parent=hashes[1]) == hashes[2:]  # extending a chain


def test_block_hashes_import_without_torch():
    """The frontend computes the same hashes without importing torch."""
    code = "import sys, shared.engine.prefix; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- hits ---------------------------------------------------------------------------------------------
def test_a_conversation_with_images_hits_the_cache_on_its_next_turn(model_parts, reference):
    """Turn 2 of a conversation (its first turn, the answer, a new image) reuses turn 1's KV — image
    included — up to where the token ids first differ, in whole blocks; asking turn 2 again hits all of
    it but the last token. Outputs equal HF's and an uncached engine's, with chunks of 32 tokens."""
    image_a, image_b = make_image(31, 100, 150), make_image(32, 80, 80)
    engine = make_engine(model_parts, max_batched_tokens=32)
    uncached = make_engine(model_parts, max_batched_tokens=32, prefix_caching=False)
    turn1 = [user("Describe this picture.", 1)]
    ids1, images1 = engine_prompt(reference, model_parts, turn1, [image_a])
    first = _run(engine, "t1", ids1, images1, 12)
    assert first.output_ids == hf_generate(reference, turn1, [image_a], 12)

    turn2 = turn1 + [assistant(reference.text(first.output_ids)), user("And this one?", 1)]
    ids2, images2 = engine_prompt(reference, model_parts, turn2, [image_a, image_b])
    expected = hf_generate(reference, turn2, [image_a, image_b], 10)
    second = _run(engine, "t2", ids2, images2, 10)
    computed = first.token_ids[:len(first) - 1]  # the last token's KV was never computed
    common = next((i for i, (a, b) in enumerate(zip(computed, ids2)) if a != b), min(len(computed), len(ids2)))
    assert second.num_cached == min(common, len(ids2) - 1) // BS * BS
    assert second.num_cached > images1[0].offset + images1[0].num_tokens  # the image's KV came from the cache
    assert second.output_ids == expected
    assert _run(uncached, "t2", ids2, images2, 10).output_ids == expected

    again = _run(engine, "t2-again", ids2, images2, 10)
    assert again.num_cached == (len(ids2) - 1) // BS * BS
    assert again.output_ids == expected
    assert engine.blocks.num_used == 0


def test_a_different_image_at_the_same_place_hits_nothing_past_it(model_parts, reference):
    """Same text, an image of the same size but other pixels: the token ids are equal, yet only the
    blocks before the image are reused. The same image again hits past it; an image without a content
    hash is never reused."""
    engine = make_engine(model_parts, max_batched_tokens=32)
    turn = [user("What is in the picture?", 1)]
    image_a, image_b = make_image(41, 90, 120), make_image(42, 90, 120)
    ids_a, images_a = engine_prompt(reference, model_parts, turn, [image_a])
    ids_b, images_b = engine_prompt(reference, model_parts, turn, [image_b])
    assert ids_a == ids_b and images_a[0].content_hash != images_b[0].content_hash
    before_image = images_a[0].offset // BS * BS

    _run(engine, "a", ids_a, images_a, 8)
    b = _run(engine, "b", ids_b, images_b, 8)
    assert b.num_cached == before_image
    assert b.output_ids == hf_generate(reference, turn, [image_b], 8)
    assert _run(engine, "a-again", ids_a, images_a, 8).num_cached == (len(ids_a) - 1) // BS * BS

    unnamed = [ImageInput(i.offset, i.grid, i.embeds) for i in images_a]  # no content hash
    _run(engine, "unnamed", ids_a, unnamed, 8)
    assert _run(engine, "unnamed-again", ids_a, unnamed, 8).num_cached == before_image


def test_eviction_under_a_small_pool_stays_exact(model_parts, requests_with_reference):
    """A pool of 12 blocks (two sequences) for eight prompts asked three times, two at a time: cached
    blocks are evicted to make room, hits past the shared system prompt still come (the longest-parked
    blocks go first), and every output is HF's."""
    engine = make_engine(model_parts, num_blocks=13, max_batched_tokens=32)
    order = [i for k in range(3) for i in (list(range(8)) if k != 1 else [7, 0, 6, 1, 5, 2, 4, 3])]
    seqs = [sequence(f"{n}-{i}", requests_with_reference[i]) for n, i in enumerate(order)]
    for pair in range(0, len(seqs), 2):
        for seq in seqs[pair:pair + 2]:
            engine.add_prompt(seq)
        run_to_completion(engine)
    for seq, i in zip(seqs, order):
        assert seq.output_ids == requests_with_reference[i][3], seq.request_id
    assert engine.blocks.num_evicted > 20, "little was evicted"
    assert any(seq.num_cached > 16 for seq in seqs), "no hit past the system prompt"
    assert engine.blocks.num_used == 0 and engine.blocks.num_free == engine.blocks.num_blocks


# -- references given back -------------------------------------------------------------------------------
def test_cancelled_and_preempted_sequences_give_their_blocks_back(model_parts, requests_with_reference):
    """Prompts sharing cached blocks (the chat template's system prompt, repeated prompts) cancelled
    while waiting, half-way through their prompt and while decoding, others preempted in a small pool:
    afterwards no block is held and all are free; the survivors' outputs are HF's. (33 blocks of 4: the
    repeat of the cancelled prompt, sharing its computed blocks, is preempted once decoding.)"""
    engine = make_engine(model_parts, num_blocks=33, block_size=4, max_batched_tokens=24)
    swapped = []
    original = engine.swap_out
    engine.swap_out = lambda seq: (swapped.append(seq.request_id), original(seq))
    picks = [7, 5, 3, 5, 2, 0, 7]
    seqs = [sequence(f"{n}-{i}", requests_with_reference[i]) for n, i in enumerate(picks)]
    for seq in seqs[:3]:
        engine.add_prompt(seq)
    while not 0 < seqs[1].num_computed < seqs[1].prompt_len:
        engine.step()
    engine.abort(seqs[1].request_id)  # half-way through its prompt
    while not seqs[0].decoding:
        engine.step()
    engine.step()
    engine.abort(seqs[0].request_id)  # decoding
    for seq in seqs[3:]:
        engine.add_prompt(seq)
    engine.abort(seqs[6].request_id)  # still waiting
    run_to_completion(engine)
    assert seqs[3].request_id in swapped, "the repeat was not preempted"
    for seq, i in list(zip(seqs, picks))[2:6]:
        assert seq.output_ids == requests_with_reference[i][3], seq.request_id
    assert engine.cached_prompt_tokens > 0
    assert engine.blocks.num_used == 0 and engine.blocks.num_free == engine.blocks.num_blocks


# -- images whose KV is cached come without embeddings ------------------------------------------------------
def _without_embeddings(images: list[ImageInput], count: int) -> list[ImageInput]:
    """The first ``count`` images as the frontend sends them when a worker's prefix cache holds their KV."""
    return [ImageInput(i.offset, i.grid, None, i.content_hash, i.time_interval, i.num_tokens) if n < count else i
            for n, i in enumerate(images)]


def test_an_image_sent_without_embeddings_comes_from_the_cached_prefix(model_parts, reference):
    """Turn 2 with turn 1's image as cached (no embeddings) and a new image with them: HF's output, the
    first image's KV from the cache."""
    image_a, image_b = make_image(51, 100, 150), make_image(52, 80, 80)
    engine = make_engine(model_parts, max_batched_tokens=32)
    turn1 = [user("Describe this picture.", 1)]
    ids1, images1 = engine_prompt(reference, model_parts, turn1, [image_a])
    first = _run(engine, "t1", ids1, images1, 12)
    turn2 = turn1 + [assistant(reference.text(first.output_ids)), user("And this one?", 1)]
    ids2, images2 = engine_prompt(reference, model_parts, turn2, [image_a, image_b])
    second = _run(engine, "t2", ids2, _without_embeddings(images2, 1), 10)
    assert second.num_cached >= images2[0].offset + images2[0].num_tokens
    assert second.output_ids == hf_generate(reference, turn2, [image_a, image_b], 10)
    assert engine.blocks.num_used == 0


def test_an_image_without_embeddings_whose_kv_is_not_cached_is_refused(model_parts, reference):
    """Never cached here, or no prefix caching at all: ``PrefixUnavailable`` at once, nothing queued."""
    ids, images = engine_prompt(reference, model_parts, [user("What is this?", 1)], [make_image(53, 90, 90)])
    for engine in (make_engine(model_parts), make_engine(model_parts, prefix_caching=False)):
        seq = Sequence("r", list(ids), len(ids), SamplingParams(temperature=0, max_tokens=4),
                       images=_without_embeddings(images, 1))
        with pytest.raises(PrefixUnavailable):
            engine.add_prompt(seq)
        assert not engine.has_work() and engine.blocks.num_used == 0


def test_a_prompt_with_cached_images_starts_at_once_or_is_refused(model_parts, reference):
    """Turn 2, its image sent as cached, in a pool of 40 blocks. Behind a queued prompt that needs the
    room, it is refused (it would take blocks that prompt waits for, and cannot wait itself: its prefix
    could be evicted meanwhile); with the room, it starts at once, ahead of a prompt queued before it,
    with HF's output; once the image's blocks were evicted, it is refused."""
    engine = make_engine(model_parts, num_blocks=41, max_batched_tokens=32, priority_window=0)
    image = make_image(54, 100, 150)
    turn1 = [user("Describe this picture.", 1)]
    ids1, images1 = engine_prompt(reference, model_parts, turn1, [image])
    first = _run(engine, "t1", ids1, images1, 12)
    turn2 = turn1 + [assistant(reference.text(first.output_ids)), user("And now?")]
    ids2, images2 = engine_prompt(reference, model_parts, turn2, [image])

    def turn_two(rid: str) -> Sequence:
        return Sequence(rid, list(ids2), len(ids2), SamplingParams(temperature=0, max_tokens=6),
                        images=_without_embeddings(images2, 1))

    def text(rid: str, blocks: int) -> Sequence:
        return Sequence(rid, [7 + len(rid)] * (blocks * BS - 3), blocks * BS - 3,
                        SamplingParams(temperature=0, max_tokens=2))

    engine.add_prompt(text("big", engine.blocks.num_free - 1))  # queued: it needs every free block
    with pytest.raises(PrefixUnavailable):
        engine.add_prompt(turn_two("behind"))
    engine.abort("big")
    engine.add_prompt(text("small", 2))
    second = turn_two("t2")
    engine.add_prompt(second)  # admitted now: ahead of the prompt queued before it
    assert second in engine.scheduler.running and engine.scheduler.waiting[0].request_id == "small"
    while engine.has_work():
        engine.step()
    assert second.num_cached >= images2[0].offset + images2[0].num_tokens
    assert second.output_ids == hf_generate(reference, turn2, [image], 6)

    evicted = engine.blocks.num_evicted
    _run(engine, "evict", [11] * (engine.blocks.num_blocks - 2) * BS, [], 1)  # every block, the image's too
    assert engine.blocks.num_evicted > evicted
    with pytest.raises(PrefixUnavailable):
        engine.add_prompt(turn_two("gone"))
    assert engine.blocks.num_used == 0 and not engine.has_work()
