"""Rotary position embeddings: multimodal (3-axis) positions for the language model, 2-D for the ViT.

Qwen2-VL's M-RoPE gives every token a (temporal, height, width) position. Text tokens use the same
value on all three axes; an image's tokens take their grid coordinates offset by the position where the
image starts, and the text after it continues from ``start + max(h, w)``. Only the grid metadata is
needed (vLLM's "metadata-only" idea): prefill never sees pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from shared.model.geometry import Grid


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def mrope_positions(num_tokens: int, images: Sequence[tuple[int, Grid] | tuple[int, Grid, float]],
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions ``[3, num_tokens]`` for a prompt and the delta that continues them during decode.

    ``images`` lists ``(offset, (t, h, w))`` or ``(offset, (t, h, w), time_interval)``: where each image's
    (or video's) placeholder run starts in the prompt, its patch grid, and how far apart its temporal
    patches sit (Qwen2.5-VL video: tokens_per_second × second_per_grid, a float32 value; else 1). The
    text after a run continues from ``start + max(h, w) / merge`` (transformers 5's rule, for video too).
    The delta is ``max_position + 1 - num_tokens``; a token generated at index ``i`` (counted over the
    whole sequence) sits at position ``i + delta`` on every axis.
    """
    pieces: list[torch.Tensor] = []
    cursor = 0  # next prompt index not yet placed
    next_pos = 0  # next free position value
    for image in sorted(images):
        offset, (t, h, w) = image[0], image[1]
        interval = image[2] if len(image) > 2 else 1
        if offset < cursor:
            raise ValueError("image placeholder runs overlap")
        text_len = offset - cursor
        pieces.append(torch.arange(text_len).expand(3, -1) + next_pos)
        next_pos += text_len
        gh, gw = h // merge_size, w // merge_size
        temporal = torch.arange(t) if interval == 1 else (torch.arange(t) * interval).long()  # HF truncates
        tt, hh, ww = torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + next_pos)
        cursor = offset + t * gh * gw
        next_pos += max(gh, gw)
    if cursor > num_tokens:
        raise ValueError("image placeholder runs extend past the prompt")
    pieces.append(torch.arange(num_tokens - cursor).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1)
    max_pos = int(positions.max()) if positions.numel() else -1
    return positions, max_pos + 1 - num_tokens


def video_time_interval(tokens_per_second: float, second_per_grid: float) -> float:
    """Qwen2.5-VL's spacing of a clip's temporal positions, as HF computes it: in float32 (the processor
    hands ``second_per_grid_ts`` over as a float32 tensor), so the truncated positions agree exactly."""
    if not tokens_per_second or not second_per_grid:
        return 1
    return float(torch.tensor(second_per_grid, dtype=torch.float32) * tokens_per_second)


class MRotaryEmbedding(torch.nn.Module):
    """cos/sin for 3-axis positions: each frequency band takes its angle from one axis (``mrope_section``)."""

    def __init__(self, head_dim: int, theta: float, section: Sequence[int]):
        super().__init__()
        self.head_dim, self.theta, self.section = head_dim, theta, tuple(section)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.register_buffer("axis_of_band", torch.empty(head_dim // 2, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the constant tables; called again after the module is materialized from ``meta``."""
        if self.inv_freq.is_meta:
            # Nothing to compute until materialized; and a meta arange runs torch's Python reference,
            # whose first call imports torch._dynamo (~1 s of CPU in every process that builds a model).
            return
        device = self.inv_freq.device
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        self.inv_freq = 1.0 / (self.theta ** exponent)
        # axis_of_band[j]: which of (t, h, w) drives frequency band j
        self.axis_of_band = torch.cat([torch.full((n,), i % 3, device=device) for i, n in enumerate(self.section)])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[3, T]`` → cos, sin ``[T, head_dim]``."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        band = torch.gather(freqs, 0, self.axis_of_band.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((band, band), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, D]``; cos/sin ``[T, D]``."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class VisionRotaryEmbedding(torch.nn.Module):
    """2-D rotary angles for ViT patches: half the bands follow the row, half the column."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = head_dim // 2, theta
        self.register_buffer("inv_freq", torch.empty(self.dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        if self.inv_freq.is_meta:
            return  # until materialized (see ``MRotaryEmbedding.init_buffers``)
        device = self.inv_freq.device
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        self.inv_freq = 1.0 / (self.theta ** exponent)

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows_cols`` ``[N, 2]`` → float32 cos, sin ``[N, head_dim]``."""
        freqs = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [N, 2 * D/4]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
