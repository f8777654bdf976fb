"""The prefill of the four-1080p-image prompt (10,903 tokens), against its FLOPs (active parameters: top-k
experts for a MoE model; causal attention) over this run's matmul rate."""

from __future__ import annotations

from bench.engine.common import Bench, build_lm, image_prompt, log, run_prefill
from bench.engine.roofline import prefill_flops


def run(bench: Bench, out: dict) -> None:
    engine = build_lm(bench)
    tokens, images = image_prompt(bench)
    ms = bench.timer.ms(lambda: run_prefill(engine, tokens, images), repeat=3, warmup=1)
    flops = prefill_flops(bench.config, len(tokens))
    floor = bench.compute_ms(flops)
    out.update(tokens=len(tokens), ms=ms, TFLOP=flops / 1e12, compute_floor_ms=floor,
               ratio_to_floor=ms / floor if floor else None)
    log(f"prefill {len(tokens)} tokens: {ms:.1f} ms, {flops / 1e12:.0f} TFLOP, floor {floor:.1f} ms "
        f"({ms / max(floor, 1e-9):.2f}x)")
