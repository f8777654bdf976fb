#!/usr/bin/env python3
"""What one request's sampling options cost the other requests of its batch: the sampler's time per decode
step (random logits, so the model's forward is left out) for a batch of plain greedy rows, then the same
batch with one row asking for everything (penalties, bias, min-p/top-k/top-p, seeded, logprobs), one row
under a JSON-schema grammar, and every row asking for everything.

    python bench/sampling_overhead.py [--batch 32] [--vocab 152064] [--device cpu|cuda] [--steps 50]

``--vocab`` at the 152k of Qwen2.5-VL is the realistic case; the grammar rows use the qwen2.5-vl-7b preset's
tokenizer (the tiny trained BPE filled to that vocabulary) when the vocabulary is that large, else the tiny's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.grammar import Grammars  # noqa: E402
from shared.engine.sampling import Constraint, Sampler, SamplingParams  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402

EVERYTHING = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=7, repetition_penalty=1.1,
                  presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((11, 2.0), (12, -5.0)), logprobs=5,
                  min_tokens=4)
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]}


def tokenizer_for(vocab: int):
    from transformers import AutoTokenizer

    from shared.model.presets import materialize_preset
    from shared.model.tiny import default_tiny_checkpoint

    return AutoTokenizer.from_pretrained(materialize_preset("qwen2.5-vl-7b") if vocab > 1000 else default_tiny_checkpoint())


def batch(size: int, special: dict[int, SamplingParams], vocab: int) -> list[Sequence]:
    plain = SamplingParams(temperature=0, max_tokens=4096)
    seqs = []
    for i in range(size):
        prompt = [(i * 7 + j) % vocab for j in range(200)]
        seqs.append(Sequence(f"r{i}", prompt, len(prompt), special.get(i, plain)))
    return seqs


def step_ms(sampler: Sampler, seqs: list[Sequence], vocab: int, device: str, steps: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for step in range(steps + 5):
        logits = torch.randn(len(seqs), vocab, generator=gen, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = sampler.sample(logits, seqs)
        for seq in seqs:
            sampler.take_logprobs(seq)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 5:
            times.append((time.perf_counter() - t) * 1e3)
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
    return statistics.median(times)


def run(batch_size: int, vocab: int, device: str, steps: int) -> dict[str, float]:
    tokenizer = tokenizer_for(vocab)
    grammar = Constraint("json", json.dumps(SCHEMA))
    cases = {
        "all plain (greedy)": {},
        "one row: every option": {0: SamplingParams(max_tokens=4096, **EVERYTHING)},
        "one row: json schema": {0: SamplingParams(temperature=0, max_tokens=4096, constraint=grammar)},
        "every row: every option": {i: SamplingParams(max_tokens=4096, **EVERYTHING) for i in range(batch_size)},
    }
    results = {}
    for name, special in cases.items():
        sampler = Sampler(device, seed=0, eos_token_ids=(2,),
                          grammars=lambda: Grammars(tokenizer, vocab, (tokenizer.eos_token_id,)))
        results[name] = step_ms(sampler, batch(batch_size, special, vocab), vocab, device, steps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[499, 152064])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, batch {args.batch}; "
          "median ms per sampling step")
    for vocab in args.vocab:
        for name, ms in run(args.batch, vocab, args.device, args.steps).items():
            print(f"vocab {vocab:6}  {name:26} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
