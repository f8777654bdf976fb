"""Chunked prefill and the prefix cache: the 10,903-token image prompt at several step budgets against
unchunked (chunks after a prefix attended the split way and by the paged Triton kernel); a mixed step (64
decode rows at 2k context + a prompt chunk) against a pure decode step and the chunk alone; the same prompt
again from the prefix cache; and one layer's attention for a chunk after a prefix, kernel by kernel."""

from __future__ import annotations

import statistics
import time

import torch

from bench.engine.common import Bench, build_lm, image_prompt, log, new_seq, run_prefill
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence


def run(bench: Bench, out: dict) -> None:
    build_lm(bench)
    out["budgets"] = budgets(bench)
    out["mixed"] = mixed_steps(bench)
    out["prefix_hit"] = prefix_hit(bench)
    out["attention"] = attention_after_prefix(bench)


def engine_like(bench: Bench, **options) -> Engine:
    """Another engine on the built runner (its graphs, its KV pool): one engine holds sequences at a time."""
    return Engine(bench.engine.runner, (2,), bench.max_len, "both", **{"max_num_seqs": bench.max_batch, **options})


def synced_ms(bench: Bench, fn) -> float:
    t = time.perf_counter()
    fn()
    if bench.device.type == "cuda":
        torch.cuda.synchronize()  # steps that sample nothing (a chunk mid-prompt) return before the GPU is done
    return (time.perf_counter() - t) * 1e3


def budgets(bench: Bench) -> dict:
    """Time to the first token of the image prompt when prefilled in chunks of each budget."""
    tokens, images = image_prompt(bench)
    runs = {"unchunked": engine_like(bench, max_batched_tokens=len(tokens), chunked_prefill=False, prefix_caching=False)}
    for budget in (1024, 2048, 4096, 8192, 16384) if bench.big else (16, 32, 64, 128):
        runs[str(budget)] = engine_like(bench, max_batched_tokens=budget, prefix_caching=False)
    backend = bench.engine.runner.backend
    ways = ["split", "paged"] if getattr(backend, "prefix_chunks", None) else [None]  # chunks after a prefix
    result = {}
    for name, engine in runs.items():
        for way in ways if name != "unchunked" else ways[:1]:
            if way:
                backend.prefix_chunks = way
            ms = bench.timer.ms(lambda: run_prefill(engine, tokens, images), repeat=3, warmup=1)
            key = name if way in (None, "split") or name == "unchunked" else f"{name}_{way}"
            result[key] = {"ms": ms, "tokens_per_s": len(tokens) / (ms / 1e3), "prefix_chunks": way}
    if ways[0]:
        backend.prefix_chunks = "split"
    base = result["unchunked"]["ms"]
    for name, row in result.items():
        row["vs_unchunked"] = base / row["ms"]
        log(f"chunked prefill {len(tokens)} tokens, budget {name}: {row['ms']:.1f} ms, "
            f"{row['tokens_per_s']:.0f} tokens/s ({row['vs_unchunked']:.2f}x unchunked)")
    return result


def mixed_steps(bench: Bench) -> dict:
    """Decode rows: a pure decode step (graph replay), the same rows with a prompt chunk riding along (one
    eager step), and that chunk alone (after an equal prefix)."""
    rows, context = bench.decode_shape
    result = {}
    for chunk in (256, 1024, 2048, 4096) if bench.big else (16, 32):
        # room for one sequence beside the rows: with max_num_seqs taken, the prompt would never join a step
        engine = engine_like(bench, max_batched_tokens=rows + chunk, prefix_caching=False, max_num_seqs=rows + 1)
        seqs = rows_with_random_kv(bench, engine, rows, context)
        decode_ms = statistics.median(synced_ms(bench, engine.step) for _ in range(10))
        prompt = new_seq("mixed", [11] * (chunk * 3 + 1), 1)
        engine.add_prompt(prompt)
        engine.step()  # first chunk (no prefix); the next ones read a prefix like a continuing prompt
        mixed_ms = statistics.median(synced_ms(bench, engine.step) for _ in range(2))
        for seq in seqs + [prompt]:
            engine.abort(seq.request_id)
        alone = engine_like(bench, max_batched_tokens=chunk, prefix_caching=False)
        prompt = new_seq("alone", [11] * (chunk * 3 + 1), 1)
        alone.add_prompt(prompt)
        alone.step()
        chunk_ms = statistics.median(synced_ms(bench, alone.step) for _ in range(2))
        alone.abort(prompt.request_id)
        result[chunk] = {"decode_step_ms": decode_ms, "mixed_step_ms": mixed_ms, "chunk_alone_ms": chunk_ms,
                         "decode_rows_in_mixed_ms": mixed_ms - chunk_ms}
        log(f"mixed step: {rows} decode rows @{context} + {chunk}-token chunk {mixed_ms:.2f} ms; pure decode "
            f"{decode_ms:.2f} ms, chunk alone {chunk_ms:.2f} ms (rows add {mixed_ms - chunk_ms:.2f} ms)")
    return {"rows": rows, "context": context, "by_chunk": result}


