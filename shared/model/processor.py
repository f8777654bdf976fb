"""Image preprocessing, without torchvision.

How many tokens an image becomes is ``shared.model.geometry`` (no pixels touched). The encoder turns decoded pixels into flattened patches in one of two ways:

- ``ImagePreprocessor``: the checkpoint's own image processor (its PIL backend) on CPU threads, so its
  output is exactly the reference's;
- ``TorchImagePreprocessor``: the same steps as tensor operations on the encoder's device (the GPU),
  where a 1080p image takes about a millisecond instead of ~100 ms of CPU, and the same values: Pillow's
  fixed-point resize to the integer (``shared.model.resample``), then HF's rescale and normalize in
  HF's order and precisions. It reads the checkpoint's settings itself (``PixelSteps``,
  ``ImageGeometry``): importing HF's processor costs ~2.5 s of CPU per process (transformers'
  processing module pulls in its modeling stack, torch._dynamo and torch.distributed), for values in
  one JSON file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.model.geometry import Grid, ImageGeometry
from shared.model.resample import pillow_version, resize_bicubic


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

    def __call__(self, pixels: np.ndarray) -> tuple[np.ndarray, Grid]:
        # The layout is given, not inferred: HF guesses channels from the shape, and reads a 1×1 or 3×N
        # image as channels-first.
        out = self._processor(images=[pixels], return_tensors="np", input_data_format="channels_last")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grid


_PIL_BICUBIC = 3
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PixelSteps:
    """What the checkpoint's image processor does to pixel values besides the resize rule (``ImageGeometry``),
    as HF resolves it: the class defaults of ``Qwen2VLImageProcessorPil`` (transformers 5.24), then
    ``preprocessor_config.json``."""

    do_resize: bool = True
    resample: int = _PIL_BICUBIC  # a PIL resampling filter
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = _OPENAI_CLIP_STD

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "PixelSteps":
        raw = json.loads((Path(path) / "preprocessor_config.json").read_text())
        given = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        for name in ("image_mean", "image_std"):  # JSON lists; settings compare and hash as tuples
            if name in given:
                given[name] = tuple(given[name])
        return cls(**given)


def preprocess_mode(setting: str, device: torch.device) -> str:
    """``pil`` or ``torch`` for an encoder's ``preprocess`` setting: ``auto`` is torch on a GPU (well under a
    millisecond per 1080p image, against ~100 ms of CPU for PIL) and the exact PIL reference elsewhere."""
    if setting != "auto":
        return setting
    return "torch" if device.type == "cuda" else "pil"


class TorchImagePreprocessor:
    """Pixels (``[H, W, 3]`` uint8 tensor, on any device) → flattened patches ``[N, patch_dim]`` on the same
    device, in ``dtype``: resize (Pillow's bicubic, to its integers), rescale, normalize, patchify, in the
    order, precisions and layout of the checkpoint's processor (float32: its patches bit for bit)."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32):
        steps = PixelSteps.from_checkpoint(path)
        if not (steps.do_resize and steps.resample == _PIL_BICUBIC and steps.do_rescale and steps.do_normalize):
            raise ValueError("this checkpoint's image processor is not resize(bicubic)-rescale-normalize: "
                             "preprocess with its own processor (--preprocess pil)")
        self.geometry = ImageGeometry.from_checkpoint(path)
        self.dtype = dtype
        self._pillow = pillow_version()  # the reference's pass order is the installed Pillow's
        self._rescale = steps.rescale_factor
        self._mean = torch.tensor(steps.image_mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(steps.image_std, dtype=torch.float32).view(3, 1, 1)

    def grid(self, height: int, width: int) -> Grid:
        return self.geometry.grid(height, width)

    batches = True  # takes images of one size stacked (``VisionBatcher``: one chain of kernels for them all)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image ``[H, W, 3]``, or ``[n, H, W, 3]`` images of one size: their patches one image after
        another, each as it would come alone (every step works per image)."""
        g = self.geometry
        images = pixels if pixels.dim() == 4 else pixels.unsqueeze(0)
        n, height, width = (int(x) for x in images.shape[:3])
        h, w = g.resized(height, width)
        image = resize_bicubic(images.permute(0, 3, 1, 2), h, w, self._pillow)  # float64 integers
        if self._mean.device != image.device:  # once: the constants live where the pixels are
            self._mean, self._std = self._mean.to(image.device), self._std.to(image.device)
        # HF's rescale (in float64, then to float32) and normalize (float32), in its order
        image = ((image * self._rescale).float() - self._mean) / self._std  # [n, 3, h, w]
        m, p, t = g.merge_size, g.patch_size, g.temporal_patch_size
        gh, gw = h // p, w // p
        # n gh gw mh mw C ph pw
        patches = image.view(n, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        patches = patches.unsqueeze(6).expand(*patches.shape[:6], t, p, p)  # a still image fills every frame
        return patches.reshape(n * gh * gw, 3 * t * p * p).to(self.dtype)
