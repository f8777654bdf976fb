"""HF's video processors on saved frames → ``tests/data/hf_video_reference.json``, the fixture that
``tests/test_video_geometry.py`` checks our arithmetic against.

HF's video processors need torchvision, which has no build beside the CPU torch we pin, so this script
runs where torchvision does (the GPU machine: ``python3 tests/hf_video_reference.py OUT_DIR``; its
transformers 5.17 runs the same video arithmetic as 5.24 — sampling, cap, resize, patchify, timestamps —
and the fixture records the versions). For each processor config and clip it records what HF computes:
the sampled frame indices, the grid, Qwen2.5-VL's ``second_per_grid_ts``, Qwen3-VL's frame timestamps,
and for small seeded clips a SHA-256 of the float32 ``pixel_values_videos`` (on CPU). It also compares our
``shared.model.video`` / ``video_processor`` with HF on the spot, on CPU and, where there is one, on the GPU.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from shared.model import qwen3_checkpoint, tiny
from shared.model.video import VideoGeometry
from shared.model.video_processor import VideoPreprocessor

CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
# (name, family, file name, config): the tiny checkpoints' own, Qwen2.5-VL-7B's image config (it ships no
# video config: HF falls back to it), and Qwen3-VL's published video config.
CONFIGS = [
    ("tiny-qwen2_5_vl", "qwen2_5_vl", "video_preprocessor_config.json", tiny.video_processor_config("qwen2_5_vl")),
    ("tiny-qwen3_vl", "qwen3_vl", "video_preprocessor_config.json", tiny.video_processor_config("qwen3_vl")),
    ("qwen2.5-vl-7b", "qwen2_5_vl", "preprocessor_config.json",
     {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
      "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
      "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3, "rescale_factor": 1 / 255, **CLIP}),
    ("qwen3-vl", "qwen3_vl", "video_preprocessor_config.json",
     {k: v for k, v in qwen3_checkpoint.video_processor_config().items()
      if k not in ("cap_pixels_per_frame", "max_video_tokens", "fps", "min_frames", "max_frames")}),
]
# (frames, source fps, height, width)
CLIPS = [(30, 10.0, 60, 80), (61, 29.97, 64, 48), (7, 3.0, 100, 30), (5, 25.0, 40, 40), (3, 1.0, 56, 56),
         (2, 30.0, 28, 28), (240, 24.0, 720, 1280), (900, 30.0, 720, 1280), (150, 25.0, 360, 640),
         (1000, 60.0, 480, 854), (45, 15.0, 1280, 720), (12, 2.0, 200, 3000), (31, 7.0, 33, 47)]
# seeded clips whose pixels are compared: (config name, seed, frames, fps, height, width)
PIXEL_CLIPS = [("tiny-qwen2_5_vl", 1, 20, 10.0, 60, 80), ("tiny-qwen2_5_vl", 2, 20, 10.0, 120, 160),
               ("tiny-qwen2_5_vl", 3, 9, 3.0, 30, 41), ("tiny-qwen3_vl", 4, 20, 8.0, 50, 70),
               ("tiny-qwen3_vl", 5, 11, 5.0, 97, 61)]


def seeded_clip(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def hf_processor(family: str, directory: Path):
    if family.startswith("qwen3"):
        from transformers import Qwen3VLVideoProcessor as cls
    else:
        from transformers import Qwen2VLVideoProcessor as cls
    return cls.from_pretrained(str(directory))


def hf_run(processor, family: str, video, fps: float, device: str = "cpu"):
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(total_num_frames=int(video.shape[0]), fps=fps)
    kwargs = dict(do_sample_frames=True, video_metadata=[metadata], return_metadata=True,
                  cap_pixels_per_frame=True, return_tensors="pt", device=device, input_data_format="channels_last")
    if not family.startswith("qwen3"):
        kwargs["fps"] = 2  # Qwen2VLVideoProcessor has no fps of its own: the issue's (and qwen-vl-utils') default
    out = processor(videos=[video], **kwargs)
    meta = out["video_metadata"][0]
    indices = [int(i) for i in meta.frames_indices]
    tps = processor.temporal_patch_size
    record = {"indices": indices, "grid": [int(x) for x in out["video_grid_thw"][0]],
              "second_per_grid": tps / meta.sampled_fps}  # Qwen2_5_VLProcessor._process_videos
    if family.startswith("qwen3"):
        from transformers import Qwen3VLProcessor

        record["timestamps"] = Qwen3VLProcessor._calculate_timestamps(None, list(indices), meta.fps, tps)
    return record, out["pixel_values_videos"]


def ours(geometry: VideoGeometry, clip: tuple) -> dict:
    frames, fps, height, width = clip
    indices = geometry.sample(frames, fps)
    timing = geometry.timing(indices, frames, fps)
    return {"indices": indices, "grid": list(geometry.grid(len(indices), height, width)),
            "second_per_grid": timing.second_per_grid, "timestamps": list(timing.timestamps)}


def main(out_dir: Path) -> int:
    fixture = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
               "configs": {}, "clips": [], "pixels": []}
    failures = 0
    dirs = {}
    for name, family, file_name, config in CONFIGS:
        directory = Path(tempfile.mkdtemp(prefix=name))
        (directory / file_name).write_text(json.dumps(config))
        dirs[name] = (family, directory)
        fixture["configs"][name] = {"family": family, "file": file_name, "config": config}
        processor = hf_processor(family, directory)
        geometry = VideoGeometry.from_checkpoint(directory, family)
        for clip in CLIPS:
            frames, fps, height, width = clip
            video = torch.zeros(1, height, width, 3, dtype=torch.uint8).expand(frames, -1, -1, -1)
            try:
                hf, _ = hf_run(processor, family, video, fps)
                mine = ours(geometry, clip)
            except Exception as err:  # noqa: BLE001 (a report, not a library)
                failures += 1
                print(f"{name:16} {clip}: FAILED {err!r}")
                continue
            same = all(mine[k] == hf[k] if k != "second_per_grid" else abs(mine[k] - hf[k]) < 1e-9 for k in hf)
            failures += not same
            print(f"{name:16} {clip}: hf {hf['grid']} {len(hf['indices'])} frames — {'same' if same else f'DIFFERENT: {mine}'}")
            fixture["clips"].append({"config": name, "clip": list(clip), **hf})
    for name, seed, frames, fps, height, width in PIXEL_CLIPS:
        try:
            failures += compare_pixels(fixture, out_dir, dirs[name], name, seed, frames, fps, height, width)
        except Exception as err:  # noqa: BLE001
            failures += 1
            print(f"pixels {name} seed {seed}: FAILED {err!r}")
    (out_dir / "hf_video_reference.json").write_text(json.dumps(fixture, indent=1))
    print(f"{failures} difference(s)")
    return 1 if failures else 0


def compare_pixels(fixture, out_dir, found, name, seed, frames, fps, height, width) -> int:
    family, directory = found
    processor = hf_processor(family, directory)
    clip = seeded_clip(seed, frames, height, width)
    hf, pixels = hf_run(processor, family, clip, fps)
    digest = hashlib.sha256(pixels.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
    ours_pre = VideoPreprocessor.from_config(family, json.loads(next(directory.iterdir()).read_text()))
    sampled = torch.from_numpy(clip[hf["indices"]])
    mine, grid = ours_pre(sampled)
    cpu_diff = float((mine - pixels).abs().max())
    record = {"config": name, "seed": seed, "clip": [frames, fps, height, width], "grid": hf["grid"],
              "sha256": digest, "cpu_max_abs_diff": cpu_diff}
    if torch.cuda.is_available():
        _, gpu_pixels = hf_run(processor, family, torch.from_numpy(clip), fps, device="cuda")
        gpu_mine, _ = ours_pre(sampled.cuda())
        record["gpu_max_abs_diff"] = float((gpu_mine - gpu_pixels.to(gpu_mine.device)).abs().max())
        record["gpu_vs_cpu_max_abs_diff"] = float((gpu_pixels.cpu() - pixels).abs().max())
    failed = cpu_diff != 0 or list(grid) != hf["grid"]
    print(f"pixels {name} seed {seed}: grid {hf['grid']} cpu diff {cpu_diff} "
          f"gpu diff {record.get('gpu_max_abs_diff')} (HF gpu vs cpu {record.get('gpu_vs_cpu_max_abs_diff')})")
    fixture["pixels"].append(record)
    np.save(out_dir / f"hf_pixels_{seed}.npy", pixels.numpy())
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
