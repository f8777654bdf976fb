"""Chunked prefill against HF generate(), token for token (fp32, CPU, tiny checkpoint): prompts spread
over many steps, chunks that split images, several prompts in one step, decode rows riding along,
preemption mid-prompt, and role prefill handing chunked KV to a decode engine."""

from __future__ import annotations

import pytest

from shared.engine.attention import TritonAttention
from shared.engine.warmup import calibrate, warm_steps
from shared.engine.sequence import Sequence
from shared.engine.settings import DEFAULT_TARGET_ITL_MS
from tests.engine_support import (make_engine, model_parts, requests_with_reference, run_to_completion,  # noqa: F401
                                  sequence)


def _splits_an_image(plans, seqs) -> bool:
    images = {s.request_id: [(i.offset, i.offset + i.num_tokens) for i in s.images] for s in seqs}
    return any(start > lo and start < hi for plan in plans for rid, start, _, decoding in plan if not decoding
               for lo, hi in images[rid])


@pytest.mark.parametrize("target_itl_s", [0.0, DEFAULT_TARGET_ITL_MS / 1e3])
def test_prompts_in_chunks_of_32_tokens_give_hf_tokens(model_parts, requests_with_reference, target_itl_s):
    """Eight prompts of 30-200 tokens at a budget of 32 tokens a step, with and without the default time
    budget: each spans several chunks, chunks split images, a step carries the end of one prompt and the
    start of the next, and decode rows ride along with prompt chunks — and every output is HF's."""
    engine = make_engine(model_parts, max_batched_tokens=32, prefix_caching=False, target_itl_s=target_itl_s)
    calibrate(engine)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    for seq in seqs:
        engine.add_prompt(seq)
    plans: list = []
    run_to_completion(engine, plans=plans)
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    assert all(sum(end - start for _, start, end, _ in plan) <= 32 for plan in plans)
    assert max(sum(1 for rid, _, _, decoding in plan if not decoding) for plan in plans) >= 2
    assert any(any(d for *_, d in plan) and not all(d for *_, d in plan) for plan in plans), "no mixed step"
    assert _splits_an_image(plans, seqs)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_steps_with_decode_rows_keep_to_the_time_budget(model_parts, requests_with_reference):
    """A time budget too small for any step (1 µs), held whatever the queue (it would yield to any: the
    cuts are what is tested), the model calibrated as a worker does at start: a step that carries decode
    rows computes a block's worth of prompt tokens (16: prompts still advance), a step of prompts alone
    up to the token budget (96); prompts join while others decode, and every output is HF's."""
    engine = make_engine(model_parts, max_batched_tokens=96, target_itl_s=1e-6, prefix_caching=False)
    engine.scheduler.yields = lambda: False
    assert calibrate(engine) >= 5 and engine.blocks.num_free == engine.blocks.num_blocks
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    plans: list = []
    run_to_completion(engine, {0: seqs[:2], 3: seqs[2:5], 6: seqs[5:]}, plans=plans)
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    prompt = [(sum(end - start for _, start, end, d in plan if not d), any(d for *_, d in plan)) for plan in plans]
    assert all(n <= 16 for n, decoding in prompt if decoding)
    assert any(n and decoding for n, decoding in prompt), "no mixed step"
    assert max(n for n, decoding in prompt if not decoding) > 16
    assert engine.step_times.paced > 0 and engine.step_times.observed > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_many_sequences_joining_while_prompts_chunk(model_parts, requests_with_reference):
    """24 sequences (each prompt three times) joining over the first steps, budget 48: prompts chunk
    beside up to 24 decode rows; the repeats share cached prefixes. Every output is HF's."""
    engine = make_engine(model_parts, max_batched_tokens=48)
    seqs = [sequence(f"{k}-{i}", r) for k in range(3) for i, r in enumerate(requests_with_reference)]
    joiners = {step: seqs[step * 4:step * 4 + 4] for step in range(6)}
    run_to_completion(engine, joiners)
    for k in range(3):
        for i, (_, _, _, expected) in enumerate(requests_with_reference):
            assert seqs[k * 8 + i].output_ids == expected, seqs[k * 8 + i].request_id
    assert engine.cached_prompt_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_whole_prompts_without_chunking(model_parts, requests_with_reference):
    """--no-chunked-prefill: a prompt is computed in one step, however small the budget (the first of a
    step may exceed it), in steps without decode rows."""
    engine = make_engine(model_parts, max_batched_tokens=32, chunked_prefill=False, prefix_caching=False)
    seqs = [sequence(i, r) for i, r in enumerate(requests_with_reference)]
    joiners = {0: seqs[:3], 2: seqs[3:]}
    plans: list = []
    run_to_completion(engine, joiners, plans)
    for seq, (_, _, _, expected) in zip(seqs, requests_with_reference):
        assert seq.output_ids == expected, seq.request_id
    for plan in plans:
        prompts = [(start, end) for _, start, end, decoding in plan if not decoding]
        assert not prompts or len(prompts) == len(plan), "decode rows in a prefill step"
        assert all(start == 0 for start, _ in prompts)


