"""The vision tower over video clips (720p at 2 sampled frames a second, the video processor's token
budget): frames → patches on the device, one clip's forward and four clips batched (patches and sampled
frames a second, against the FLOP floor for full-attention towers), HF's tower on the short clip; and the
frontend's cost, PyAV decoding the 30 fps source, per frame it decodes (needs PyAV on the GPU machine)."""

from __future__ import annotations

import statistics
import time

import torch

from bench.engine import hf
from bench.engine.common import Bench, log
from bench.engine.roofline import vit_flops
from shared.model.loader import load_vision_tower


def run(bench: Bench, out: dict) -> None:
    from shared.model.video_processor import VideoPreprocessor

    dev, cfg, timer = bench.device, bench.config, bench.timer
    processor = VideoPreprocessor.from_checkpoint(bench.checkpoint, bench.dtype)
    g = processor.geometry
    tower = load_vision_tower(None, cfg, dev, bench.dtype, load_format="dummy")
    hf_visual = hf.vision_tower(bench)
    height, width = (720, 1280) if bench.big else (120, 160)
    out.update(resolution=f"{width}x{height}", budget={"cap_pixels_per_frame": g.cap_pixels_per_frame,
                                                      "max_video_tokens": g.max_video_tokens})
    repeat, short = (5, 10) if bench.big else (2, 2)
    for seconds in (10, 30) if bench.big else (2, 4):
        frames = g.sampled_count(seconds * 30, 30.0)
        grid = g.grid(frames, height, width)
        pixels = torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8)
        prep_ms = timer.ms(lambda: processor(pixels.to(dev)), repeat=repeat, warmup=1)
        patches, _ = processor(pixels.to(dev))
        row = out[f"{seconds}s"] = {"frames": frames, "grid": grid, "patches": patches.shape[0],  # kept if a fault follows
                                    "tokens": patches.shape[0] // cfg.vision.merge_size ** 2, "preprocess_ms": prep_ms}
        row["decode"] = decode_cost(seconds, width, height, g)  # the CPU's part first: a GPU fault keeps it
        with torch.inference_mode():
            for clips in (1, 4):
                log(f"video {seconds}s: ViT over {clips} clip(s), grid {grid}")
                batch = patches.repeat(clips, 1)
                ms = timer.ms(lambda: tower(batch, [grid] * clips), repeat=repeat, warmup=1)
                floor = bench.compute_ms(vit_flops(cfg.vision, grid[1] * grid[2], grid[0] * clips)) \
                    if cfg.vision.window_size == 0 else None
                row[f"vit_{clips}"] = {"ms": ms, "patches_per_s": batch.shape[0] / ms * 1e3,
                                       "sampled_frames_per_s": frames * clips / ms * 1e3, "compute_floor_ms": floor}
            if seconds == short:
                thw = torch.tensor([grid], device=dev)
                row["hf_vit_ms"] = timer.ms(lambda: hf_visual(patches, grid_thw=thw), repeat=2, warmup=1)
        log(f"video {seconds}s {width}x{height}: {frames} frames → grid {grid} ({row['tokens']} tokens); "
            f"preprocess {prep_ms:.1f} ms, ViT {row['vit_1']['ms']:.1f} ms ({row['vit_1']['patches_per_s']:.3g} "
            f"patches/s), 4 clips {row['vit_4']['ms']:.1f} ms, HF {row.get('hf_vit_ms')}; decode {row['decode']}")


def decode_cost(seconds: int, width: int, height: int, geometry) -> dict:
    """The frontend's decode of one synthetic H.264 clip at 30 fps (CPU, frame threads), per frame decoded."""
    try:
        from services.frontend.video import VideoLimits, decode_video
        from tools.bench.video import make_clip
    except ImportError as err:  # PyAV missing on this machine
        return {"skipped": f"{err}"}
    data = make_clip(0, seconds, 30, width, height)
    limits = VideoLimits(max_seconds=600, max_fps=240, max_frames=768, max_frame_pixels=1 << 30, decode_timeout=600)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        decoded = decode_video(data, geometry, limits)
        times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    decoded_frames = decoded.sampling.frame_indices[-1] + 1  # decoding stops after the last sampled frame
    return {"bytes": len(data), "ms": ms, "frames_decoded": decoded_frames, "frames_sampled": decoded.num_frames,
            "ms_per_decoded_frame": ms / decoded_frames}
