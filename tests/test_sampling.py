"""Engine sampling against references, on the tiny checkpoint (fp32, CPU): logprobs and penalties against
HF (its logits processors, or a plain loop over its logits where HF has none), min_tokens, stop token
ids, logit bias, n > 1 forked from one prefill, and requests with options batched with ones without."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler
from shared.messages.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.model.config import ModelConfig
from shared.model.loader import load_language_model

PROMPTS = ["Hello! How are you today?", "The quick brown fox", "Numbers: 0 1 2 3"]


@pytest.fixture(scope="module")
def parts(tiny_model):
    config = ModelConfig.from_checkpoint(tiny_model)
    return config, load_language_model(tiny_model, config)


def make_engine(parts, num_blocks=128, role="both") -> Engine:
    config, lm = parts
    cache = KVCache(config.text, num_blocks, 16, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, config.vision.merge_size, sampler=Sampler("cpu", eos_token_ids=config.eos_token_ids))
    return Engine(runner, config.eos_token_ids, max_model_len=(num_blocks - 1) * 16, role=role)


def prompt_ids(reference, text: str) -> list[int]:
    return reference.inputs(text, [])["input_ids"][0].tolist()


def run(engine: Engine, seqs: list[Sequence]) -> dict[str, list]:
    """Every sequence to its end: request id -> [(choice, token, logprobs)] in order."""
    for seq in seqs:
        engine.add_prompt(seq)
    out: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append((o.seq.choice, o.token, o.logprobs))
    return out


def tokens(outputs, choice=0) -> list[int]:
    return [t for c, t, _ in outputs if c == choice]


def hf_loop(reference, ids: list[int], steps: int, adjust) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy, step by step over HF's logits: ``adjust(logits, output_so_far)`` is the reference
    processing; returns the tokens and each step's log-softmax of the processed logits."""
    out, logprobs = [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = reference.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        logits = adjust(logits.clone(), out)
        logprobs.append(logits.log_softmax(-1))
        out.append(int(logits.argmax()))
    return out, logprobs


def test_logprobs_equal_hf_scores(parts, reference):
    ids = prompt_ids(reference, PROMPTS[0])
    steps = 8
    import copy

    config = copy.deepcopy(reference.model.generation_config)
    config.update(max_new_tokens=steps, do_sample=False, eos_token_id=[], repetition_penalty=1.3,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        hf = reference.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      generation_config=config)
    expected = hf.sequences[0, len(ids):].tolist()
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, repetition_penalty=1.3, logprobs=5)
    got = run(make_engine(parts), [Sequence("r", list(ids), len(ids), params)])["r"]
    assert tokens(got) == expected
    for (_, token, lp), scores in zip(got, hf.scores):
        ref = scores[0].log_softmax(-1)
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4)
        top = ref.topk(5)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_are_finite_numbers_whatever_the_penalty(parts, reference):
    """A repetition penalty at the bottom of its range divides a seen token's logit into +inf, and the
    row's log-softmax into NaN (HF's processor does the same): reported as vLLM reports what JSON cannot
    carry, at its floor of -9999 (a property test found /v1/completions answering 500 on this)."""
    import math

    from shared.engine.sampling import LOWEST_LOGPROB

    ids = prompt_ids(reference, PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=5e-324, logprobs=3)
    got = run(make_engine(parts), [Sequence("r", list(ids), len(ids), params)])["r"]
    values = [v for _, _, lp in got for v in [lp.logprob, *lp.top_logprobs]]
    assert len(values) == 16 and all(math.isfinite(v) and LOWEST_LOGPROB <= v <= 0 for v in values)
    assert LOWEST_LOGPROB in values  # the NaN rows


def test_presence_frequency_bias_match_a_reference_loop(parts, reference):
    ids = prompt_ids(reference, PROMPTS[1])
    bias = ((17, 3.0), (42, -100.0))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.7, logit_bias=bias, logprobs=0)

    def adjust(logits, out):
        for token in set(out):
            logits[token] -= 0.7 * out.count(token) + 1.5
        for token, value in bias:
            logits[token] += value
        return logits

    expected, ref_logprobs = hf_loop(reference, ids, 10, adjust)
    got = run(make_engine(parts), [Sequence("r", list(ids), len(ids), params)])["r"]
    assert tokens(got) == expected
    assert [lp.logprob for _, _, lp in got] == pytest.approx([float(r[t]) for r, t in zip(ref_logprobs, expected)],
                                                             abs=1e-4)


