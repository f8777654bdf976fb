"""Attention of the vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): bidirectional, confined to segments of
the packed patches — each image (each frame of a clip) in full-attention blocks, each window of an image in
Qwen2.5-VL's windowed blocks — with the 2-D rotary applied to q and k first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import attention as paged, enabled, fused, sdpa
from shared.model.config import VisionConfig
from shared.model.rope import rotate_half


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=True)
        self.proj = nn.Linear(config.width, config.width, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: "SegmentAttention") -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x), cos, sin, attend))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: "SegmentAttention") -> torch.Tensor:
        """The q|k|v projection's output ``[n, 3 · width]`` → attention's ``[n, width]``, before ``proj``."""
        n = qkv.shape[0]
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        if qkv.is_cuda and enabled("fused"):
            fused.rope_store(q, k, v, cos, sin, None, None, None)  # in place, float32 inside
        else:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return attend(q, k, v).reshape(n, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotary in float32, as the reference does, whatever the tower's dtype.
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


class SegmentAttention:
    """Bidirectional attention confined to segments ``[cu[i], cu[i+1])`` of the packed patches.

    The reference path attends segment by segment. The grouped path (GPU) batches segments of equal
    length — most windows of an image, images of one size — into one call each, without padding or
    masks, so the flash kernel applies; its gather indices are built once per forward, not per block.
    """

    SHORT = 128  # segments up to this long (windows) go to the one-tile Triton kernel on GPU

    def __init__(self, cu_seqlens: list[int], device: torch.device, grouped: bool, recurring: bool = True):
        self.cu_seqlens = cu_seqlens
        self.recurring = recurring  # images: shapes that come back may get cuDNN's kernel (``_attention``)
        self.groups: list[tuple[torch.Tensor | slice, int]] = []
        self.short: torch.Tensor | None = None
        if not grouped:
            return
        starts = torch.tensor(cu_seqlens[:-1])
        lengths = torch.tensor(cu_seqlens[1:]) - starts
        self.max_len = int(lengths.max())
        if device.type == "cuda" and enabled("fused") and self.max_len <= self.SHORT:
            self.short = torch.tensor(cu_seqlens, dtype=torch.int32).to(device, non_blocking=True)
            return
        for length in lengths.unique().tolist():
            first = starts[lengths == length]
            if torch.equal(first, first[0] + length * torch.arange(len(first))):  # back to back: a view
                self.groups.append((slice(int(first[0]), int(first[0]) + length * len(first)), length))
            else:
                index = first[:, None] + torch.arange(length)
                self.groups.append((index.to(device, non_blocking=True), length))  # [segments, length]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.short is not None:
            return paged.segment_attention(q, k, v, self.short, self.max_len)
        out = torch.empty_like(q)
        if self.groups:
            for group, length in self.groups:
                qs, ks, vs = (x[group] for x in (q, k, v))
                if isinstance(group, slice):  # [segments * length, H, D] → [segments, length, H, D]
                    qs, ks, vs = (x.unflatten(0, (-1, length)) for x in (qs, ks, vs))
                attended = _attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), self.recurring)
                attended = attended.transpose(1, 2)
                out[group] = attended.flatten(0, 1) if isinstance(group, slice) else attended
            return out
        for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]):
            seg = slice(start, end)
            out[seg] = F.scaled_dot_product_attention(
                q[seg].transpose(0, 1), k[seg].transpose(0, 1), v[seg].transpose(0, 1)).transpose(0, 1)
        return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recurring: bool) -> torch.Tensor:
    """Bidirectional attention over ``[segments, heads, length, dim]``. Each ViT batch has a shape of its
    own, so on the GPU it runs where no plan is built per shape (``shared.kernels.sdpa``): images in
    ``sdpa.recurring`` (cuDNN once a shape keeps coming back), video frames always in the flash kernel —
    cuDNN failed outright on a 10 s 720p clip's frames (``mha_graph.execute`` not good, then an illegal
    memory access, on the H200 with torch 2.11)."""
    return sdpa.recurring(q, k, v) if recurring else sdpa.flash(q, k, v)
