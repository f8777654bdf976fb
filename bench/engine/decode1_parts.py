"""What each part of the batch-1 decode step gives, on a GPU: the step's graph replayed without the
few-rows GEMVs (norms fused into the projections, ``shared.kernels.gemv``), without programmatic dependent
launch (``shared.kernels.launch``) and without both; one token's MoE layer on the small path (GEMVs)
against the sorted path (grouped GEMMs); a layer's projections with their norms, cuBLAS against the GEMVs;
and each projection alone. Every timing is a CUDA graph over every layer's own weights in turn, so
nothing is read from L2 that a real step would read from memory."""

from __future__ import annotations

import torch

from bench.engine.common import Bench, graph_replay_ms, log
from shared.engine.sequence import Sequence


def run(bench: Bench, out: dict) -> None:
    if bench.device.type != "cuda":
        return
    out.update(moe_layer_paths(bench))
    out.update(projection_paths(bench))


def variants(bench: Bench, seq: Sequence) -> dict:
    """The batch-1 graph replay with a part switched off, on the same staged inputs (a graph of bucket 1
    captured for each)."""
    from shared.kernels import ENABLED, launch

    runner, timer = bench.engine.runner, bench.timer
    graphs, inputs = runner.graphs, runner.inputs
    before = ENABLED["gemv"], launch.ENABLED
    out = {}
    for name, gemv, pdl in (("without_pdl", True, False), ("without_gemv", False, True),
                            ("without_gemv_and_pdl", False, False)):
        ENABLED["gemv"], launch.ENABLED = gemv, pdl
        try:
            runner.capture_graphs(1, bench.max_len)
            rows = runner.stage_decode([seq])
            out[name] = timer.ms(lambda: runner.graphs.replay(rows), repeat=200, warmup=10)
        finally:
            ENABLED["gemv"], launch.ENABLED = before
            runner.graphs, runner.inputs = graphs, inputs
            torch.cuda.empty_cache()
        log(f"decode b1 {name}: graph replay {out[name]:.3f} ms")
    return out


def moe_layer_paths(bench: Bench) -> dict:
    """``moe()`` for one random hidden row, small path against sorted path, in µs a layer (MoE only). One
    layer's experts (75 MB at Qwen3-VL-30B-A3B) outgrow the 60 MB L2, so repeating one layer would not do."""
    from shared.kernels import moe as moe_kernels
    from shared.model.moe import SparseMoeBlock

    blocks = [m for m in bench.lm.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return {}
    with torch.inference_mode():
        x = torch.randn(1, bench.config.text.hidden_size, dtype=bench.dtype, device=bench.device,
                        generator=torch.Generator(bench.device).manual_seed(0))
        logits = [block.gate(x) for block in blocks]
        per_layer = {}
        for path in moe_kernels.PATHS:
            def layers(path=path):
                for block, lg in zip(blocks, logits):
                    experts = block.experts
                    moe_kernels.moe(x, lg, experts.gate_up_proj, experts.down_proj, block.top_k, block.norm_topk_prob,
                                    path=path)

            per_layer[path] = graph_replay_ms(bench, layers) * 1e3 / len(blocks)
    log(f"decode b1 MoE layer (1 token, {len(blocks)} layers in a graph): "
        + ", ".join(f"{k} {v:.1f} µs" for k, v in per_layer.items()))
    return {f"moe_layer_{k}_us": v for k, v in per_layer.items()} | {"moe_layers_timed": len(blocks)}


def projection_paths(bench: Bench) -> dict:
    """A decoder layer's projections with the norms before them, for one row, in µs a layer: residual add +
    RMSNorm kernels and cuBLAS against the GEMVs with the norms fused in, with and without PDL."""
    from shared.kernels import gemv, launch

    layers = bench.lm.layers
    gen = torch.Generator(bench.device).manual_seed(0)
    x, res = (torch.randn(1, bench.config.text.hidden_size, dtype=bench.dtype, device=bench.device, generator=gen)
              for _ in range(2))

    def unfused():
        for layer in layers:
            attn = layer.self_attn
            h, r = layer.input_layernorm.add_forward(x, res.clone())
            o = attn.o_proj(attn.qkv_proj(h)[:, :attn.q_size])
            h, r = layer.post_attention_layernorm.add_forward(o, r)
            layer.mlp.first(h)

    def fused():
        for layer in layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv, r, _ = gemv.norm_linear(x, res, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
            o = gemv.linear(qkv[:, :attn.q_size], attn.o_proj.weight)
            norm = layer.post_attention_layernorm
            gemv.norm_linear(o, r, norm.weight, norm.eps, layer.mlp.first.weight, keep=layer.mlp.finish_reads_input)

    per_layer, before = {}, launch.ENABLED
    with torch.inference_mode():
        for name, fn, pdl in (("cublas", unfused, False), ("gemv_pdl", fused, True), ("gemv", fused, False)):
            launch.ENABLED = pdl
            try:
                per_layer[name] = graph_replay_ms(bench, fn) * 1e3 / len(layers)
            finally:
                launch.ENABLED = before
    first = layers[0]
    moved = sum(w.numel() * w.element_size() for w in (first.self_attn.qkv_proj.weight, first.self_attn.o_proj.weight,
                                                        first.mlp.first.weight))
    floor = bench.bandwidth_ms(moved) * 1e3
    log("decode b1 projections a layer (norms included): " + ", ".join(f"{k} {v:.1f} µs" for k, v in per_layer.items())
        + f"; their weights' bandwidth floor {floor:.1f} µs")
    return ({f"projections_{k}_us": v for k, v in per_layer.items()} | {"projections_floor_us": floor}
            | {"projection_shapes": projection_shapes(bench)})


def projection_shapes(bench: Bench) -> dict:
    """Each projection of one row alone, cuBLAS against ``gemv.linear`` (with PDL): µs a layer and the
    bandwidth each reaches, by weight."""
    from shared.kernels import gemv

    layers = bench.lm.layers
    named = {"qkv": lambda l: l.self_attn.qkv_proj.weight, "o": lambda l: l.self_attn.o_proj.weight,
             "first": lambda l: l.mlp.first.weight}
    if hasattr(layers[0].mlp, "down_proj"):
        named["down"] = lambda l: l.mlp.down_proj.weight
    gen = torch.Generator(bench.device).manual_seed(0)
    out = {}
    with torch.inference_mode():
        for name, weight_of in named.items():
            weights = [weight_of(layer) for layer in layers]
            x = torch.randn(1, weights[0].shape[1], dtype=bench.dtype, device=bench.device, generator=gen)
            for kind, fn in (("cublas", lambda: [torch.nn.functional.linear(x, w) for w in weights]),
                             ("gemv", lambda: [gemv.linear(x, w) for w in weights])):
                us = graph_replay_ms(bench, fn) * 1e3 / len(layers)
                nbytes = weights[0].numel() * weights[0].element_size()
                out[f"{name}_{kind}"] = {"us": us, "TBps": nbytes / us / 1e6, "MB": nbytes / 1e6,
                                         "tiles": gemv.tiles(*weights[0].shape) if kind == "gemv" else None}
    log("decode b1 each projection a layer: " + ", ".join(
        f"{k} {v['us']:.1f} µs ({v['MB']:.0f} MB, {v['TBps']:.2f} TB/s)" for k, v in out.items()))
    return out