def test_min_tokens_masks_eos_and_stop_token_ids_stop(parts, reference):
    config, _ = parts
    eos = config.eos_token_ids[0]
    ids = prompt_ids(reference, PROMPTS[0])
    # the reference: biasing EOS up makes it the greedy choice at once, unless min_tokens masks it
    eager = SamplingParams(temperature=0, max_tokens=12, logit_bias=((eos, 50.0),))
    assert tokens(run(make_engine(parts), [Sequence("a", list(ids), len(ids), eager)])["a"]) == [eos]
    held = msgspec.structs.replace(eager, min_tokens=5)
    out = tokens(run(make_engine(parts), [Sequence("b", list(ids), len(ids), held)])["b"])
    assert len(out) == 6 and eos not in out[:5] and out[5] == eos
    free = tokens(run(make_engine(parts), [Sequence("c", list(ids), len(ids),
                                                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])["c"])
    stop = free[3]
    stopped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    assert tokens(run(make_engine(parts), [Sequence("d", list(ids), len(ids), stopped)])["d"]) == \
        free[:free.index(stop) + 1]


def test_options_of_one_request_do_not_change_its_batch_mates(parts, reference):
    plain = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in PROMPTS]
    alone = {f"p{i}": tokens(run(make_engine(parts), [Sequence(f"p{i}", prompt_ids(reference, t), len(prompt_ids(reference, t)),
                                                                plain[i])])[f"p{i}"]) for i, t in enumerate(PROMPTS)}
    fancy = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, max_tokens=8, ignore_eos=True,
                           repetition_penalty=1.2, presence_penalty=0.5, logit_bias=((5, 5.0),), logprobs=3)
    seqs = [Sequence(f"p{i}", prompt_ids(reference, t), len(prompt_ids(reference, t)), plain[i])
            for i, t in enumerate(PROMPTS)]
    seqs.insert(1, Sequence("fancy", prompt_ids(reference, PROMPTS[2]), len(prompt_ids(reference, PROMPTS[2])), fancy))
    together = run(make_engine(parts), seqs)
    assert {k: tokens(v) for k, v in together.items() if k != "fancy"} == alone
    again = run(make_engine(parts), [Sequence("fancy", prompt_ids(reference, PROMPTS[2]),
                                              len(prompt_ids(reference, PROMPTS[2])), fancy)])
    assert tokens(again["fancy"]) == tokens(together["fancy"])  # seeded: the batch does not matter


def test_n_choices_fork_from_one_prefill(parts, reference, monkeypatch):
    ids = prompt_ids(reference, PROMPTS[2])
    engine = make_engine(parts)
    prefilled = []
    original = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs, *a: prefilled.extend(seqs) or original(seqs, *a))
    greedy = run(engine, [Sequence("g", list(ids), len(ids), SamplingParams(temperature=0, max_tokens=6, n=3,
                                                                            ignore_eos=True))])["g"]
    # prompt tokens computed, per choice (a mixed step may carry choice 0's decode through prefill too)
    computed = [(chunk.seq.choice, max(0, min(chunk.end, len(ids)) - chunk.start)) for chunk in prefilled]
    assert sum(n for choice, n in computed if choice == 0) == len(ids)  # the prompt was computed once ...
    assert sorted(n for choice, n in computed if choice != 0) == [1, 1]  # ... each fork only its last token
    assert tokens(greedy, 0) == tokens(greedy, 1) == tokens(greedy, 2) and len(tokens(greedy, 2)) == 6
    seeded = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11, ignore_eos=True)
    first = run(make_engine(parts), [Sequence("s", list(ids), len(ids), seeded)])["s"]
    second = run(make_engine(parts), [Sequence("s", list(ids), len(ids), seeded)])["s"]
    assert [tokens(first, c) for c in range(3)] == [tokens(second, c) for c in range(3)]
    assert len({tuple(tokens(first, c)) for c in range(3)}) > 1  # each choice draws its own


def test_a_fork_without_room_waits_swapped_and_aborts_as_one(parts, reference):
    ids = prompt_ids(reference, PROMPTS[0])
    engine = make_engine(parts, num_blocks=4)  # 3 usable blocks: a one-block prompt, three choices
    seq = Sequence("f", list(ids[:15]), 15, SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True))
    engine.add_prompt(seq)
    engine.step()
    engine.step()
    assert len(engine.scheduler.swapped) + len(engine.scheduler.running) == 3
    engine.abort("f")
    assert not engine.has_work() and engine.blocks.num_free == engine.blocks.num_blocks
