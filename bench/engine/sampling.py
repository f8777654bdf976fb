"""What one request's sampling options cost the others' steps: engine decode steps at batch 64 (2,048-token
contexts) with every row greedy, one row with every option (penalties, bias, top-k/p, min-p, seed,
logprobs), one row under a JSON-schema grammar, and every row with every option."""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.engine.common import Bench, build_lm, decode_batch, log


def run(bench: Bench, out: dict) -> None:
    import msgspec
    from transformers import AutoTokenizer

    from shared.engine.grammar import Grammars
    from shared.engine.sampling import Sampler
    from shared.messages.sampling import Constraint

    engine, cfg = build_lm(bench), bench.config
    runner = engine.runner
    tokenizer = AutoTokenizer.from_pretrained(bench.checkpoint)
    plain_sampler = runner.sampler
    runner.sampler = Sampler(bench.device, seed=0, eos_token_ids=(2,),
                             grammars=lambda: Grammars(tokenizer, cfg.text.vocab_size, (2,)))
    seqs = decode_batch(bench, "smp")
    plain = seqs[0].sampling
    everything = msgspec.structs.replace(plain, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1,
                                         repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                                         logit_bias=((11, 2.0), (12, -5.0)), logprobs=5)
    grammar = msgspec.structs.replace(plain, ignore_eos=False, constraint=Constraint("json", json.dumps({
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"]})))
    variants = {"all_greedy": {}, "one_row_every_option": {0: everything}, "one_row_json_schema": {0: grammar},
                "every_row_every_option": {i: everything for i in range(len(seqs))}}
    steps = {}
    try:
        for _ in range(10):  # warm-up: kernels, allocator, graph buckets
            engine.step()
        for name, special in variants.items():
            for i, seq in enumerate(seqs):
                seq.sampling = special.get(i, plain)
            for _ in range(3):
                engine.step()
            walls = []
            for _ in range(20):
                if bench.device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t) * 1e3)
            steps[name] = statistics.median(walls)
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
        runner.sampler = plain_sampler
    base = steps["all_greedy"]
    out.update(batch=len(seqs), engine_step_ms=steps, extra_ms_vs_greedy={k: v - base for k, v in steps.items()})
    log("sampling: " + ", ".join(f"{k} {v:.2f} ms" for k, v in steps.items()))