def test_preemption_in_the_middle_of_prompts_resumes_exactly(model_parts, requests_with_reference, reference):
    """Three text prompts decoding 40 tokens each while a three-image prompt is computed 5 tokens a step
    (budget 8) in a pool of 39 blocks of 4: the decode rows run out of blocks and preempt the image
    prompt half-way through, then one of themselves; all resume where they stopped, exactly."""
    from tests.engine_support import PROMPTS
    from tests.support import make_image

    picks = [0, 3, 6, 5]
    expected = [reference.generate(PROMPTS[i][0], [make_image(*spec) for spec in PROMPTS[i][1]], 40) for i in picks]
    engine = make_engine(model_parts, num_blocks=40, block_size=4, max_batched_tokens=8)
    swapped = []
    original = engine.swap_out
    engine.swap_out = lambda seq: (swapped.append(seq.decoding), original(seq))
    seqs = [sequence(i, requests_with_reference[i][:2] + (40, None)) for i in picks]
    run_to_completion(engine, {0: seqs[:3], 2: seqs[3:]})
    assert False in swapped, "no sequence was preempted half-way through its prompt"
    assert True in swapped, "no sequence was preempted while decoding"
    for seq, tokens in zip(seqs, expected):
        assert seq.output_ids == tokens, seq.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prefill_role_hands_chunked_kv_to_decode(model_parts, requests_with_reference):
    """Role prefill at 32 tokens a step streams each layer's new KV span by span into reservations on
    a decode engine (as the KV chunks of services/prefill do); after the first token each sequence
    continues there. A repeated prompt is served from the prefill engine's prefix cache: its first
    span starts at 0 and carries the cached KV too. Decode outputs are HF's."""
    prefill = make_engine(model_parts, role="prefill", max_batched_tokens=32)
    decode = make_engine(model_parts, role="decode")
    assert warm_steps(prefill) == 4 and warm_steps(decode) == 0  # as the workers start (the KV they wrote: not cached)
    picks = [5, 1, 3, 5]  # the last repeats the first: a cache hit
    seqs = [sequence(f"{n}-{i}", requests_with_reference[i]) for n, i in enumerate(picks)]
    moved = {s.request_id: Sequence(s.request_id, [0] * len(s), len(s), s.sampling, num_computed=len(s)) for s in seqs}
    for m in moved.values():
        decode.reserve(m)  # room first, before any KV exists
    landed = {rid: [0] * model_parts[0].text.num_layers for rid in moved}
    spans_seen = []

    def on_layer_done(layer, spans):
        for span in spans:
            kv = prefill.read_kv(span.seq, slice(layer, layer + 1), span.start, span.end)
            decode.write_kv(span.seq.request_id, kv, slice(layer, layer + 1), span.start)
            landed[span.seq.request_id][layer] += span.end - span.start
            spans_seen.append((span.seq.request_id, layer, span.start, span.end))

    firsts = {}
    for seq in seqs[:3]:
        prefill.add_prompt(seq)
    while prefill.has_work():
        for out in prefill.step(on_layer_done):
            firsts[out.seq.request_id] = out
    prefill.add_prompt(seqs[3])  # after the first copy has been handed off: its blocks stay cached
    while prefill.has_work():
        for out in prefill.step(on_layer_done):
            firsts[out.seq.request_id] = out
    assert prefill.blocks.num_used == 0
    for seq in seqs:
        assert landed[seq.request_id] == [len(seq) - 1] * len(landed[seq.request_id])  # every prompt token once
        out = firsts[seq.request_id]
        assert out.index == 0 and out.finish_reason is None
        target = moved[seq.request_id]
        target.token_ids, target.prompt_len, target.rope_delta = list(seq.token_ids), seq.prompt_len, seq.rope_delta
        decode.activate(seq.request_id)
    repeat = firsts[seqs[3].request_id]
    assert firsts[seqs[0].request_id].cached_tokens <= 16  # at most the chat template's system prompt
    assert repeat.cached_tokens == (len(seqs[3]) - 2) // 16 * 16  # all but the last token, in whole blocks
    first_span = min((s for s in spans_seen if s[0] == seqs[3].request_id), key=lambda s: s[2])
    assert first_span[2] == 0 and first_span[3] > repeat.cached_tokens
    run_to_completion(decode)
    for seq, i in zip(seqs, picks):
        assert moved[seq.request_id].output_ids == requests_with_reference[i][3], seq.request_id
    assert decode.blocks.num_free == decode.blocks.num_blocks


