"""Video geometry: which frames a clip samples, the size they are resized to, the grid and the timing of
each temporal patch — the arithmetic of the checkpoint's HF video processor, without pixels.

Two rules, by family, each HF's (transformers 5.24) with ``do_sample_frames`` and ``fps`` (default 2):

- ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL): ``fps`` frames per second, at least ``min_frames``,
  at most ``max_frames`` and the clip's own frames, floored to a multiple of the temporal patch; picked
  at ``torch.arange(0, total, total / n)``. Each frame is resized by the image rule (``smart_resize``)
  within ``size`` per frame. Qwen2.5-VL spaces temporal positions by ``second_per_grid`` (the temporal
  patch over the sampled frame rate) × the config's ``tokens_per_second``.
- ``Qwen3VLVideoProcessor``: ``int(seconds × fps)`` frames clamped the same way (no multiple: the last
  frame pads the last temporal patch), at ``linspace(0, total - 1, n).round()``; resized within
  ``size`` over the whole clip (t × h × w). Each temporal patch is its own placeholder run after a
  ``<{seconds:.1f} seconds>`` timestamp (the mean time of its frames).

The token budget is the processor's ``cap_pixels_per_frame`` rule (qwen-vl-utils', and HF's default
from v5.22): frames of a long clip share ``max_video_tokens``, so a clip's cost grows with its length
more slowly than its frame count. Our default is on (HF 5.24 still defaults off, with a warning); a
checkpoint's config may say otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shared.model.config import QWEN3_FAMILIES
from shared.model.geometry import MAX_ASPECT_RATIO, Grid, ImageGeometry, grid_tokens

# The class defaults of HF's two video processors, before a checkpoint's config overrides them.
_DEFAULTS = {
    "qwen2": dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=128 * 28 * 28,
                  max_pixels=28 * 28 * 768, min_frames=4, max_frames=768, max_video_tokens=128000,
                  image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711)),
    "qwen3": dict(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=128 * 32 * 32,
                  max_pixels=32 * 32 * 768, min_frames=4, max_frames=768, max_video_tokens=768,
                  image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
}
DEFAULT_FPS = 2.0


def video_processor_config(path: str | Path) -> dict:
    """The checkpoint's video processor settings, found where HF looks, in its order: a nested
    ``video_processor`` in ``processor_config.json``, ``video_preprocessor_config.json``, then the image
    processor's ``preprocessor_config.json`` (checkpoints such as Qwen2.5-VL ship no video config)."""
    root = Path(path)
    nested = root / "processor_config.json"
    if nested.is_file() and "video_processor" in (raw := json.loads(nested.read_text())):
        return raw["video_processor"]
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            return json.loads((root / name).read_text())
    raise FileNotFoundError(f"no video or image processor config in {path}")


@dataclass(frozen=True)
class VideoTiming:
    """When a sampled clip's temporal patches happen (seconds)."""

    second_per_grid: float  # one temporal patch's span: temporal_patch_size / sampled fps (Qwen2.5-VL)
    timestamps: tuple[float, ...]  # each temporal patch's mean frame time (Qwen3-VL's prompt text)


