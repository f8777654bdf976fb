"""The vision tower of Qwen2-VL and Qwen2.5-VL: patches of many images → one embedding per merged patch.

Images of different sizes (and from different requests) run as one packed, variable-length batch:
attention is confined to each image (full-attention blocks) or to each window of an image (Qwen2.5-VL's
windowed blocks) through ``cu_seqlens`` (``shared.model.vision_attention``), so a batch gives the same
result as one image at a time and nothing is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import enabled, fused
from shared.model.config import VisionConfig
from shared.model.geometry import Grid
from shared.model.rope import VisionRotaryEmbedding
from shared.model.text import RMSNorm
from shared.model.vision_attention import SegmentAttention, VisionAttention


_ACTIVATIONS = {  # the checkpoint's ``hidden_act``, as transformers' ACT2FN reads it
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


def _activation(name: str):
    # An unknown name is refused: silently running another activation gives plausible, wrong embeddings.
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.gated = config.family == "qwen2_5_vl"
        self.act = _activation(config.act)
        if self.gated:
            # Qwen2.5-VL's 3,420 hidden units make row strides that are not 16-byte aligned, which sends
            # cuBLAS to slow fallback kernels. Dead units (zero weights in and out) pad it to a multiple
            # of 64: the function is unchanged.
            self.intermediate = -(-config.mlp_hidden // 64) * 64
            self.gate_up_proj = nn.Linear(config.width, 2 * self.intermediate, bias=True)
            self.down_proj = nn.Linear(self.intermediate, config.width, bias=True)
            self.fused_offsets = [0, self.intermediate]  # the loader puts the checkpoint's gate, up here
            self.padded_params = {"down_proj.weight"}
        else:
            self.fc1 = nn.Linear(config.width, config.mlp_hidden, bias=True)
            self.fc2 = nn.Linear(config.mlp_hidden, config.width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fc2(self.act(self.fc1(x)))
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and enabled("fused") and self.act is F.silu:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _norm(config: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if config.family == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = _norm(config, config.width)
        self.norm2 = _norm(config, config.width)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, residual, cos, sin, attend: SegmentAttention):
        """Like the language model's layers: ``x`` is the previous block's output not yet added to
        ``residual`` (None for the first block), so the add fuses into the norm on GPU."""
        h, residual = _add_norm(self.norm1, x, residual)
        h = self.attn(h, cos, sin, attend)
        h, residual = _add_norm(self.norm2, h, residual)
        return self.mlp(h), residual


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    if residual is None:
        return norm(x), x
    if isinstance(norm, RMSNorm):
        return norm.add_forward(x, residual)
    residual = residual + x
    return norm(residual), residual


def layout_forward(tower: nn.Module, patches: torch.Tensor, grids: Sequence[Grid], grouped: bool) -> torch.Tensor:
    """A tower's forward: ``tower.run`` over ``tower.layout`` of ``grids``, through the layout's whole-forward
    graph where it has one or captures it now (``shared.model.pieces.LayoutGraphs``, GPU only)."""
    layouts = tower.pieces.layouts if tower.pieces is not None and patches.is_cuda else None
    if layouts is not None:
        out = layouts.run(tuple(map(tuple, grids)), patches, lambda: tower.layout(grids, patches.device, grouped),
                          tower.run)
        if out is not None:
            return out
    return tower.run(patches, tower.layout(grids, patches.device, grouped), pieces=True)


def in_pieces(tower: nn.Module, x: torch.Tensor) -> bool:
    """Whether a tower's forward over ``x`` (its patches' hidden states) runs through its ``pieces``."""
    return tower.pieces is not None and tower.pieces.bucket(x.shape[0]) is not None


class PatchMerger(nn.Module):
    """Concatenates each 2×2 block of patch features and projects it into the language model's width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged = config.width * config.merge_size**2
        self.ln_q = _norm(config, config.width)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, config.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.width, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


