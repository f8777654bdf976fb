"""Pillow's bicubic resize of 8-bit images as tensor operations, on any device, to the same integers.

HF's image processors (their PIL backend) resize with ``PIL.Image.resize(BICUBIC)``: two one-axis passes,
each rounded back to 8 bits, in the order the installed Pillow picks (``vertical_pass_first``). Pillow
computes a pass in fixed point (``Resample.c``): each output sample's filter taps are normalized in double
precision and turned into integers with 22 fractional bits; the products with the 8-bit inputs are summed
as integers, plus one half, shifted back and clipped. Here the same integer coefficients multiply the
same 8-bit values in float64 — every product and partial sum is an integer below 2^53, so exact in any
order — and the sums are rounded as Pillow rounds them. The coefficients come from
Pillow's formulas in Pillow's order of operations (numpy float64, one operation at a time: no fused
multiply-add), so they are Pillow's integers, and so is every pixel.

A float resize (``F.interpolate(antialias=True)``) rounded after each pass left pixels up to two 8-bit
steps from PIL's — enough to move a greedy token where HF's top two logits are within ~0.1.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
_A = -0.5  # Pillow's bicubic kernel (Keys' with a = -0.5), support 2


def pillow_version() -> tuple[int, int]:
    import PIL

    major, minor = PIL.__version__.split(".")[:2]
    return int(major), int(minor)


def vertical_pass_first(height: int, width: int, new_height: int, new_width: int,
                        pillow: tuple[int, int] | None = None) -> bool:
    """Whether Pillow's two-pass resize of ``height × width`` to ``new_height × new_width`` resamples the
    columns (vertical pass) before the rows. Each pass rounds to 8 bits, so the order shows: done the other
    way, pixels near edges land up to ~20 steps apart — enough to move a greedy token.

    Pillow < 12.2: rows always first. 12.2: columns first for images over 100 times taller than wide whose
    height shrinks. 13: columns first when the height shrinks by more than twice as many pixels as the width
    does (so always when the height shrinks and the width does not: 200×300 → 196×308 is one).
    """
    pillow = pillow or pillow_version()
    if pillow >= (13, 0):
        return new_height < height and height - new_height > 2 * (width - new_width)
    if pillow >= (12, 2):
        return height > 100 * width and new_height < height
    return False


def _bicubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    near = ((_A + 2.0) * x - (_A + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@lru_cache(maxsize=256)  # images come in few sizes; a pass's taps are a few KB
def pass_taps(size: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's taps for resampling one axis of ``size`` samples to ``new`` (``precompute_coeffs``,
    ``normalize_coeffs_8bpc``): each output sample's first input index ``[new]`` and its integer
    coefficients ``[new, taps]`` (zero past the sample's last tap)."""
    scale = size / new
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(new) + 0.5) * scale
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)  # C's (int) truncates
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), size) - first
    tap = np.arange(ksize)
    inside = tap[None, :] < count[:, None]
    weights = np.where(inside, _bicubic((tap[None, :] + first[:, None] - center[:, None] + 0.5) * (1.0 / filterscale)),
                       0.0)
    total = np.zeros(new)
    for column in weights.T:  # summed tap after tap, as Pillow does (numpy's sum is pairwise)
        total = total + column
    weights = np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0)
    fixed = weights * (1 << PRECISION_BITS)
    return first, np.trunc(np.where(weights < 0, fixed - 0.5, fixed + 0.5))


def _resample(image: torch.Tensor, axis: int, new: int) -> torch.Tensor:
    """One pass over ``axis`` of float64 8-bit values, before rounding: each output sample the sum of its taps'
    products, added tap after tap over the whole image (two kernels a tap, memory twice the output's; a
    dense matrix product would cost ``size`` multiply-adds an output sample instead of the taps' 5-9)."""
    size = image.shape[axis]
    first, coefficients = pass_taps(size, new)
    taps = coefficients.shape[1]
    index = torch.from_numpy(np.minimum(first[:, None] + np.arange(taps), size - 1)).to(image.device)  # past the end: 0
    weights = torch.from_numpy(coefficients).to(image.device)
    shape = [1] * image.dim()
    shape[axis] = new
    sums = torch.zeros((*image.shape[:axis], new, *image.shape[axis + 1:]), dtype=torch.float64, device=image.device)
    for tap in range(taps):
        sums.addcmul_(image.index_select(axis, index[:, tap]), weights[:, tap].view(shape))
    return sums


def _round(sums: torch.Tensor) -> torch.Tensor:
    # Pillow's clip8((sum + half) >> PRECISION_BITS): exact in float64 (a power of two, integers below 2^53)
    return torch.floor((sums + (1 << (PRECISION_BITS - 1))) / (1 << PRECISION_BITS)).clamp_(0, 255)


def resize_bicubic(images: torch.Tensor, height: int, width: int,
                   pillow: tuple[int, int] | None = None) -> torch.Tensor:
    """``images`` ``[n, C, H, W]`` of 8-bit values (any dtype) → ``[n, C, height, width]`` float64 holding
    exactly the integers ``PIL.Image.resize((width, height), BICUBIC)`` gives."""
    image = images.to(torch.float64)
    old_height, old_width = image.shape[-2:]
    vertical_first = vertical_pass_first(old_height, old_width, height, width, pillow)
    for vertical in (vertical_first, not vertical_first):
        size, new = (old_height, height) if vertical else (old_width, width)
        if size == new:  # Pillow skips a pass that changes nothing
            continue
        image = _round(_resample(image, image.dim() - (2 if vertical else 1), new))
    return image
