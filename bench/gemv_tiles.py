"""Tiles of the few-rows GEMV (``shared.kernels.gemv``) against cuBLAS, by projection shape, on one GPU;
and of the MoE small path's two GEMVs (``shared.kernels.moe_small``) at batch 1 of Qwen3-VL-30B-A3B.

For each shape (the decoder projections of Qwen3-VL-30B-A3B and Qwen2.5-VL-7B), one weight per layer
(so nothing is read from L2 the next time), every layer's product in turn in one CUDA graph, with PDL
as serving launches them: µs per product and the bandwidth reached, for cuBLAS (``F.linear``, no norm) and
each ``(BLOCK_N, BLOCK_K, num_warps)`` of the sweep at 1 and 4 rows, with the RMSNorm fused in where the
layer fuses it (q|k|v, the router).

    python bench/gemv_tiles.py --out results/gemv_tiles.json [--moe-only | --shapes qwen3] [--rows 1]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.kernels import gemv, moe_small  # noqa: E402
from shared.kernels.moe_routing import route  # noqa: E402

SHAPES = {  # name: (outputs, inputs, layers, the RMSNorm fused in as the model runs it)
    "qwen3-30b-a3b q|k|v": (5120, 2048, 48, True), "qwen3-30b-a3b o": (2048, 4096, 48, False),
    "qwen3-30b-a3b router": (128, 2048, 48, True),
    "qwen2.5-7b q|k|v": (4608, 3584, 28, True), "qwen2.5-7b o": (3584, 3584, 28, False),
    "qwen2.5-7b gate|up": (37888, 3584, 28, False), "qwen2.5-7b down": (3584, 18944, 28, False),
}
TILES = [(4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (8, 1024, 4), (16, 512, 8), (16, 256, 4),
         (32, 256, 8), (8, 256, 4), (8, 256, 8), (4, 512, 4), (4, 256, 4), (2, 1024, 4), (2, 512, 4)]


def replay_us(fn, layers: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for i in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / layers


MOE_TILES = {  # (block_n, block_k, num_warps); the first of each is the default
    "gate_up": [(8, 256, 4), (8, 512, 4), (16, 256, 4), (4, 1024, 4), (4, 512, 4), (2, 1024, 4), (8, 512, 8),
                (16, 128, 4), (8, 512, 2)],
    "down": [(8, 256, 8), (8, 256, 4), (8, 128, 4), (4, 128, 4), (4, 256, 4), (16, 256, 8), (8, 256, 2),
             (4, 128, 2), (16, 128, 4), (2, 512, 4)],
}


def moe_sweep(dev, dtype, layers: int = 8) -> dict:
    """One token routed to 8 of 128 experts (hidden 2,048, intermediate 768) in each of ``layers`` layers of
    their own (600 MB of experts read a replay: not L2-resident): both GEMVs of a layer, one of them with
    each candidate's tiles, the other with its default."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gate_ups = [torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype) / hidden ** 0.5 for _ in range(layers)]
    downs = [torch.randn(experts, hidden, inter, device=dev, dtype=dtype) / inter ** 0.5 for _ in range(layers)]
    x = torch.randn(1, hidden, device=dev, dtype=dtype)
    routes = [route(torch.randn(1, experts, device=dev, dtype=dtype), top_k, True) for _ in range(layers)]
    expected = moe_small.gemv_experts(x, gate_ups[0], downs[0], routes[0][1], routes[0][0])
    out = {}
    for kind, candidates in MOE_TILES.items():
        for block_n, block_k, warps in candidates:
            tiles = moe_small.GemvTiles(block_n, block_k, warps)
            pair = (tiles, moe_small.DOWN) if kind == "gate_up" else (moe_small.GATE_UP, tiles)
            got = moe_small.gemv_experts(x, gate_ups[0], downs[0], routes[0][1], routes[0][0], *pair)
            assert (got.float() - expected.float()).abs().max() <= 0.05 * expected.float().abs().max()
            def fn(pair=pair):
                for gu, dn, (w, ids) in zip(gate_ups, downs, routes):
                    moe_small.gemv_experts(x, gu, dn, ids, w, *pair)
            us = replay_us(fn, layers)
            nbytes = top_k * 3 * inter * hidden * 2  # both GEMVs' experts
            out[f"{kind}_{block_n}x{block_k}w{warps}"] = {"us": us, "TBps": nbytes / us / 1e6}
        print(f"MoE layer, {kind} tiles:", ", ".join(f"{k[len(kind) + 1:]} {v['us']:.1f} µs ({v['TBps']:.2f} TB/s)"
                                                     for k, v in out.items() if k.startswith(kind)), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--moe-only", action="store_true")
    parser.add_argument("--shapes", default="", help="only the shapes whose name contains this")
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {}
    with torch.inference_mode():
        if not args.shapes:
            results["moe_small"] = moe_sweep(dev, dtype)
        shapes = {name: shape for name, shape in SHAPES.items() if args.shapes in name}
        for name, (n, k, layers, norm) in ({} if args.moe_only else shapes).items():
            weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(layers)]
            nbytes = n * k * 2
            row = results[name] = {"MB": nbytes / 1e6, "norm_fused": norm}
            norm_weight = torch.randn(k, device=dev, dtype=dtype)
            for rows in row_counts:
                x, res = (torch.randn(rows, k, device=dev, dtype=dtype) for _ in range(2))
                expected = F.linear(x, weights[0])
                us = replay_us(lambda: [F.linear(x, w) for w in weights], layers)
                row[f"cublas_r{rows}"] = {"us": us, "TBps": nbytes / us / 1e6}

                def product(w, block):  # as the layer runs it: the norm fused in where it is
                    if norm:
                        return gemv.norm_linear(x, res, norm_weight, 1e-6, w, block=block)[0]
                    return gemv.linear(x, w, block=block)

                default_tiles = gemv.tiles(n, k, rows, norm)
                want = product(weights[0], default_tiles) if norm else expected
                for block in TILES:
                    got = product(weights[0], block)
                    assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()
                    us = replay_us(lambda: [product(w, block) for w in weights], layers)
                    row["gemv_{}x{}w{}_r{}".format(*block, rows)] = {"us": us, "TBps": nbytes / us / 1e6}
                row[f"default_tiles_r{rows}"] = list(default_tiles)
                swept = {key[5:-3]: v["us"] for key, v in row.items()
                         if key.startswith("gemv_") and key.endswith(f"_r{rows}")}
                best = min((us, tile) for tile, us in swept.items())
                default = swept.get("{}x{}w{}".format(*default_tiles), math.nan)
                print(f"{name}, {rows} row(s): {row['MB']:.0f} MB{', norm fused' if norm else ''}; cuBLAS "
                      f"{row[f'cublas_r{rows}']['us']:.1f} µs (no norm), default tiles {default:.1f} µs, best "
                      f"{best[0]:.1f} µs ({best[1]}); all: " + ", ".join(f"{t} {us:.1f}" for t, us in swept.items()),
                      flush=True)
            del weights
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
