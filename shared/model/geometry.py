"""Image geometry: how many patches and language-model tokens an image becomes, without touching pixels.

One grid is ``(t, h, w)``: temporal patches (1 for a still image), rows and columns of ViT patches. The
ViT merges ``merge_size × merge_size`` neighbouring patches into one language-model token, so an image
costs ``t · h · w / merge_size²`` placeholder tokens. Every part of the stack counts tokens through
``grid_tokens``; the frontend sizes a prompt with ``ImageGeometry`` (the image processor's resize rule,
HF's ``smart_resize``) before any encoder has seen the image.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

Grid = tuple[int, int, int]

MAX_ASPECT_RATIO = 200  # the processors refuse more elongated images


def grid_tokens(grid: Grid, merge_size: int) -> int:
    """Language-model tokens of one image (or video) grid."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


@dataclass(frozen=True)
class ImageGeometry:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ImageGeometry":
        raw = json.loads((Path(path) / "preprocessor_config.json").read_text())
        size = raw.get("size") or {}
        return cls(
            patch_size=raw.get("patch_size", 14),
            merge_size=raw.get("merge_size", 2),
            temporal_patch_size=raw.get("temporal_patch_size", 2),
            min_pixels=raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels,
            max_pixels=raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels,
        )

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The processor's resize rule (HF ``smart_resize``): sides multiples of patch × merge, area
        within [min, max] pixels, aspect ratio kept as closely as that allows."""
        factor = self.patch_size * self.merge_size
        if min(height, width) <= 0:
            raise ValueError("image has no pixels")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"image aspect ratio must be below {MAX_ASPECT_RATIO}:1")
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, height: int, width: int) -> Grid:
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        return grid_tokens(self.grid(height, width), self.merge_size)
