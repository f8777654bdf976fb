#!/usr/bin/env python3
"""Structured-output mask time per decode step on CPU: xgrammar against llguidance, the tiny model's
vocabulary (499 tokens) and a 152k one (the qwen2.5-vl-7b preset's tokenizer: the tiny trained BPE filled
to the model's vocabulary size), for a JSON schema, free JSON and a regex. Each step: compute the row's
token bitmask, apply it to a [1, vocab] logits row, sample greedily among allowed tokens, accept it.

    python bench/grammar_mask.py [--steps 64]
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

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
CASES = {"json_schema": ("json", json.dumps(SCHEMA)), "json_object": ("json", ""), "regex": ("regex", r"[a-z]{3,8}-\d{2,6}")}


def tokenizers():
    from transformers import AutoTokenizer

    from shared.model.presets import materialize_preset
    from shared.model.tiny import default_tiny_checkpoint

    return {"tiny-499": AutoTokenizer.from_pretrained(default_tiny_checkpoint()),
            "preset-152k": AutoTokenizer.from_pretrained(materialize_preset("qwen2.5-vl-7b"))}


def run_xgrammar(tok, kind, spec, steps, gen):
    import xgrammar as xgr

    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t = time.perf_counter()
    compiled = (compiler.compile_json_schema(spec) if kind == "json" and spec else compiler.compile_builtin_json_grammar()
                if kind == "json" else compiler.compile_regex(spec))
    compile_ms = (time.perf_counter() - t) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=gen)
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        times.append((time.perf_counter() - t) * 1e3)
        token = int(logits.argmax())
        if not matcher.accept_token(token) or matcher.is_terminated():
            break
    return compile_ms, times


def run_llguidance(tok, kind, spec, steps, gen):
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch

    vocab = len(tok)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t = time.perf_counter()
    grammar = (llg.LLMatcher.grammar_from_json_schema(spec or '{"type": "object"}') if kind == "json"
               else llg.LLMatcher.grammar_from_regex(spec))
    matcher = llg.LLMatcher(lltok, grammar)
    compile_ms = (time.perf_counter() - t) * 1e3
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=gen)
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        times.append((time.perf_counter() - t) * 1e3)
        token = int(logits.argmax())
        if not matcher.consume_token(token) or matcher.is_stopped():
            break
    return compile_ms, times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; median / p90 ms per step (mask + apply), compile ms")
    for vocab_name, tok in tokenizers().items():
        for case, (kind, spec) in CASES.items():
            for lib, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
                compile_ms, times = fn(tok, kind, spec, args.steps, torch.Generator().manual_seed(0))
                times.sort()
                print(f"{vocab_name:12} {case:12} {lib:11} steps={len(times):3} median={statistics.median(times):7.3f} "
                      f"p90={times[int(0.9 * (len(times) - 1))]:7.3f} compile={compile_ms:8.1f}")


if __name__ == "__main__":
    main()
