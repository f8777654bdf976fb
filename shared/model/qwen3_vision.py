"""The Qwen3-VL vision tower: patches of many images → one row per merged patch, deepstack levels beside it.

Like Qwen2-VL's tower (``shared.model.vision``, whose attention, ``shared.model.vision_attention``, it
reuses) it runs images of any sizes as one packed batch with attention confined to each image. What
differs:

- patches of 16 pixels, embedded with a bias;
- a learned square table of position embeddings, resampled bilinearly (corners aligned) to each
  image's patch grid and added to the patch embeddings, besides the 2-D rotary;
- LayerNorm blocks with a plain GELU(tanh) MLP and full attention in every block;
- deepstack: after each block listed in ``deepstack_layers``, a merger of its own (normalizing the
  concatenated 2×2 block, not each patch) projects that block's features into the language model's
  width. The output row of a merged patch is ``[merger, level 0, level 1, …]`` (``shared.model.deepstack``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import VisionConfig
from shared.model.geometry import Grid
from shared.model.rope import VisionRotaryEmbedding
from shared.model.vision import in_pieces, layout_forward
from shared.model.vision_attention import SegmentAttention, VisionAttention


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.width, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.width, config.mlp_hidden, bias=True)
        self.linear_fc2 = nn.Linear(config.mlp_hidden, config.width, bias=True)
        self.approximate = "tanh" if config.act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.width, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, attend: SegmentAttention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each 2×2 block of patch features and projects it into the language model's width.
    The main merger normalizes each patch first; the deepstack mergers the concatenated block."""

    def __init__(self, config: VisionConfig, norm_merged: bool):
        super().__init__()
        self.merged = config.width * config.merge_size**2
        self.norm_merged = norm_merged
        self.norm = nn.LayerNorm(self.merged if norm_merged else config.width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.norm_merged else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@lru_cache(maxsize=256)  # images come in few sizes; the tensors are never written to
def block_major_coords(grid: Grid, merge: int) -> torch.Tensor:
    """``[t·h·w, 2]`` (row, column) of each patch in the processor's order: merge blocks row-major, the
    patches of a block row-major inside it, every frame alike."""
    t, h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    coords = [x.reshape(block).transpose(1, 2).flatten() for x in (rows, cols)]
    return torch.stack(coords, dim=-1).repeat(t, 1)


class PositionTable(nn.Module):
    """The learned ``side × side`` position embeddings, resampled to an image's grid: bilinear with the
    corners aligned (the table's corners land on the grid's corner patches)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.side = int(config.num_position_embeddings ** 0.5)
        self.merge = config.merge_size
        self.weight = nn.Parameter(torch.empty(config.num_position_embeddings, config.width))

    def forward(self, grids: Sequence[Grid]) -> torch.Tensor:
        taps, weights = zip(*(interpolation_taps(grid, self.side, self.merge) for grid in grids))
        taps, weights = torch.cat(taps).to(self.weight.device), torch.cat(weights).to(self.weight.device)
        return (self.weight[taps] * weights[..., None]).sum(1)  # [N, width], float32 at least


@lru_cache(maxsize=256)
def interpolation_taps(grid: Grid, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four table rows per patch and their weights, ``[N, 4]`` each, in the processor's patch order."""
    _, h, w = grid
    coords = block_major_coords(grid, merge)
    (r0, r1), (wr0, wr1) = _axis_taps(coords[:, 0], h, side)
    (c0, c1), (wc0, wc1) = _axis_taps(coords[:, 1], w, side)
    taps = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], 1)
    return taps, torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], 1)


def _axis_taps(index: torch.Tensor, size: int, side: int):
    """The two table rows (or columns) around each grid index, and their weights, in float32."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    low = source.floor()
    # the weights as the reference writes them, 1 - |distance|, so they round the same way
    weights = tuple(1 - (source - low - offset).abs() for offset in (0, 1))
    low = low.long()
    return (low.clamp(max=side - 1), (low + 1).clamp(max=side - 1)), weights


class Qwen3VisionTower(nn.Module):
    pieces = None  # shared.model.pieces.Pieces once captured: forwards of up to their patches run there

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = PositionTable(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_merged=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, norm_merged=True) for _ in config.deepstack_layers)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid], grouped: bool | None = None) -> torch.Tensor:
        """``patches`` ``[N, patch_dim]`` of all images, concatenated → ``[N / merge², embedding_width]``."""
        return layout_forward(self, patches, grids, patches.is_cuda if grouped is None else grouped)

    def layout(self, grids: Sequence[Grid], device: torch.device, grouped: bool) -> "_Layout":
        """What a batch of images of ``grids`` needs on the device besides its patches."""
        pos = self.pos_embed(grids)
        coords = torch.cat([block_major_coords(g, self.config.merge_size) for g in grids]).to(device)
        cos, sin = self.rotary(coords)
        cu = [0]
        for t, h, w in grids:  # each frame attends over itself
            first = cu[-1]  # not read inside the generator: extend appends as it iterates
            cu.extend(first + h * w * (i + 1) for i in range(t))
        attend = SegmentAttention(cu, device, grouped, recurring=all(t == 1 for t, _, _ in grids))  # video: flash
        return _Layout(pos, cos, sin, attend)

    def run(self, patches: torch.Tensor, layout: "_Layout", pieces: bool = False) -> torch.Tensor:
        """The forward over ``patches`` laid out as ``layout`` says (``pieces``: through the pieces' graphs
        where they hold the batch; device work alone either way)."""
        x = self.patch_embed(patches)
        x = x + layout.pos.to(x.dtype)
        levels = []
        layers = self.config.deepstack_layers
        if pieces and in_pieces(self, x):
            between = {i: lambda hidden, i=i: levels.append(self.deepstack_merger_list[layers.index(i)](hidden))
                       for i in layers}
            x, residual = self.pieces.run(
                x, lambda i, qkv: self.blocks[i].attn.attend(qkv, layout.cos, layout.sin, layout.attend), between)
            x = residual + x
        else:
            for i, block in enumerate(self.blocks):
                x = block(x, layout.cos, layout.sin, layout.attend)
                if i in layers:
                    levels.append(self.deepstack_merger_list[layers.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=-1)


@dataclass
class _Layout:
    pos: torch.Tensor  # [N, width] position embeddings
    cos: torch.Tensor
    sin: torch.Tensor
    attend: SegmentAttention