@dataclass
class PackedLayout:
    """Where each patch of a packed batch goes: window order, segment bounds, rotary coordinates."""

    order: torch.Tensor  # merged-patch permutation into window order
    restore: torch.Tensor  # its inverse
    cu_images: list[int]  # full-attention segments, in patches
    cu_windows: list[int]  # windowed-attention segments, in patches
    rows_cols: torch.Tensor  # [N, 2] patch coordinates, merge-block-major


def packed_layout(grids: Sequence[Grid], config: VisionConfig) -> PackedLayout:
    m = config.merge_size
    unit = m * m
    window = config.window_size // m // config.patch_size if config.window_size else 0
    order, cu_images, cu_windows, coords = [], [0], [0], []
    base = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).view(t, gh, gw) + base
        if window:
            for frame in index:
                for r in range(0, gh, window):
                    for c in range(0, gw, window):
                        cell = frame[r:r + window, c:c + window].reshape(-1)
                        order.append(cell)
                        cu_windows.append(cu_windows[-1] + cell.numel() * unit)
        else:
            order.append(index.reshape(-1))
        base += t * gh * gw
        # one full-attention segment per frame (the reference's convention); the bounds are computed from
        # this image's start, not from the list's last entry while it grows
        start = cu_images[-1]
        cu_images.extend(start + h * w * (i + 1) for i in range(t))
        rr, cc = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (gh, m, gw, m)
        coords.append(torch.stack([rr.reshape(block).transpose(1, 2).flatten(),
                                   cc.reshape(block).transpose(1, 2).flatten()], dim=-1).repeat(t, 1))
    order_t = torch.cat(order)
    return PackedLayout(order=order_t, restore=torch.argsort(order_t), cu_images=cu_images,
                        cu_windows=cu_windows if window else cu_images, rows_cols=torch.cat(coords))


@dataclass
class DeviceLayout:
    """A packed batch's layout on the device: window order and its inverse, rotary tables, attentions."""

    order: torch.Tensor
    restore: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    full: SegmentAttention
    windowed: SegmentAttention


class VisionTower(nn.Module):
    pieces = None  # shared.model.pieces.Pieces once captured: forwards of up to their patches run there

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid], grouped: bool | None = None) -> torch.Tensor:
        """``patches`` ``[N, patch_dim]`` of all images, concatenated → ``[N / merge², out_dim]``."""
        return layout_forward(self, patches, grids, patches.is_cuda if grouped is None else grouped)

    def layout(self, grids: Sequence[Grid], device: torch.device, grouped: bool) -> DeviceLayout:
        """What a batch of images of ``grids`` needs on the device besides its patches."""
        packed = packed_layout(grids, self.config)
        unit = self.config.merge_size ** 2
        order = packed.order.to(device)
        cos, sin = self.rotary(self._to_window_order(packed.rows_cols.to(device), order, unit))
        images = all(t == 1 for t, _, _ in grids)  # video: the flash kernel only (``_attention``)
        full = SegmentAttention(packed.cu_images, device, grouped, images)
        windowed = SegmentAttention(packed.cu_windows, device, grouped, images) \
            if packed.cu_windows != packed.cu_images else full
        return DeviceLayout(order, packed.restore.to(device), cos, sin, full, windowed)

    def run(self, patches: torch.Tensor, layout: DeviceLayout, pieces: bool = False) -> torch.Tensor:
        """The forward over ``patches`` laid out as ``layout`` says (``pieces``: through the pieces' graphs
        where they hold the batch; device work alone either way)."""
        x = self._to_window_order(self.patch_embed(patches), layout.order, self.config.merge_size ** 2)
        cos, sin = layout.cos, layout.sin
        attend = [layout.full if i in self.config.fullatt_blocks else layout.windowed for i in range(len(self.blocks))]
        if pieces and in_pieces(self, x):
            x, residual = self.pieces.run(x, lambda i, qkv: self.blocks[i].attn.attend(qkv, cos, sin, attend[i]))
        else:
            residual = None
            for i, block in enumerate(self.blocks):
                x, residual = block(x, residual, cos, sin, attend[i])
        return self.merger(x + residual)[layout.restore]

    @staticmethod
    def _to_window_order(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
        return x.view(-1, unit, *x.shape[1:])[order].reshape(x.shape)
