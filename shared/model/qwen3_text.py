"""The Qwen3-VL language model (dense and MoE), over the same paged KV cache and attention backends.

What differs from Qwen2-VL's (``shared.model.text``, whose norms and dense MLP it reuses):

- attention: no q/k/v bias, an explicit ``head_dim`` and an RMSNorm over each head of q and k (QK-norm)
  before rotary;
- interleaved M-RoPE: the frequency bands cycle through the (t, h, w) axes instead of taking three
  contiguous runs;
- MLP: a mixture of experts on the layers the config names (``shared.model.moe``);
- deepstack: features of intermediate ViT blocks are added to the image tokens' hidden states after
  each of the first decoder layers (``shared.model.deepstack``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import TextConfig
from shared.model.deepstack import Deepstack
from shared.model.moe import SparseMoeBlock
from shared.model.rope import MRotaryEmbedding
from shared.model import text
from shared.model.text import MLP, Attention as Qwen2Attention, RMSNorm


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Band ``j`` follows axis ``j mod 3`` (t, h, w, t, h, w, …) while that axis has bands left in
    ``mrope_section``; the bands past the h and w runs follow t."""

    def init_buffers(self) -> None:
        super().init_buffers()
        if self.axis_of_band.is_meta:
            return  # until materialized (see ``MRotaryEmbedding.init_buffers``)
        band = torch.arange(self.head_dim // 2, device=self.axis_of_band.device)
        axis = torch.zeros_like(band)
        for a in (1, 2):
            axis[(band % 3 == a) & (band < 3 * self.section[a])] = a
        self.axis_of_band = axis


class Attention(Qwen2Attention):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__(config, layer)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    @property
    def qk_norm(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm  # the backend applies them: on GPU in its rotary kernel


class DecoderLayer(text.DecoderLayer):
    attention = Attention

    def make_mlp(self, config: TextConfig, layer: int) -> nn.Module:
        moe = config.moe
        return SparseMoeBlock(moe, config.hidden_size) if moe and layer in moe.layers else MLP(config)


class Qwen3LanguageModel(text.LanguageModel):
    """Qwen2-VL's model with Qwen3's layers, interleaved M-RoPE where configured, and deepstack."""

    decoder_layer = DecoderLayer

    def make_rotary(self, config: TextConfig) -> MRotaryEmbedding:
        rotary = InterleavedMRotaryEmbedding if config.mrope_interleaved else MRotaryEmbedding
        return rotary(config.head_dim, config.rope_theta, config.mrope_section)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch, backend,
                deepstack: Deepstack | None = None) -> torch.Tensor:
        """``embeds`` ``[T, hidden]``, ``positions`` ``[3, T]`` → final hidden states ``[T, hidden]``.
        ``deepstack``: level ``i`` is added to the image rows after decoder layer ``i``."""
        cos, sin = self.rotary(positions, embeds.dtype)
        if self.in_pieces(embeds, batch):
            between = {i: lambda hidden, i=i: deepstack.add(hidden, i) for i in range(deepstack.num_levels)} \
                if deepstack is not None else None
            return self.through_pieces(embeds, cos, sin, batch, backend, between)
        x, residual = embeds, None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch, backend)
            if deepstack is not None and i < deepstack.num_levels:
                # the same rounding order as the reference: (residual + mlp) + level
                x, residual = deepstack.add(x + residual, i), None
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]
