"""Text prefills from chat-sized to image-sized prompts (``--prefill-lengths``): each through the prefill
graphs and eagerly (with how far apart their logits are), against both floors (FLOPs over the matmul rate;
the bytes of the weights it reads — MoE: the experts its tokens touched, counted — over the copy
bandwidth), with its kernels' time by name."""

from __future__ import annotations

from bench.engine.common import Bench, build_lm, forced_logits, log, run_prefill, without_pieces
from bench.engine.profiling import kernel_table
from bench.engine.roofline import TouchedExperts, expert_bytes, prefill_flops, shared_weight_bytes


def run(bench: Bench, out: dict) -> None:
    engine = build_lm(bench)
    lm, timer = bench.lm, bench.timer
    rows = out.setdefault("prompts", [])
    for length in bench.prefill_lengths if bench.big else [24, 96]:
        tokens = [100 + (i * 7919) % (bench.vocab - 100) for i in range(length)]  # spread over the vocabulary
        ms = timer.ms(lambda: run_prefill(engine, tokens, []), repeat=5, warmup=2)
        eager_ms, agreement = None, None
        if lm.pieces is not None:  # the same prefill without the graphs, and how far apart their logits are
            with_pieces = forced_logits(engine, tokens, [])[0]
            with without_pieces(lm):
                eager_ms = timer.ms(lambda: run_prefill(engine, tokens, []), repeat=5, warmup=2)
                eager = forced_logits(engine, tokens, [])[0]
            agreement = {"same_argmax": bool(with_pieces.argmax() == eager.argmax()),
                         "max_abs_diff": float((with_pieces - eager).abs().max()),
                         "logit_scale": float(eager.abs().max())}
        with without_pieces(lm), TouchedExperts(lm) as touched:  # graph replays do not call back into Python
            run_prefill(engine, tokens, [])
        experts = touched.per_step()
        if expert_bytes(lm) and not experts:  # no MoE layer counted its experts: the bytes floor leaves them out
            log(f"prefill_sizes {length} tokens: no MoE layer counted its experts; the bytes floor omits them")
        read = shared_weight_bytes(lm) + experts * expert_bytes(lm)
        bytes_ms, flop_ms = bench.bandwidth_ms(read), bench.compute_ms(prefill_flops(bench.config, length))
        kernels, kernel_us = kernel_table(bench, lambda: run_prefill(engine, tokens, []))
        row = {"tokens": length, "ms": ms, "eager_ms": eager_ms, "graphs_vs_eager_logits": agreement,
               "floor_flops_ms": flop_ms, "floor_bytes_ms": bytes_ms, "experts_touched": experts, "GB_read": read / 1e9,
               "ratio_to_floor": ms / max(flop_ms, bytes_ms, 1e-9), "kernels": kernels, "kernel_us_total": kernel_us}
        rows.append(row)
        log(f"prefill_sizes {length} tokens: {ms:.1f} ms (eager {eager_ms and round(eager_ms, 1)} ms; logits "
            f"{agreement}); floors: FLOPs {flop_ms:.1f} ms, bytes {bytes_ms:.1f} ms ({read / 1e9:.1f} GB, {experts} "
            f"experts) -> {row['ratio_to_floor']:.2f}x; kernels {kernel_us / 1e3:.1f} ms")
