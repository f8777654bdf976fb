"""Image preprocessing and tokenizer loading, without torchvision.

The frontend only needs how many tokens an image becomes (``ImageGeometry``: the processor's resize
rule, no pixels touched). The encoder turns decoded pixels into flattened patches with the
checkpoint's own image processor (its PIL backend), so its output is exactly the reference's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
        """The processor's resize rule: sides multiple of patch×merge, area within [min, max] pixels."""
        factor = self.patch_size * self.merge_size
        if min(height, width) <= 0:
            raise ValueError("image has no pixels")
        if max(height, width) / min(height, width) > 200:
            raise ValueError("image aspect ratio must be below 200:1")
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

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        _, gh, gw = self.grid(height, width)
        return gh * gw // self.merge_size**2


def load_image_processor(path: str | Path):
    """The checkpoint's image processor, PIL backend (torchvision-free)."""
    try:
        from transformers import Qwen2VLImageProcessorPil as processor_class
    except ImportError:  # transformers releases without the backend split
        from transformers import Qwen2VLImageProcessor as processor_class
    return processor_class.from_pretrained(str(path))


class ImagePreprocessor:
    """Pixels (``[H, W, 3]`` uint8) → flattened patches ``[N, patch_dim]`` float32 and the patch grid."""

    def __init__(self, path: str | Path):
        self._processor = load_image_processor(path)

    def __call__(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        out = self._processor(images=[pixels], return_tensors="np")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grid


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
