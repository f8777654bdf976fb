"""Our video arithmetic against HF's video processors (``tests/data/hf_video_reference.json``).

HF's video processors need torchvision, which has no build beside the pinned CPU torch; the fixture was
written by ``tests/hf_video_reference.py`` where they run (the GPU machine: transformers 5.17 there,
whose video-processing arithmetic is 5.24's), and this test replays it here: frame sampling, resize
within the token budget (cap_pixels_per_frame), grids, Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's
timestamps — and the patches themselves, bit for bit (SHA-256 of HF's float32 pixel_values_videos on CPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from shared.model.video import VideoGeometry, video_processor_config
from shared.model.video_processor import VideoPreprocessor
from tests.hf_video_reference import ours, seeded_clip

FIXTURE = json.loads((Path(__file__).parent / "data" / "hf_video_reference.json").read_text())


def _geometry(name: str) -> VideoGeometry:
    entry = FIXTURE["configs"][name]
    return VideoGeometry.from_config(entry["family"], entry["config"])


@pytest.mark.parametrize("case", FIXTURE["clips"], ids=lambda c: f"{c['config']}-{c['clip']}")
def test_sampling_grid_and_timing_match_hf(case):
    mine = ours(_geometry(case["config"]), tuple(case["clip"]))
    assert mine["indices"] == case["indices"]
    assert mine["grid"] == case["grid"]
    assert mine["second_per_grid"] == pytest.approx(case["second_per_grid"], rel=1e-12)
    if "timestamps" in case:
        assert mine["timestamps"] == pytest.approx(case["timestamps"], rel=1e-12)


@pytest.mark.parametrize("case", FIXTURE["pixels"], ids=lambda c: f"{c['config']}-seed{c['seed']}")
def test_patches_are_hf_bit_for_bit(case):
    entry = FIXTURE["configs"][case["config"]]
    processor = VideoPreprocessor.from_config(entry["family"], entry["config"])
    frames, fps, height, width = case["clip"]
    clip = seeded_clip(case["seed"], frames, height, width)
    indices = processor.geometry.sample(frames, fps)
    patches, grid = processor(torch.from_numpy(clip[indices]))
    assert list(grid) == case["grid"]
    assert hashlib.sha256(patches.numpy().tobytes()).hexdigest() == case["sha256"]


def test_config_found_where_hf_looks(tmp_path):
    """No video config: the image processor's (Qwen2.5-VL), whose min/max_pixels bound each frame."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 1003520}))
    geometry = VideoGeometry.from_checkpoint(tmp_path, "qwen2_5_vl")
    assert (geometry.min_pixels, geometry.max_pixels, geometry.fps) == (3136, 1003520, 2.0)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 1,
                                                                                   "longest_edge": 2}}))
    assert video_processor_config(tmp_path)["size"]["longest_edge"] == 2


@pytest.mark.parametrize("frames", [0, 1])
def test_too_few_frames_is_an_error_not_a_crash(frames):
    for name in ("tiny-qwen2_5_vl", "tiny-qwen3_vl"):
        with pytest.raises(ValueError):
            _geometry(name).sample(frames, 30.0)



def test_qwen2_frame_indices_are_torchs_float32_arange():
    """The processor picks frames at ``torch.arange(0, total, total / n).int()``; the frontend computes the
    same indices with numpy, so it never loads torch. Every clip of up to 1,000 frames, every count."""
    base = _geometry("tiny-qwen2_5_vl")
    tps = base.temporal_patch_size
    for total in range(tps, 1001):
        for n in range(tps, min(total, 128) + 1, tps):
            geometry = dataclasses.replace(base, fps=1e-9, min_frames=n, max_frames=10**6)  # n frames exactly
            assert geometry.sample(total, 1.0) == torch.arange(0, total, total / n).int().tolist(), (total, n)
