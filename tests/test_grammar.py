"""Structured output in the engine (tiny checkpoint, CPU): the batched mask against a reference — the same
grammar library applied step by step in a plain loop over HF's logits — and constrained rows batched with
unconstrained ones; the grammar state rebuilt from the tokens after a hand-off."""

from __future__ import annotations

import json

import jsonschema_rs
import llguidance
import llguidance.hf
import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.grammar import Grammars, grammar_source
from shared.engine.kv_cache import KVCache
from shared.engine.runner import ModelRunner
from shared.engine.sampling import Sampler
from shared.messages.sampling import Constraint, SamplingParams
from shared.engine.sequence import Sequence
from shared.model.config import ModelConfig
from shared.model.loader import load_language_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def parts(tiny_model, reference):
    config = ModelConfig.from_checkpoint(tiny_model)
    return config, load_language_model(tiny_model, config), reference.tokenizer


def make_engine(parts) -> Engine:
    config, lm, tokenizer = parts
    cache = KVCache(config.text, 128, 16, torch.float32, "cpu")
    sampler = Sampler("cpu", eos_token_ids=config.eos_token_ids,
                      grammars=lambda: Grammars(tokenizer, config.text.vocab_size, config.eos_token_ids))
    return Engine(ModelRunner(lm, cache, config.vision.merge_size, sampler=sampler), config.eos_token_ids,
                  max_model_len=127 * 16)


def run(engine, seqs):
    for seq in seqs:
        engine.add_prompt(seq)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out


def reference_loop(parts, reference, ids, constraint: Constraint, steps: int) -> list[int]:
    """Greedy over HF's logits, each step masked by a plain llguidance matcher."""
    config, _, tokenizer = parts
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=config.text.vocab_size, eos_token=list(config.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, grammar_source(constraint))
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = reference.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        allowed = matcher.compute_logit_bias()  # one byte per token: 200 allowed, 0 not
        mask = torch.frombuffer(bytearray(allowed), dtype=torch.uint8)[:logits.shape[0]] > 0
        token = int(logits.masked_fill(~mask, float("-inf")).argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token in config.eos_token_ids:
            break
    return out


def prompt(reference, text="Give me a JSON object."):
    return reference.inputs(text, [])["input_ids"][0].tolist()


@pytest.mark.parametrize("constraint", [Constraint("json", json.dumps(SCHEMA)), Constraint("regex", r"[a-c]{2,5}x"),
                                        Constraint("choice", json.dumps(["yes", "no", "maybe later"]))],
                         ids=["json_schema", "regex", "choice"])
def test_constrained_greedy_equals_the_reference_loop(parts, reference, constraint):
    ids = prompt(reference)
    params = SamplingParams(temperature=0, max_tokens=40, constraint=constraint)
    got = run(make_engine(parts), [Sequence("c", list(ids), len(ids), params)])["c"]
    assert got == reference_loop(parts, reference, ids, constraint, 40)
    assert got[-1] in parts[0].eos_token_ids  # the grammar completed, then only EOS was allowed


def test_constrained_rows_batched_with_free_ones(parts, reference):
    schema = Constraint("json", json.dumps(SCHEMA))
    validator = jsonschema_rs.validator_for(SCHEMA)
    texts = ["Hello! How are you today?", "The quick brown fox", "Numbers: 0 1 2 3", "A photo of a cat"]
    seqs = []
    for i, text in enumerate(texts):
        ids = prompt(reference, text)
        constrained = i % 2 == 0
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=60, constraint=schema if constrained else None)
        seqs.append(Sequence(f"{'j' if constrained else 'f'}{i}", ids, len(ids), params))
    free_alone = {s.request_id: run(make_engine(parts), [Sequence(s.request_id, list(s.token_ids), s.prompt_len,
                                                                   s.sampling)])[s.request_id]
                  for s in seqs if s.request_id.startswith("f")}
    outputs = run(make_engine(parts), seqs)
    tokenizer = parts[2]
    for rid, out in outputs.items():
        if rid.startswith("j"):
            assert validator.is_valid(json.loads(tokenizer.decode(out, skip_special_tokens=True)))
        else:
            assert out == free_alone[rid]  # the masks of other rows never touch this one


def test_the_grammar_state_is_rebuilt_from_the_tokens(parts, reference):
    """A decode worker (or a resumed attempt) sees the output so far as tokens; the matcher it builds
    from them continues exactly where the first worker's stopped."""
    constraint = Constraint("json", json.dumps(SCHEMA))
    ids = prompt(reference)
    whole = run(make_engine(parts), [Sequence("w", list(ids), len(ids), SamplingParams(
        temperature=0, max_tokens=40, constraint=constraint))])["w"]
    cut = 5
    resumed = Sequence("r", list(ids) + whole[:cut], len(ids) + cut, SamplingParams(
        temperature=0, max_tokens=40 - cut, constraint=constraint), output_offset=cut)
    assert whole[:cut] + run(make_engine(parts), [resumed])["r"] == whole