def rows_with_random_kv(bench: Bench, engine: Engine, rows: int, context: int) -> list[Sequence]:
    cfg = bench.config
    seqs = []
    for i in range(rows):
        seq = Sequence(f"rows-{i}", [7] * context, context - 1,
                       SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True), num_computed=context - 1)
        engine.reserve(seq)
        engine.write_kv(seq.request_id, torch.randn(cfg.text.num_layers, 2, context - 1, cfg.text.num_kv_heads,
                                                    cfg.text.head_dim, dtype=bench.dtype, device=bench.device))
        engine.activate(seq.request_id)
        seqs.append(seq)
    engine.step()  # settle: every row has generated once
    return seqs


def prefix_hit(bench: Bench) -> dict:
    """The image prompt twice (images named by content hash): computed, then from the prefix cache."""
    tokens, images = image_prompt(bench)
    for i, image in enumerate(images):
        image.content_hash = f"bench-image-{i}"
    engine = engine_like(bench, max_batched_tokens=16384 if bench.big else 128)
    cold = synced_ms(bench, lambda: run_prefill(engine, tokens, images))
    hit = statistics.median(synced_ms(bench, lambda: run_prefill(engine, tokens, images)) for _ in range(3))
    log(f"prefix cache: {len(tokens)}-token prompt {cold:.1f} ms computed, {hit:.1f} ms from the cache "
        f"({engine.cached_prompt_tokens} cached tokens over 4 runs)")
    return {"tokens": len(tokens), "computed_ms": cold, "cached_ms": hit, "cached_tokens": engine.cached_prompt_tokens}


def attention_after_prefix(bench: Bench) -> dict:
    """One layer's prefill attention for a chunk after a prefix: the paged Triton kernel, gathering the KV for
    SDPA with a lower-right causal mask, and the engine's split (two fused calls merged by their log-sum-exps);
    and for a chunk with no prefix, the kernel against SDPA."""
    if bench.device.type != "cuda":
        return {"skipped": "no GPU (tests/test_kernels.py checks the kernel in Triton's interpreter)"}
    from torch.nn.attention.bias import causal_lower_right

    from shared.engine.attention import causal_attention, split_chunk_attention
    from shared.kernels.attention import paged_prefill_attention

    cfg, dev, dtype, timer = bench.config, bench.device, bench.dtype, bench.timer
    heads, kv_heads, dim, bs = cfg.text.num_heads, cfg.text.num_kv_heads, cfg.text.head_dim, 16
    result = {}
    for prefix, chunk in ((0, 2048), (2048, 2048), (8192, 2048), (8192, 2711), (8192, 512), (4096, 256)):
        ctx_len = prefix + chunk
        blocks = (ctx_len + bs - 1) // bs
        k_cache = torch.randn(blocks + 1, bs, kv_heads, dim, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=dev).add(1).to(torch.int32)[None]
        q = torch.randn(chunk, heads, dim, device=dev, dtype=dtype)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        lens = torch.tensor([ctx_len], dtype=torch.int32, device=dev)
        slots = (table[0].long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:ctx_len]
        kernel = timer.ms(lambda: paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, dim ** -0.5, chunk))

        def gathered():
            k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
            if prefix == 0:
                return causal_attention(q, k, v)
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            ks, vs = ks.repeat_interleave(heads // kv_heads, 1), vs.repeat_interleave(heads // kv_heads, 1)
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(chunk, ctx_len))

        sdpa = timer.ms(gathered)
        flops = 4 * chunk * (prefix + chunk / 2) * heads * dim
        row = {"triton_ms": kernel, "gather_sdpa_ms": sdpa, "triton_TFLOPs": flops / kernel / 1e9}
        if prefix:  # what the engine runs: gather, two fused calls, the merge
            new = torch.randn(chunk, kv_heads, dim, device=dev, dtype=dtype)
            pool_k, pool_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
            row["split_ms"] = timer.ms(lambda: split_chunk_attention(
                q, pool_k[slots[:prefix]], pool_v[slots[:prefix]], new, new))
            row["split_TFLOPs"] = flops / row["split_ms"] / 1e9
        result[f"prefix{prefix}_chunk{chunk}"] = row
        log(f"prefill attention, chunk {chunk} after {prefix}: paged Triton {kernel:.3f} ms "
            f"({flops / kernel / 1e9:.0f} TFLOP/s), gather + SDPA {sdpa:.3f} ms, split {row.get('split_ms')}")
    return result