@pytest.mark.parametrize("role, target_itl_s, rows", [("prefill", DEFAULT_TARGET_ITL_MS / 1e3, False),
                                                      ("both", 0.0, True)])
def test_engines_without_a_time_budget_step_serving_shapes_before_they_serve(model_parts, role, target_itl_s, rows):
    """A prefill worker (and an engine whose budget is off) fits no step-time model, yet steps the trial
    shapes once before it serves, so a kernel variant only an eager forward past the prefill graphs
    launches is compiled then, not on a first long prompt: prompts up to the whole step budget (and a
    chunk after a prefix); decode rows riding along only where the engine has them. The pool is left free."""
    engine = make_engine(model_parts, role=role, max_batched_tokens=64, target_itl_s=target_itl_s)
    assert engine.step_times is None
    stepped = []
    prefill = engine.runner.prefill

    def spy(chunks):
        stepped.append([(c.end - c.start, c.start) for c in chunks])
        return prefill(chunks)

    engine.runner.prefill = spy
    assert warm_steps(engine) == len(stepped) >= 4
    prompts = [step[-1] for step in stepped]
    assert (64, 0) in prompts and any(start > 0 for _, start in prompts)
    assert any(len(step) > 1 for step in stepped) is rows
    assert engine.blocks.num_free == engine.blocks.num_blocks


def make_triton(cache, head_dim: int, sdpa: bool, prefix_chunks: str) -> TritonAttention:
    backend = TritonAttention(cache, head_dim ** -0.5, sdpa_for_fresh_chunks=sdpa, prefix_chunks=prefix_chunks)
    backend.split_min_tokens = 1  # this test's chunks are 32 tokens at most
    return backend


@pytest.mark.parametrize("sdpa,prefix_chunks", [(True, "split"), (True, "paged"), (False, "paged")])
def test_triton_backend_chunks_and_cached_prefixes_give_hf_tokens(model_parts, requests_with_reference, sdpa,
                                                                   prefix_chunks):
    """The GPU attention path in Triton's interpreter: for chunks after a prefix, the two fused calls
    merged by their log-sum-exps ("split") or the paged prefill kernel (which, with SDPA turned off,
    does first chunks too); the decode kernel for rows riding along."""
    engine = make_engine(model_parts, max_batched_tokens=32, backend=lambda cache: make_triton(
        cache, model_parts[0].text.head_dim, sdpa, prefix_chunks))
    picks = [2, 0, 2]
    seqs = [sequence(f"{n}-{i}", requests_with_reference[i]) for n, i in enumerate(picks)]
    run_to_completion(engine, {0: seqs[:2], 4: seqs[2:]})
    for seq, i in zip(seqs, picks):
        assert seq.output_ids == requests_with_reference[i][3], seq.request_id
    assert engine.cached_prompt_tokens > 0
    if prefix_chunks == "split":  # the merge ran
        assert engine.runner.backend.split_chunks > 0


@pytest.mark.parametrize("prefix,n,heads,kv_heads", [(1, 1, 2, 2), (37, 5, 4, 2), (128, 96, 6, 1)])
def test_split_chunk_attention_equals_one_masked_attention(prefix, n, heads, kv_heads):
    """A chunk after a prefix attended as two fused calls merged by their log-sum-exps equals one
    lower-right causal attention over prefix and chunk (grouped-query heads; fp32)."""
    import torch

    from shared.engine.attention import causal_attention, split_chunk_attention

    gen = torch.Generator().manual_seed(prefix + n)
    q = torch.randn(n, heads, 16, generator=gen)
    k, v = (torch.randn(prefix + n, kv_heads, 16, generator=gen) for _ in range(2))
    got = split_chunk_attention(q, k[:prefix], v[:prefix], k[prefix:], v[prefix:])
    torch.testing.assert_close(got, causal_attention(q, k, v, prefix), rtol=1e-5, atol=1e-5)


def test_step_budgets_below_16_tokens_are_refused():
    from pydantic import ValidationError

    from shared.engine.settings import EngineSettings

    assert EngineSettings(max_batched_tokens=8192).max_batched_tokens == 8192
    with pytest.raises(ValidationError, match="max_batched_tokens must be 0"):
        EngineSettings(max_batched_tokens=8)


def test_time_budget_setting():
    """--target-itl-ms: on by default, 0 turns it off, a negative one is refused; the token cap it
    replaced is an unknown option."""
    from pydantic import ValidationError

    from shared.engine.settings import EngineSettings

    assert EngineSettings().target_itl_ms == DEFAULT_TARGET_ITL_MS > 0
    assert EngineSettings(target_itl_ms=0).target_itl_ms == 0
    for bad in ({"target_itl_ms": -1}, {"decode_step_tokens": 2048}):
        with pytest.raises(ValidationError):
            EngineSettings(**bad)
