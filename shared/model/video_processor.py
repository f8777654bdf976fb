"""Sampled video frames → flattened ViT patches, as HF's video processors compute them, without torchvision.

HF's video processors run on torchvision: frames channels-first, ``resize`` (bicubic, antialiased),
rescale and normalize fused into one ``normalize`` by mean·255 and std·255 in float32, then patches of
``temporal_patch_size`` frames (the last frame repeated to fill the last one). torchvision resizes
uint8 natively on CPU (torch's uint8 kernel, fixed-point between its two passes) but on a GPU casts to
float32, resizes, clamps and rounds: the two differ by up to ~12 8-bit steps, so this module does what
torchvision does *on the device the frames are on* — the CPU path is HF's CPU output bit for bit, the
GPU path HF's GPU output.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from shared.model.config import ModelConfig
from shared.model.geometry import Grid
from shared.model.video import _DEFAULTS, VideoGeometry, video_processor_config

_BICUBIC = 3  # PILImageResampling.BICUBIC, what both Qwen video processors resample with


class VideoPreprocessor:
    """Frames ``[T, H, W, 3]`` uint8 (on any device) → patches ``[t·h·w, patch_dim]`` and the grid."""

    def __init__(self, geometry: VideoGeometry, image_mean, image_std, rescale_factor: float = 1 / 255,
                 dtype: torch.dtype = torch.float32):
        self.geometry = geometry
        self.dtype = dtype
        # HF fuses rescale into normalize: (x - mean / rescale) / (std / rescale), float32 constants
        self._mean = torch.tensor(image_mean) * (1.0 / rescale_factor)
        self._std = torch.tensor(image_std) * (1.0 / rescale_factor)

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "VideoPreprocessor":
        return cls.from_config(ModelConfig.from_checkpoint(path).family, video_processor_config(path), dtype)

    @classmethod
    def from_config(cls, family: str, raw: dict, dtype: torch.dtype = torch.float32) -> "VideoPreprocessor":
        geometry = VideoGeometry.from_config(family, raw)
        if int(raw.get("resample", _BICUBIC)) != _BICUBIC or raw.get("do_resize") is False \
                or raw.get("do_rescale") is False or raw.get("do_normalize") is False:
            raise ValueError("this checkpoint's video processor is not resize(bicubic)-rescale-normalize")
        defaults = _DEFAULTS[geometry.rule]
        return cls(geometry, raw.get("image_mean") or defaults["image_mean"],
                   raw.get("image_std") or defaults["image_std"], raw.get("rescale_factor") or 1 / 255, dtype)

    def grid(self, num_frames: int, height: int, width: int) -> Grid:
        return self.geometry.grid(num_frames, height, width)

    def __call__(self, frames: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        g = self.geometry
        num_frames, height, width = (int(x) for x in frames.shape[:3])
        h, w = g.resized(num_frames, height, width)
        video = resize_frames(frames.permute(0, 3, 1, 2).contiguous(), h, w)  # [T, 3, h, w] uint8
        if self._mean.device != video.device:  # once: the constants live where the frames are
            self._mean, self._std = self._mean.to(video.device), self._std.to(video.device)
        video = (video.to(torch.float32) - self._mean.view(3, 1, 1)) / self._std.view(3, 1, 1)
        return self._patchify(video), self.grid(num_frames, height, width)

    def _patchify(self, video: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        t, p, m = g.temporal_patch_size, g.patch_size, g.merge_size
        if pad := -video.shape[0] % t:  # the last temporal patch is filled with the last frame
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        frames, channels, h, w = video.shape
        gt, gh, gw = frames // t, h // p, w // p
        patches = video.view(gt, t, channels, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, gh/m, gw/m, m, m, C, t, p, p
        return patches.reshape(gt * gh * gw, channels * t * p * p).to(self.dtype)


def resize_frames(video: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[T, 3, H, W]`` uint8 → ``[T, 3, h, w]`` uint8, bicubic antialiased, torchvision's way on this device."""
    if tuple(video.shape[-2:]) == (h, w):
        return video
    if video.device.type == "cpu":  # torch's native uint8 kernel, as torchvision uses on CPU
        return F.interpolate(video, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
    resized = F.interpolate(video.float(), size=[h, w], mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)
