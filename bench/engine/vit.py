"""The vision tower on 1, 4 and 8 1080p images against HF's tower (1 and 4) and, for towers with full
attention in every block, its FLOPs over this run's matmul rate; and its agreement with HF's output on the
same weights."""

from __future__ import annotations

import torch

from bench.engine import hf
from bench.engine.common import Bench, log
from bench.engine.roofline import vit_flops
from shared.model.loader import load_into, load_vision_tower


def run(bench: Bench, out: dict) -> None:
    dev, cfg, timer = bench.device, bench.config, bench.timer
    tower = load_vision_tower(None, cfg, dev, bench.dtype, load_format="dummy")
    grid = bench.grid_1080p if bench.big else (1, 8, 12)
    n = grid[1] * grid[2]
    hf_visual = hf.vision_tower(bench)
    out["grid"] = grid
    for images in (1, 4, 8):
        patches = torch.randn(images * n, cfg.vision.patch_dim, dtype=bench.dtype, device=dev)
        grids = [grid] * images
        with torch.inference_mode():
            ours = timer.ms(lambda: tower(patches, grids), repeat=5 if bench.big else 2, warmup=2)
            theirs = None
            if images <= 4:
                thw = torch.tensor(grids, device=dev)
                theirs = timer.ms(lambda: hf_visual(patches, grid_thw=thw), repeat=3 if bench.big else 1, warmup=1)
        # full attention in every block (Qwen2-VL, Qwen3-VL): the FLOPs are exact; windowed towers do fewer
        floor = bench.compute_ms(vit_flops(cfg.vision, n, images)) if cfg.vision.window_size == 0 else None
        out[images] = {"ours_ms": ours, "ours_ms_per_image": ours / images, "hf_ms": theirs,
                       "compute_floor_ms": floor, "ratio_to_floor": ours / floor if floor else None}
        log(f"vit {images} image(s): ours {ours:.1f} ms ({ours / images:.1f}/image), hf {theirs and round(theirs, 1)} ms"
            f", floor {floor and round(floor, 1)} ms")
    with torch.inference_mode():  # agreement with HF on one image (same weights copied over)
        patches = torch.randn(n, cfg.vision.patch_dim, dtype=bench.dtype, device=dev)
        load_into(tower, iter(hf_visual.state_dict().items()))  # the checkpoint loading path, fusing included
        a = tower(patches, [grid]).float()
        hf_out = hf_visual(patches, grid_thw=torch.tensor([grid], device=dev))
        b = torch.cat([hf_out.pooler_output, *(getattr(hf_out, "deepstack_features", None) or [])], -1).float()
        out["rel_error_vs_hf"] = (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()
    log(f"vit rel. error vs HF: {out['rel_error_vs_hf']:.1e}")
