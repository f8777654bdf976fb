"""Tiles of the few-rows GEMV (``shared.kernels.gemv``) against cuBLAS, by projection shape, on one GPU.

For each shape (the decoder projections of Qwen3-VL-30B-A3B and Qwen2.5-VL-7B), one weight per layer
(so nothing is read from L2 the next time), every layer's product in turn in one CUDA graph, with PDL
as serving launches them: µs per product and the bandwidth reached, for cuBLAS (``F.linear``) and each
``(BLOCK_N, BLOCK_K, num_warps)`` of the sweep at 1 and 4 rows.

    python bench/gemv_tiles.py --out results/gemv_tiles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.kernels import gemv  # noqa: E402

SHAPES = {  # name: (outputs, inputs, layers)
    "qwen3-30b-a3b q|k|v": (5120, 2048, 48), "qwen3-30b-a3b o": (2048, 4096, 48),
    "qwen3-30b-a3b router": (128, 2048, 48),
    "qwen2.5-7b q|k|v": (4608, 3584, 28), "qwen2.5-7b o": (3584, 3584, 28),
    "qwen2.5-7b gate|up": (37888, 3584, 28), "qwen2.5-7b down": (3584, 18944, 28),
}
TILES = [(4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (8, 1024, 4), (16, 512, 8), (16, 256, 4),
         (32, 256, 8)]


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {}
    with torch.inference_mode():
        for name, (n, k, layers) in SHAPES.items():
            weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(layers)]
            nbytes = n * k * 2
            row = results[name] = {"MB": nbytes / 1e6}
            for rows in (1, 4):
                x = torch.randn(rows, k, device=dev, dtype=dtype)
                expected = F.linear(x, weights[0])
                us = replay_us(lambda: [F.linear(x, w) for w in weights], layers)
                row[f"cublas_r{rows}"] = {"us": us, "TBps": nbytes / us / 1e6}
                for block in TILES:
                    got = gemv.linear(x, weights[0], block=block)
                    assert (got.float() - expected.float()).abs().max() < 0.05 * expected.float().abs().max()
                    us = replay_us(lambda: [gemv.linear(x, w, block=block) for w in weights], layers)
                    row["gemv_{}x{}w{}_r{}".format(*block, rows)] = {"us": us, "TBps": nbytes / us / 1e6}
                row[f"default_tiles_r{rows}"] = list(gemv.tiles(n, k, rows))
            best = {r: min((v["us"], key) for key, v in row.items() if key.startswith("gemv_") and key.endswith(f"_r{r}"))
                    for r in (1, 4)}
            print(f"{name}: {row['MB']:.0f} MB; cuBLAS {row['cublas_r1']['us']:.1f} µs "
                  f"({row['cublas_r1']['TBps']:.2f} TB/s), best GEMV {best[1][0]:.1f} µs ({best[1][1]}); 4 rows: cuBLAS "
                  f"{row['cublas_r4']['us']:.1f}, best {best[4][0]:.1f} ({best[4][1]})", flush=True)
            del weights
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