@dataclass(frozen=True)
class VideoGeometry:
    rule: str  # "qwen2" (Qwen2-VL, Qwen2.5-VL) or "qwen3"
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size.shortest_edge
    max_pixels: int  # size.longest_edge: per frame (qwen2), per clip (qwen3)
    min_frames: int
    max_frames: int
    max_video_tokens: int  # the cap's budget: per clip (qwen2), per frame (qwen3)
    fps: float = DEFAULT_FPS
    cap_pixels_per_frame: bool = True

    @classmethod
    def from_config(cls, family: str, raw: dict) -> "VideoGeometry":
        rule = "qwen3" if family in QWEN3_FAMILIES else "qwen2"
        values = {**_DEFAULTS[rule]}
        size = raw.get("size") or {}
        values.update({k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_frames",
                                           "max_frames", "max_video_tokens") if raw.get(k) is not None})
        values["min_pixels"] = size.get("shortest_edge") or values["min_pixels"]
        values["max_pixels"] = size.get("longest_edge") or values["max_pixels"]
        if rule == "qwen2":  # Qwen2VLVideoProcessor lets min_pixels / max_pixels override size
            values["min_pixels"] = raw.get("min_pixels") or values["min_pixels"]
            values["max_pixels"] = raw.get("max_pixels") or values["max_pixels"]
        cap = raw.get("cap_pixels_per_frame")
        del values["image_mean"], values["image_std"]
        return cls(rule=rule, fps=float(raw.get("fps") or DEFAULT_FPS),
                   cap_pixels_per_frame=True if cap is None else bool(cap), **values)

    @classmethod
    def from_checkpoint(cls, path: str | Path, family: str) -> "VideoGeometry":
        return cls.from_config(family, video_processor_config(path))

    # -- sampling -----------------------------------------------------------------------------------
    def sample(self, total_frames: int, source_fps: float) -> list[int]:
        """Indices of the frames the processor keeps from a clip of ``total_frames`` at ``source_fps``."""
        if total_frames < 1 or source_fps <= 0:
            raise ValueError("the video has no frames or no frame rate")
        if self.rule == "qwen3":
            return self._sample_qwen3(total_frames, source_fps)
        return self._sample_qwen2(total_frames, source_fps)

    def _sample_qwen2(self, total: int, source_fps: float) -> list[int]:
        import numpy as np

        tps = self.temporal_patch_size
        most = math.floor(min(self.max_frames, total) / tps) * tps
        n = min(max(total / source_fps * self.fps, self.min_frames), most, total)
        n = math.floor(n / tps) * tps
        if n < 1:
            raise ValueError(f"the video has {total} frame(s); at least {tps} are needed")
        # the processor's torch.arange(0, total, total / n).int(): float32 values that torch's CPU kernel
        # computes in double, then truncated; numpy does the same without loading torch in the frontend
        step = total / n
        return (np.arange(math.ceil(total / step), dtype=np.float64) * step).astype(np.float32).astype(np.int64).tolist()

    def _sample_qwen3(self, total: int, source_fps: float) -> list[int]:
        import numpy as np

        n = int(total / source_fps * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, total)
        if n < self.temporal_patch_size:
            raise ValueError(f"the video has {total} frame(s); at least {self.temporal_patch_size} are needed")
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def sampled_count(self, total_frames: int, source_fps: float) -> int:
        return len(self.sample(total_frames, source_fps))

    # -- size and grid ------------------------------------------------------------------------------
    def resized(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Each sampled frame's size after the processor's resize, for ``num_frames`` sampled frames."""
        factor = self.patch_size * self.merge_size
        if self.rule == "qwen3":
            return self._resized_qwen3(num_frames, height, width, factor)
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # an even share of the clip's budget, never below the floor
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // num_frames),
                             int(self.min_pixels * 1.05))
        rule = ImageGeometry(self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels, max_pixels)
        return rule.resized(height, width)  # the image rule (HF's smart_resize), per frame

    def _resized_qwen3(self, num_frames: int, height: int, width: int, factor: int) -> tuple[int, int]:
        tps = self.temporal_patch_size
        if num_frames < tps:
            raise ValueError(f"at least {tps} frames are needed")
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // num_frames),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        if height < factor or width < factor:  # tiny frames are scaled up to one patch first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        _check_aspect(height, width)
        h, w = round(height / factor) * factor, round(width / factor) * factor
        t = round(num_frames / tps) * tps
        if t * h * w > max_pixels:
            beta = math.sqrt(num_frames * height * width / max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif t * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, num_frames: int, height: int, width: int) -> Grid:
        """``(t, h, w)`` in patches: the last temporal patch is padded with the last frame."""
        h, w = self.resized(num_frames, height, width)
        return -(-num_frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def num_tokens(self, num_frames: int, height: int, width: int) -> int:
        return grid_tokens(self.grid(num_frames, height, width), self.merge_size)

    # -- timing -------------------------------------------------------------------------------------
    def timing(self, indices: list[int], total_frames: int, source_fps: float) -> VideoTiming:
        tps = self.temporal_patch_size
        sampled_fps = len(indices) / total_frames * source_fps  # HF's VideoMetadata.sampled_fps
        padded = list(indices) + [indices[-1]] * (-len(indices) % tps)
        seconds = [i / source_fps for i in padded]
        stamps = tuple((seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps))
        return VideoTiming(second_per_grid=tps / sampled_fps, timestamps=stamps)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"video aspect ratio must be below {MAX_ASPECT_RATIO}:1")

